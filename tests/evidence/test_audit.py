"""``audit verify`` on real runs (fake driver: the real C agent, no VM): a clean run verifies,
and every kind of tampering is caught, named, on a copy of the store."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cleanroom.checks.audit import AuditReport, verify_run
from cleanroom.errors import StoreError
from cleanroom.evidence import attest, keys
from cleanroom.evidence.seal import CHAIN_EVENTS, CHAIN_HEAD, seal_run
from cleanroom.evidence.statements import chain_statement, episode_statement
from cleanroom.ledger import Ledger, chain
from cleanroom.store import LocalStore
from cleanroom.store.base import record_bytes
from tests.batch.test_controller import Harness, manifest


@dataclass
class Runs:
    h: Harness
    trusted: list[Ed25519PublicKey]

    def copy(self, tmp: Path) -> Path:
        """A copy of the store (what a third party audits), to tamper with."""
        dest = tmp / "copy"
        shutil.copytree(self.h.store.root, dest)
        return dest

    def verify(self, root: Path, run_id: str = "A") -> AuditReport:
        return verify_run(LocalStore(root), run_id, self.trusted)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    h = Harness(tmp_path_factory.mktemp("audit"))
    batch = [manifest("a", seed=2), manifest("b", seed=4), manifest("c", mode="fail")]
    asyncio.run(h.ctl.run(batch, h.baseline, run_id="A"))
    asyncio.run(h.ctl.run([manifest("a", seed=2)], h.baseline, run_id="B"))
    yield Runs(h, [keys.signing_key().public_key()])
    h.ledger.close()


def folder(root: Path, eid: str, run_id: str = "A") -> Path:
    return root / "runs" / run_id / "episodes" / eid


def flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def first(report: AuditReport) -> str:
    assert not report.ok, "tampering went unnoticed"
    return report.problems[0]


def test_an_untouched_run_verifies(runs: Runs) -> None:
    for run_id, records in (("A", 3), ("B", 1)):
        report = verify_run(runs.h.store, run_id, runs.trusted)
        assert report.ok, report.problems
        assert report.records == report.envs == records and report.run_id == run_id
        assert report.events == 4 * records + 1  # intent, created, destroyed, end; run end
        assert report.status == {e: "verified" for e in report.status}
    record = runs.h.store.get_record("A", "a")
    assert record is not None
    raw = runs.h.store.get_bytes("A", "a", record["attestation"])
    assert raw is not None
    envelope = json.loads(raw)
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    stmt = attest.open_envelope(raw, runs.trusted, "x")
    assert stmt["_type"] == "https://in-toto.io/Statement/v1"
    names = {s["name"] for s in stmt["subject"]}
    assert {"result.json", "attempts/1/artifacts/hello.txt", "attempts/1/logs/stdout.log"} <= names
    pred = stmt["predicate"]
    assert pred["baseline"]["digest"] == runs.h.baseline.digest
    assert pred["env"]["id"] == record["provenance"]["env_id"] and pred["env"]["fresh"] is True
    assert pred["driver"]["name"] == "fake" and pred["outcome"] == "completed"


def test_a_flipped_byte_in_an_artifact_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    flip(folder(root, "a") / "attempts/1/artifacts/hello.txt")
    report = runs.verify(root)
    assert first(report) == (
        "episode a: attempts/1/artifacts/hello.txt does not match its signed digest"
    )
    assert report.status["b"] == "verified" and report.status["a"] == report.problems[0]


def test_a_flipped_byte_in_a_record_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    path = folder(root, "b") / "result.json"
    flip(path, path.read_bytes().index(b'"seed": 4') + len('"seed": '))  # 4 -> 5
    assert first(runs.verify(root)) == "episode b: result.json does not match its signed digest"


def test_a_flipped_byte_in_a_log_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    flip(folder(root, "c") / "attempts/1/logs/stderr.log", 0)
    report = runs.verify(root)  # an episode_error is final: its record signs its logs too
    assert first(report) == "episode c: attempts/1/logs/stderr.log does not match its signed digest"


def events_file(root: Path, run_id: str = "A") -> Path:
    return root / "runs" / run_id / CHAIN_EVENTS


def test_a_deleted_ledger_event_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    lines = events_file(root).read_bytes().splitlines(keepends=True)
    events_file(root).write_bytes(b"".join(lines[:4] + lines[5:]))
    assert first(runs.verify(root)) == ("run A ledger chain: event 5 is missing (found seq 6)")


def test_the_last_ledger_events_dropped_are_caught_by_the_signed_head(
    runs: Runs, tmp_path: Path
) -> None:
    root = runs.copy(tmp_path)
    lines = events_file(root).read_bytes().splitlines(keepends=True)
    events_file(root).write_bytes(b"".join(lines[:-2]))
    n, kept = len(lines), json.loads(lines[-3])["hash"][:12]
    head = json.loads(lines[-1])["hash"][:12]
    assert first(runs.verify(root)) == (
        f"run A ledger chain: the chain ends at event ({n - 2}, '{kept}'), "
        f"its signed head at ({n}, '{head}')"
    )


def test_records_swapped_between_runs_are_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    a_in_a, a_in_b = folder(root, "a"), folder(root, "a", "B")
    shutil.rmtree(a_in_a)
    shutil.copytree(a_in_b, a_in_a)  # the whole folder, statements and all
    assert first(runs.verify(root)) == (
        "episode a: its signed statement is of run/episode/attempt ('B', 'a', 1)"
    )
    root2 = runs.copy(tmp_path / "2")  # the record alone
    shutil.copy(folder(root2, "a", "B") / "result.json", folder(root2, "a") / "result.json")
    assert first(runs.verify(root2)) == "episode a: result.json does not match its signed digest"


def test_a_statement_signed_with_another_key_is_refused(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    path = folder(root, "b") / "attempts/1/attestation.dsse.json"
    stmt = attest.open_envelope(path.read_bytes(), runs.trusted, "x")
    path.write_bytes(attest.sign(stmt, Ed25519PrivateKey.generate()))  # same claims, other key
    problem = first(runs.verify(root))
    assert problem.startswith(
        "episode b: attempts/1/attestation.dsse.json: no trusted key signed it"
    )
    head = root / "runs" / "A" / "ledger/head.dsse.json"
    chain_stmt = attest.open_envelope(head.read_bytes(), runs.trusted, "x")
    head.write_bytes(attest.sign(chain_stmt, Ed25519PrivateKey.generate()))
    assert first(runs.verify(root)).startswith(
        "run A ledger chain: head: ledger/head.dsse.json: no trusted key signed it"
    )


def forge(root: Path, eid: str, change: Any) -> None:
    """Rewrite ``eid``'s record with ``change`` and sign it with the trusted key itself (an
    insider with the key): only the cross-checks against the chain can catch it."""
    path = folder(root, eid) / "result.json"
    record = json.loads(path.read_bytes())
    change(record)
    path.write_bytes(record_bytes(record))
    stmt = episode_statement(record, record_bytes(record))
    (folder(root, eid) / record["attestation"]).write_bytes(attest.sign(stmt, keys.signing_key()))


def test_a_forged_record_reusing_an_env_id_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    env_a = json.loads((folder(root, "a") / "result.json").read_bytes())["provenance"]["env_id"]

    def reuse(record: dict[str, Any]) -> None:
        record["provenance"]["env_id"] = env_a

    forge(root, "b", reuse)
    report = runs.verify(root)
    assert f"episode b: env {env_a} also served episode a: an env is never reused" in (
        report.problems
    )
    assert first(report) == f"episode b: env {env_a} also served episode a: an env is never reused"
    assert f"episode b: env {env_a} was not made for attempt 1 in the ledger chain" in (
        report.problems
    )


def test_a_final_outcome_without_its_record_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    (folder(root, "b") / "result.json").unlink()
    report = runs.verify(root)
    assert first(report) == "episode b: ended completed (attempt 1) with no record"
    assert report.status["b"] == report.problems[0] and report.status["a"] == "verified"


def test_a_record_the_chain_does_not_know_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)

    def outcome(record: dict[str, Any]) -> None:
        record["outcome"] = "completed"

    forge(root, "c", outcome)
    assert first(runs.verify(root)) == (
        "episode c: the record says completed, the ledger chain episode_error"
    )


def test_an_env_never_confirmed_absent_is_named(runs: Runs, tmp_path: Path) -> None:
    h = Harness(tmp_path / "h")
    asyncio.run(h.ctl.run([manifest("a")], h.baseline, run_id="L"))
    [env] = h.ledger.envs("L")
    h.ledger.env_destroyed(env.env_id, confirmed_absent=False, cleanup_ms=1, attempts=9)
    seal_run(h.ledger, h.store, "L")  # the ledger said so, and was sealed saying so
    h.ledger.close()
    report = verify_run(h.store, "L", runs.trusted)
    assert first(report) == f"env {env.env_id}: not confirmed absent in the ledger chain"


def test_a_copy_in_an_fsspec_store_verifies_and_tampering_is_caught(runs: Runs) -> None:
    import fsspec

    from cleanroom.store import FsspecStore

    fs = fsspec.filesystem("memory")
    src = runs.h.store.root
    for path in src.rglob("*"):
        if path.is_file():
            fs.pipe_file(f"/audit-copy/{path.relative_to(src)}", path.read_bytes())
    store = FsspecStore("memory://audit-copy")
    assert verify_run(store, "A", runs.trusted).ok
    fs.pipe_file("/audit-copy/runs/A/episodes/a/attempts/1/artifacts/hello.txt", b"forged")
    assert first(verify_run(store, "A", runs.trusted)) == (
        "episode a: attempts/1/artifacts/hello.txt does not match its signed digest"
    )
    fs.rm("/audit-copy", recursive=True)


def test_the_cli_verifies_a_copy_from_another_home_with_the_exported_key(
    runs: Runs, tmp_path: Path
) -> None:
    from tests.test_cli import cli

    here = Path(os.environ["CLEANROOM_HOME"])  # the home that signed (the suite's)
    exported = cli(here, "keys", "export-public")
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.startswith("-----BEGIN PUBLIC KEY-----")
    pem = tmp_path / "signer.pem"
    pem.write_text(exported.stdout)
    root = runs.copy(tmp_path)
    elsewhere = tmp_path / "auditor-home"  # knows nothing of the run but the key
    ok = cli(elsewhere, "audit", "verify", "A", "--store", str(root), "--public-key", str(pem))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("ok: run A: 3 records, 3 envs")
    flip(folder(root, "a") / "attempts/1/artifacts/hello.txt")
    bad = cli(elsewhere, "audit", "verify", "A", "--store", str(root), "--public-key", str(pem))
    assert bad.returncode == 1
    assert bad.stdout.startswith(
        "BROKEN: run A: episode a: attempts/1/artifacts/hello.txt does not match its signed digest"
    )
    keyless = cli(elsewhere, "audit", "verify", "A", "--store", str(root))
    assert keyless.returncode == 2 and "--public-key" in keyless.stderr


def test_the_html_report_shows_each_episodes_verification(runs: Runs, tmp_path: Path) -> None:
    from cleanroom.observe.htmlreport import render_html

    page = render_html("A", runs.h.ledger, runs.h.store)
    assert "<span class='ok'>verified</span>" in page
    assert "<tr><td>b</td><td class='ok'>verified</td></tr>" in page
    root = runs.copy(tmp_path)
    flip(folder(root, "a") / "attempts/1/artifacts/hello.txt")
    page = render_html("A", runs.h.ledger, LocalStore(root))
    assert "<span class='bad'>BROKEN</span>: episode a: attempts/1/artifacts/hello.txt" in page
    assert "<td>a</td><td class='bad'>episode a: attempts/1/artifacts/hello.txt" in page


def test_an_unreadable_record_or_a_missing_file_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)
    record = folder(root, "a") / "result.json"
    record.write_bytes(b"z" + record.read_bytes()[1:])  # no longer JSON
    (folder(root, "b") / "attempts/1/artifacts/hello.txt").unlink()
    report = runs.verify(root)
    assert report.problems[0].startswith(
        "episode a: result.json is unreadable or names no attestation (Expecting value"
    )
    assert "episode b: attempts/1/artifacts/hello.txt is missing from the store" in (
        report.problems
    )
    root1 = runs.copy(tmp_path / "1")
    (folder(root1, "a") / "attempts/1/attestation.dsse.json").unlink()
    assert first(runs.verify(root1)) == (
        "episode a: its attestation attempts/1/attestation.dsse.json is missing from the store"
    )
    root2 = runs.copy(tmp_path / "2")
    path = folder(root2, "c") / "result.json"
    record_c = json.loads(path.read_bytes())
    del record_c["attestation"]
    path.write_bytes(record_bytes(record_c))
    assert first(runs.verify(root2)) == (
        "episode c: result.json is unreadable or names no attestation ('attestation')"
    )


def sign_statement(root: Path, eid: str, edit: Any) -> None:
    """Re-sign ``eid``'s statement after ``edit`` (an insider with the key, again)."""
    path = folder(root, eid) / "attempts/1/attestation.dsse.json"
    stmt = attest.open_envelope(path.read_bytes(), [keys.signing_key().public_key()], "x")
    edit(stmt)
    path.write_bytes(attest.sign(stmt, keys.signing_key()))


