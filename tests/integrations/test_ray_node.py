"""The node side of a cluster run without Ray (fast): a losing attempt ends ``superseded``, a
node refuses a store it does not share and a baseline whose digest it cannot reproduce, and a
local run never imports Ray."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cleanroom.api as cr
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.errors import BaselineError, BaselineNotFound, ConfigError, TransferError
from cleanroom.integrations.ray import baseline_ref, baseline_share, shared_store
from cleanroom.integrations.ray.baseline_ref import BaselineRef, resolve_on_node
from cleanroom.integrations.ray.node import NodeController
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.store import LocalStore

from ..batch.test_controller import manifest
from ..conftest import ROOT, TINY_ENTRY, make_fake_baseline
from ..forking_fake import ForkingFake


def _node(tmp: Path, store: Path) -> NodeController:
    opts = RunOptions(parallel=2, cleanup_window_s=5, staging_dir=tmp / "staging")
    return NodeController("fake", str(store), opts, node="n1", home=str(tmp / "home"))


async def test_late_attempt_is_superseded_and_leaves_the_winner_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects first-writer-wins across attempts: attempt 1 (a node thought dead) finishing
    after attempt 2 is durable ends ``superseded`` (was ``export_failed``), writes no record
    and replaces none of the winner's files; the ledger says which attempt lost (an
    ``episode_superseded`` event)."""
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    baseline = make_fake_baseline(tmp_path)
    node = _node(tmp_path, tmp_path / "store")
    m = manifest("e1", seed=4)
    await node.open_run("r", BaselineRef.of(baseline), [m.model_dump(mode="json")])
    won = await node.episode("r", m.model_dump(mode="json"), attempt=2)
    assert won.outcome is Outcome.COMPLETED, won.error
    store = LocalStore(tmp_path / "store")
    folder = tmp_path / "store" / "runs" / "r" / "episodes" / "e1"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    late = await node.episode("r", m.model_dump(mode="json"), attempt=1)
    assert late.outcome is Outcome.SUPERSEDED, late.error
    assert late.record is None and late.destroy is not None and late.destroy.confirmed_absent
    assert store.get_record("r", "e1") == won.record
    for path, data in before.items():
        assert path.read_bytes() == data, f"{path} was replaced"
    rows = {r.attempt: r.outcome for r in Ledger().episodes("r", all_attempts=True)}
    assert rows == {1: "superseded", 2: "completed"}
    [lost] = Ledger().events("r", kind="episode_superseded")  # why attempt 1 wrote nothing
    assert (lost.episode_id, lost.data["attempt"]) == ("e1", 1)
    await node.close_run("r")


def test_a_node_refuses_a_store_it_does_not_share(tmp_path: Path) -> None:
    """A folder store only the driver sees is refused by the node, naming the fix."""
    driver_side = LocalStore(tmp_path / "driver-store")
    marker = shared_store.mark(driver_side)
    assert marker is not None
    shared_store.check(driver_side, marker, "n1")  # the same folder: fine
    with pytest.raises(ConfigError, match="not shared"):
        shared_store.check(LocalStore(tmp_path / "node-store"), marker, "n1")


def test_a_node_refuses_a_baseline_it_builds_differently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node verifies the run's digest before its first episode: a folder whose contents
    say another digest is refused with both digests named."""
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    baseline = make_fake_baseline(tmp_path)
    assert resolve_on_node(BaselineRef.of(baseline), "n1").digest == baseline.digest
    wrong = dataclasses.replace(BaselineRef.of(baseline), digest="sha256:" + "1" * 64)
    with pytest.raises(BaselineError, match="refusing"):
        resolve_on_node(wrong, "n1")


def test_a_local_run_never_imports_ray(tmp_path: Path) -> None:
    """``cleanroom[ray]`` is lazy: ``import cleanroom; cleanroom.run(...)`` on the fake driver
    leaves ``ray`` out of ``sys.modules``."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
