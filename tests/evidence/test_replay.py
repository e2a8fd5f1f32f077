"""``replay``: a deterministic session replays identically; one that reads /dev/urandom or the
clock diverges exactly at that step; a batch episode's deterministic fields compare equal
(fake driver: the real agent, no VM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleanroom.checks.audit import verify_run
from cleanroom.checks.replay import compare_records, replay
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence import keys
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import session
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline

OPTIONS = RunOptions(cleanup_window_s=10)
STEADY = [["sh", "-c", "echo hello; echo oops >&2; exit 3"], ["expr", "6", "*", "7"]]


@pytest.mark.parametrize(
    ("name", "odd"),
    [
        ("steady", None),
        ("random", ["sh", "-c", "head -c 16 /dev/urandom | od -An -tx1"]),
        ("clock", ["date", "+%s%N"]),
    ],
)
async def test_a_session_replays_step_by_step(
    tmp_path: Path, name: str, odd: list[str] | None
) -> None:
    driver = FakeDriver(run_root=tmp_path / "run")
    baseline = make_fake_baseline(tmp_path)
    store = LocalStore(tmp_path / "store")
    commands = [*STEADY, *([odd] if odd else []), ["echo", "after"]]
    with Ledger(tmp_path / "ledger.db") as ledger:
        async with session(
            baseline, driver=driver, ledger=ledger, store=store, run_id="orig", options=OPTIONS
        ) as sb:
            for argv in commands:
                await sb.exec(argv)
            sb.finish(reward=1.0)
        report = await replay(
            "orig",
            "session",
            store=store,
            driver=driver,
            ledger=ledger,
            baseline=baseline,
            replay_run_id="again",
        )
    assert report.kind == "session"
    assert [s.op for s in report.steps] == ["exec"] * len(commands) + ["finish"]
    assert [s.same for s in report.steps[:2]] == [True, True]
    assert report.steps[-2].same is True  # a step after the divergence still compares
    if odd is None:
        assert report.identical, report.steps
    else:
        diverged = report.diverged_at
        assert diverged is not None and diverged.step == 3, report.steps
        assert diverged.detail == "stdout differs"
    again = store.get_record("again", "session")
    assert again is not None and again["provenance"]["baseline"] == baseline.digest
    trusted = [keys.signing_key().public_key()]
    for run in ("orig", "again"):  # a session's run is sealed when it ends, and audits clean
        audit = verify_run(store, run, trusted)
        assert audit.ok and audit.records == 1, audit.problems


async def test_file_writes_replay_from_the_command_log_but_never_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A written file's bytes are kept in the command log, so the replay writes them again and
    the command reading them compares equal; a write holding a secret and one over 1 MiB are
    not kept (no stored byte holds the secret) and replay says why it skipped them."""
    secret = "wr1te-s3cret-7f3a"
    monkeypatch.setenv("WRITE_TOKEN", secret)
    driver = FakeDriver(run_root=tmp_path / "run")
    baseline = make_fake_baseline(tmp_path)
    store = LocalStore(tmp_path / "store")
    with Ledger(tmp_path / "ledger.db") as ledger:
        async with session(
            baseline,
            driver=driver,
            ledger=ledger,
            store=store,
            run_id="orig",
            options=OPTIONS,
            secrets=["WRITE_TOKEN"],
        ) as sb:
            await sb.files.write("/tmp/in.txt", b"fixed input\n")
            await sb.exec(["cat", "/tmp/in.txt"])
            await sb.files.write("/tmp/key", f"token={secret}\n")
            await sb.files.write("/tmp/big", b"z" * ((1 << 20) + 1))
            sb.finish(reward=1.0)
        report = await replay(
            "orig", "session", store=store, driver=driver, ledger=ledger, baseline=baseline
        )
    ops = [(s.op, s.same, s.detail) for s in report.steps]
    assert ops[:2] == [("put", True, "written again"), ("exec", True, "")], ops
    assert ops[2] == ("put", None, "skipped: holds a secret"), ops
    assert ops[3] == ("put", None, f"skipped: over {1 << 20} bytes"), ops
    assert report.identical
    for path in (tmp_path / "store").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_a_batch_episode_compares_its_deterministic_fields() -> None:
    old = {
        "outcome": "completed",
        "reward": 1.0,
        "exit": {"code": 0},
        "info": {"n": 1},
        "artifacts": [{"name": "a", "sha256": "x"}],
        "timings": {"run_s": 1},
    }
    same = {**old, "timings": {"run_s": 2}}
    assert all(s.same for s in compare_records(old, same))
    other = {**old, "artifacts": [{"name": "a", "sha256": "y"}]}
    [diff] = [s for s in compare_records(old, other) if not s.same]
    assert diff.op == "artifacts" and "'y'" in diff.detail


async def test_a_batch_episode_replays_from_its_manifest(tmp_path: Path) -> None:
    from secrets import token_hex

    from cleanroom.api import arun

    baseline = make_fake_baseline(tmp_path)
    store = tmp_path / "store"
    run = f"batch-{token_hex(3)}"
    manifests = [{"episode_id": "e", "seed": 4, "policy": {"id": "p"}, "task": {"mode": "ok"}}]
    await arun(manifests, baseline=baseline, store=store, run_id=run, driver="fake")
    report = await replay(run, "e", store=store, driver="fake", baseline=baseline)
    assert report.kind == "batch" and report.replay_run_id != run
    assert report.identical, report.steps
    assert [s.op for s in report.steps][:3] == ["outcome", "reward", "terminated"]