def test_a_statement_that_leaves_out_a_listed_file_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)

    def drop(stmt: dict[str, Any]) -> None:
        stmt["subject"] = [s for s in stmt["subject"] if not s["name"].endswith("hello.txt")]

    sign_statement(root, "a", drop)
    assert first(runs.verify(root)) == (
        "episode a: attempts/1/artifacts/hello.txt is listed by the record but not signed"
    )


def test_a_record_moved_under_a_statement_of_this_run_is_named(runs: Runs, tmp_path: Path) -> None:
    root = runs.copy(tmp_path)

    def other_run(record: dict[str, Any]) -> None:
        record["run_id"] = "B"

    forge(root, "b", other_run)  # its statement names run B now: say it is of A
    sign_statement(root, "b", lambda stmt: stmt["predicate"].update(run_id="A"))
    assert first(runs.verify(root)) == "episode b: the record is of B/b"


def test_a_record_naming_no_env_or_an_env_the_chain_never_made_is_named(
    runs: Runs, tmp_path: Path
) -> None:
    root = runs.copy(tmp_path)
    forge(root, "a", lambda r: r["provenance"].pop("env_id"))
    assert first(runs.verify(root)) == "episode a: its env None is not the one its statement names"
    root2 = runs.copy(tmp_path / "2")
    forge(root2, "a", lambda r: r["provenance"].update(env_id="env-forged"))
    assert "episode a: env env-forged was not made for attempt 1 in the ledger chain" in (
        runs.verify(root2).problems
    )