import cleanroom
from tests.conftest import make_fake_baseline
from cleanroom.evidence.manifest import Manifest
b = make_fake_baseline(Path({str(tmp_path)!r}))
m = Manifest.model_validate({{"episode_id": "a", "seed": 2, "policy": {{"id": "p"}}}})
r = cleanroom.run([m], baseline=b, driver="fake", store={str(tmp_path / "store")!r})
print(r.counts(), "ray" in sys.modules, cleanroom.RayCluster.__name__, "ray" in sys.modules)
"""
    env = {"CLEANROOM_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-4:] == ["1}", "False", "RayCluster", "False"], out.stdout


def test_parallel_per_node_without_ray_is_refused(tmp_path: Path) -> None:
    """``--parallel-per-node`` alone would be silently ignored: a clear error (exit 2)."""
    from typer.testing import CliRunner

    from cleanroom.cli import app

    (tmp_path / "m.jsonl").write_text("")
    args = ["run", str(tmp_path / "m.jsonl"), "--baseline", "x", "--parallel-per-node", "2"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 2 and "--ray" in done.output, done.output


def _hidden(baseline: Baseline, **more: Any) -> BaselineRef:
    """The run's baseline as a node that can neither see the driver's folder nor build it."""
    return BaselineRef(baseline.digest, folder=None, spec=None, **more)


def test_a_node_imports_the_archive_the_driver_put_in_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects baselines on every node: a node without the baseline (no folder it sees, no
    spec) says BaselineNotFound; once the driver published the exported archive to the run's
    store, the node imports it, verified, into its own baseline store."""
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "driver"))
    baseline = make_fake_baseline(tmp_path / "driver")  # in the driver's baseline store
    store = LocalStore(tmp_path / "store")
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "node"))
    with pytest.raises(BaselineNotFound, match="no archive"):
        resolve_on_node(_hidden(baseline), "n1", store)
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "driver"))
    url = baseline_share.publish(store, baseline)
    assert Path(url).is_file() and Path(url).parent == store.root / "baselines"
    assert baseline_share.publish(store, baseline) == url  # once per store
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "node"))
    got = resolve_on_node(_hidden(baseline, archive=url), "n1", store)
    assert got.digest == baseline.digest
    assert got.path.parent == tmp_path / "node" / "baselines"  # the node's own copy


def test_a_tampered_archive_in_the_store_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive in the store is not trusted: one byte changed in a component and the node
    refuses the import (nothing installed), naming the file."""
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "driver"))
    baseline = make_fake_baseline(tmp_path / "driver")
    store = LocalStore(tmp_path / "store")
    url = baseline_share.publish(store, baseline)
    data = bytearray(Path(url).read_bytes())
    at = data.index(b"import")  # inside entry.py's bytes
    data[at] ^= 0x20
    Path(url).write_bytes(bytes(data))
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "node"))
    with pytest.raises(TransferError, match=r"entry\.py"):
        resolve_on_node(_hidden(baseline, archive=url), "n1", store)
    assert not any((tmp_path / "node" / "baselines").glob("[0-9a-f]*"))


def test_a_node_whose_build_differs_refuses_and_names_both_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that has only the spec builds it; a build that comes out with another digest (a
    different package mirror, say) refuses the run, naming the run's digest and its own."""
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "node"))
    run = make_fake_baseline(tmp_path / "driver")
    other = tmp_path / "other.py"
    other.write_text(TINY_ENTRY.read_text() + "\n# built elsewhere\n")
    theirs = make_fake_baseline(tmp_path / "node-build", other)
    spec = tmp_path / "baseline.toml"
    spec.write_text("# the run's spec (its build is stubbed: the node's build differs)\n")
    monkeypatch.setattr(baseline_ref, "resolve_or_build", lambda _spec: theirs)
    ref = BaselineRef(run.digest, folder=None, spec=str(spec))
    with pytest.raises(BaselineError, match="refusing") as refused:
        resolve_on_node(ref, "n1")
    assert run.digest in str(refused.value) and theirs.digest in str(refused.value)