def resign_destroy(root: Path, eid: str, **change: Any) -> None:
    path = folder(root, eid) / "attempts/1/destroy.dsse.json"
    stmt = attest.open_envelope(path.read_bytes(), [keys.signing_key().public_key()], "x")
    stmt["predicate"].update(change)
    path.write_bytes(attest.sign(stmt, keys.signing_key()))


def test_every_break_of_a_destroy_proof_is_named(runs: Runs, tmp_path: Path) -> None:
    env_b = json.loads((folder(runs.h.store.root, "b") / "result.json").read_bytes())["provenance"][
        "env_id"
    ]
    cases = {
        "flip": "episode b: attempts/1/destroy.json does not match its signed destroy statement",
        "absent": f"episode b: env {env_b} was not confirmed absent",
        "other-env": "episode b: its destroy statement is of another env or episode",
        "other-episode": "episode b: its destroy statement is of another env or episode",
        "unsigned": "episode b: its destroy statement attempts/1/destroy.dsse.json is missing",
        "garbled": "episode b: destroy statement: attempts/1/destroy.dsse.json: not a DSSE",
    }
    for case, want in cases.items():
        root = runs.copy(tmp_path / case)
        if case == "flip":
            flip(folder(root, "b") / "attempts/1/destroy.json")
        elif case == "absent":
            resign_destroy(root, "b", confirmed_absent=False)
        elif case == "other-env":
            resign_destroy(root, "b", env_id="env-other")
        elif case == "other-episode":
            resign_destroy(root, "b", episode_id="a")
        elif case == "unsigned":
            (folder(root, "b") / "attempts/1/destroy.dsse.json").unlink()
        else:
            (folder(root, "b") / "attempts/1/destroy.dsse.json").write_bytes(b"{}")
        assert first(runs.verify(root)).startswith(want), case


def chain_events(root: Path, run_id: str = "A") -> list[dict[str, Any]]:
    return list(chain.parse(events_file(root, run_id).read_bytes()))


def rechain(root: Path, events: list[dict[str, Any]], run_id: str = "A", **head: Any) -> None:
    """Write ``events`` as the run's chain, every link recomputed, and sign its head (an
    insider with the key and the ledger): only what the chain says can catch it."""
    prev = chain.GENESIS
    linked = []
    for seq, e in enumerate(events, 1):
        fields = (e["ts"], e["run_id"], e["episode_id"], e["env_id"], e["kind"], e["data"])
        digest = chain.link(seq, prev, *fields)
        linked.append({**e, "seq": seq, "prev": prev, "hash": digest})
        prev = digest
    raw = chain.exported(linked)
    events_file(root, run_id).write_bytes(raw)
    stmt = chain_statement(run_id, CHAIN_EVENTS, raw, len(linked), prev if linked else None)
    stmt["predicate"].update(head)
    (root / "runs" / run_id / CHAIN_HEAD).write_bytes(attest.sign(stmt, keys.signing_key()))


def test_what_a_rewritten_chain_says_is_checked(runs: Runs, tmp_path: Path) -> None:
    base = chain_events(runs.h.store.root)
    intent = next(e for e in base if e["kind"] == "env_intent" and e["episode_id"] == "b")
    env = intent["env_id"]
    cases: dict[str, tuple[list[dict[str, Any]], str]] = {
        "reused": (
            [*base, {**intent, "episode_id": "c"}],
            f"env {env}: made 2 times (for [('b', 1), ('c', 1)]): an env is never reused",
        ),
        "undestroyed": (
            [e for e in base if not (e["kind"] == "env_destroyed" and e["env_id"] == env)],
            f"env {env}: never destroyed in the ledger chain",
        ),
        "unfinished": (
            [e for e in base if not (e["kind"] == "episode_finished" and e["episode_id"] == "b")],
            "episode b: the record says completed, the ledger chain None",
        ),
        "foreign": (
            [*base, {**base[-1], "run_id": "B"}],
            f"run A ledger chain: event {len(base) + 1} belongs to run 'B'",
        ),
    }
    for case, (events, want) in cases.items():
        root = runs.copy(tmp_path / case)
        rechain(root, events)
        assert first(runs.verify(root)) == want, case