async def test_a_group_runs_whole_on_one_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects groups on a cluster: ``NodeController.group`` runs a group's members on this
    node, forked from one warm parent where the driver forks (setup once), and gives one
    result per member with ``provenance.group``."""
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    baseline = make_fake_baseline(tmp_path)
    node = _node(tmp_path, tmp_path / "store")
    forking = ForkingFake(tmp_path / "fork")
    node.ctx = dataclasses.replace(node.ctx, driver=forking)
    counter = tmp_path / "setup-ran"
    setup = [sys.executable, "-c", f"open({str(counter)!r}, 'a').write('x')"]
    ms = cr.group(
        "g1",
        {"command": setup, "timeout_s": 30},
        [{"episode_id": f"g{i}", "seed": i, "policy": {"id": "p"}} for i in range(3)],
    )
    dumped = [m.model_dump(mode="json") for m in ms]
    await node.open_run("r", BaselineRef.of(baseline), dumped)
    ended, report = await node.group("r", [(m, 1) for m in dumped])
    assert [e.episode_id for e in ended] == ["g0", "g1", "g2"]
    assert all(e.outcome is Outcome.COMPLETED for e in ended), [e.error for e in ended]
    assert report.mode == "fork" and counter.read_text() == "x"  # one setup for three
    for e in ended:
        assert e.record is not None and e.record["provenance"]["group"]["id"] == "g1"
    await node.close_run("r")
    assert forking.list_owned() == [] and forking.list_snapshots() == []


def test_a_superseded_attempt_leaves_the_episode_to_the_record_it_lost_to(tmp_path: Path) -> None:
    """Protects the driver's aggregate: attempt 1's node was taken for lost (``infra_error``)
    just before its record got out; attempt 2 then lost to that record (``superseded``). The
    run's counts and rows show the record's outcome, not ``superseded`` nor ``infra_error``."""
    from cleanroom.batch.result import EpisodeResult
    from cleanroom.integrations.ray.aggregate import Aggregate

    store = LocalStore(tmp_path / "store")
    record = {"episode_id": "e1", "attempt": 1, "outcome": "completed", "reward": 0.75}
    assert store.put_record("r1", "e1", record)
    events: list[dict[str, Any]] = []
    with Ledger(tmp_path / "ledger.db") as ledger:
        for attempt in (1, 2):
            ledger.episode_queued("r1", "e1", attempt)
        ledger.episode_finished("r1", "e1", 1, outcome=Outcome.INFRA_ERROR.value, error="lost")
        aggregate = Aggregate(ledger, store, lambda kind, **f: events.append({"kind": kind, **f}))
        lost = EpisodeResult("e1", 2, Outcome.SUPERSEDED, None, "superseded: the record exists")
        aggregate.finished("r1", lost)

        assert ledger.outcome_counts("r1") == {"completed": 1}
        (row,) = ledger.episodes("r1")
        assert (row.attempt, row.outcome, row.reward) == (1, "completed", 0.75)
        attempts = {r.attempt: r.outcome for r in ledger.episodes("r1", all_attempts=True)}
        assert attempts == {1: "completed", 2: "superseded"}
    assert [e["outcome"] for e in events if e["kind"] == "episode_finished"] == ["superseded"]


async def test_a_node_resolves_the_runs_secrets_with_its_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: ``--secrets-from`` never reached the nodes (their controllers were built
    without a provider: the node's environment was read, and the secret was missing). The run's
    provider goes with ``open_run`` and each node resolves it on its host; no value travels."""
    import json

    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("NODE_TOKEN", raising=False)
    baseline = make_fake_baseline(tmp_path)
    (tmp_path / "secrets.json").write_text(json.dumps({"NODE_TOKEN": "n0de-secret-value"}))
    node = _node(tmp_path, tmp_path / "store")
    leak = manifest("s1", mode="leak", secret="NODE_TOKEN").model_dump(mode="json")
    leak["secrets"] = ["NODE_TOKEN"]
    with pytest.raises(ConfigError, match="NODE_TOKEN not found in the controller's env"):
        await node.open_run("r0", BaselineRef.of(baseline), [leak])  # no provider: its env
    spec = f"file:{tmp_path / 'secrets.json'}"
    await node.open_run("r1", BaselineRef.of(baseline), [leak], spec)
    done = await node.episode("r1", leak, attempt=1)
    assert done.outcome is Outcome.COMPLETED, done.error
    assert done.record is not None
    assert done.record["info"] == {"leak": "[REDACTED:NODE_TOKEN]", "file_matches": True}
    await node.close_run("r1")