def test_a_head_that_is_missing_foreign_or_over_other_bytes_is_named(
    runs: Runs, tmp_path: Path
) -> None:
    root = runs.copy(tmp_path)
    (root / "runs/A" / CHAIN_HEAD).unlink()
    assert first(runs.verify(root)) == (
        "run A ledger chain: missing (ledger/head.dsse.json and ledger/events.jsonl): "
        "the run was never sealed"
    )
    root2 = runs.copy(tmp_path / "2")
    shutil.rmtree(root2 / "runs/A/ledger")
    shutil.copytree(root2 / "runs/B/ledger", root2 / "runs/A/ledger")
    assert first(runs.verify(root2)) == (
        "run A ledger chain: the signed head is of run 'B', not this run"
    )
    root3 = runs.copy(tmp_path / "3")
    events_file(root3).write_bytes(events_file(root3).read_bytes() + b"[]\n")
    assert first(runs.verify(root3)).startswith(
        "run A ledger chain: ledger/events.jsonl does not parse"
    )
    root4 = runs.copy(tmp_path / "4")
    rechain(root4, chain_events(root4))  # a valid chain whose bytes differ: respaced JSON
    events_file(root4).write_bytes(events_file(root4).read_bytes().replace(b', "', b',  "'))
    assert first(runs.verify(root4)) == (
        "run A ledger chain: ledger/events.jsonl does not match its signed digest"
    )
    root5 = runs.copy(tmp_path / "5")
    head5 = root5 / "runs/A" / CHAIN_HEAD
    stmt = attest.open_envelope(head5.read_bytes(), runs.trusted, "h")
    stmt["predicateType"] = "https://example.com/other/v1"
    head5.write_bytes(attest.sign(stmt, keys.signing_key()))
    assert first(runs.verify(root5)) == (
        "run A ledger chain: the signed head is of run 'A', not this run"
    )


def test_an_episode_folder_without_a_record_is_no_problem_and_gets_no_status(
    runs: Runs, tmp_path: Path
) -> None:
    root = runs.copy(tmp_path)
    (folder(root, "zz") / "attempts/1").mkdir(parents=True)  # an attempt with no final outcome
    report = runs.verify(root)
    assert report.ok and "zz" not in report.status and report.records == 3


def test_a_store_that_cannot_list_or_keep_run_files_is_named(runs: Runs, tmp_path: Path) -> None:
    class Unlistable(LocalStore):
        def _episode_ids(self, run_id: str) -> list[str]:
            raise StoreError("the bucket said no")

    report = verify_run(Unlistable(runs.h.store.root), "A", runs.trusted)
    assert report.problems == ["run A: cannot list its episodes: the bucket said no"]

    class Bare:  # a store with episode files only (no run-level files)
        def __init__(self, inner: LocalStore) -> None:
            self.inner = inner

        def get_bytes(self, run_id: str, eid: str, rel: str) -> bytes | None:
            return self.inner.get_bytes(run_id, eid, rel)

        def episode_ids(self, run_id: str) -> list[str]:
            return self.inner.episode_ids(run_id)

    bare = verify_run(Bare(runs.h.store), "A", runs.trusted)
    assert bare.problems == ["run A ledger chain: this store keeps no run-level files"]
    assert bare.records == 3 and bare.status["a"] == "verified"  # what it could check, it did


def test_an_empty_run_chain_verifies(runs: Runs, tmp_path: Path) -> None:
    with Ledger(tmp_path / "empty.db") as ledger:
        seal_run(ledger, runs.h.store, "nothing")
    report = verify_run(runs.h.store, "nothing", runs.trusted)
    assert report.ok and (report.events, report.records) == (0, 0)


def test_an_event_after_an_episodes_end_does_not_change_its_outcome(
    runs: Runs, tmp_path: Path
) -> None:
    root = runs.copy(tmp_path)
    events = chain_events(root)
    note = {**events[-1], "kind": "note", "episode_id": "b", "data": '{"attempt": 1}'}
    rechain(root, [*events, note])
    assert runs.verify(root).ok
    root2 = runs.copy(tmp_path / "2")
    rechain(root2, chain_events(root2), head="f" * 64)  # the count holds, the head does not
    n = len(events)
    assert first(runs.verify(root2)) == (
        f"run A ledger chain: the chain ends at event ({n}, '{events[-1]['hash'][:12]}'), "
        f"its signed head at ({n}, 'ffffffffffff')"
    )
