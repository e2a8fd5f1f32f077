"""Function entrypoints through the controller with the fake driver: the real agent starts
its warm worker on demand (there is no template), and the record says how the episode ran."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline, Component, FunctionEntry, identity
from cleanroom.core.limits import Limits
from cleanroom.core.states import Outcome
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.host.digests import digest_of, sha256_file
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore
from tests.stored import evidence

from ..conftest import ROOT, make_fake_baseline
from ..vmkit import assert_nothing_left

WARM_ENTRY = ROOT / "tests" / "baselines" / "warm" / "files" / "entry.py"


def function_baseline(tmp: Path) -> Baseline:
    """A fake-driver baseline whose entrypoint is ``entry:run`` of the warm test baseline."""
    folder = tmp / "entry"
    folder.mkdir(parents=True)
    shutil.copy(WARM_ENTRY, folder / "entry.py")
    component = Component(
        "entry.py", (folder / "entry.py").stat().st_size, sha256_file(folder / "entry.py")
    )
    function = FunctionEntry("entry:run", ("json", "random"), (str(folder),))
    limits = Limits(timeout_s=30)
    ident = identity((component,), (), limits, "host", "0.1.0", "sha256:" + "1" * 64, function)
    digest = digest_of(ident)
    home = tmp / "baselines" / digest.removeprefix("sha256:")
    home.mkdir(parents=True)
    shutil.copy(folder / "entry.py", home / "entry.py")
    baseline = Baseline(
        digest,
        home,
        ident["spec_digest"],
        "fake-warm",
        (component,),
        (),
        limits,
        "host",
        "0.1.0",
        function=function,
    )
    (home / "baseline.json").write_text(json.dumps(baseline.to_json()))
    return baseline


def manifest(eid: str, seed: int = 1, **fields: Any) -> Manifest:
    task = fields.pop("task", {})
    return Manifest.model_validate(
        {"episode_id": eid, "seed": seed, "policy": {"id": "p"}, "task": task, **fields}
    )


class Harness:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ledger = Ledger(tmp / "ledger.db")
        self.store = LocalStore(tmp / "store")
        self.driver = FakeDriver(run_root=tmp / "run")
        self.ctl = Controller(
            self.driver,
            self.ledger,
            self.store,
            options=RunOptions(parallel=2, cleanup_window_s=5, staging_dir=tmp / "staging"),
        )
        self.baseline = function_baseline(tmp)

    def record(self, run_id: str, eid: str) -> dict[str, Any]:
        record = self.store.get_record(run_id, eid)
        assert record is not None
        return record

    def assert_all_destroyed(self, run_id: str) -> None:
        assert_nothing_left(self.driver, self.ledger, run_id)


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    harness.ledger.close()


def test_a_function_baseline_round_trips_its_identity(h: Harness) -> None:
    data = json.loads((h.baseline.path / "baseline.json").read_text())
    again = Baseline.from_json(h.baseline.path, data)
    assert again.function == h.baseline.function
    assert digest_of(again.identity()) == h.baseline.digest
    command = make_fake_baseline(h.tmp / "command")
    assert "function" not in command.identity()  # command baselines keep their identity


async def test_a_function_episode_is_durable_and_says_how_it_ran(h: Harness) -> None:
    result = await h.ctl.run([manifest("f", seed=6)], h.baseline, run_id="w1")
    [episode] = result.episodes
    assert episode.outcome is Outcome.COMPLETED, episode.error
    record = h.record("w1", "f")
    assert record["reward"] == 3.0
    info = record["info"]
    assert info["imported_in"] == info["ppid"] != info["pid"]  # a fork of the importing worker
    assert info["episode_id"] == "f" and "CLEANROOM_SEED" in info["env"]
    provenance = record["provenance"]
    assert provenance["entry_kind"] == "function"
    assert provenance["entry_function"] == "entry:run"
    assert provenance["worker"] == "started"  # no template here: started on demand
    assert [a["name"] for a in record["artifacts"]] == ["hello.txt"]
    store = h.tmp / "store" / "runs" / "w1" / "episodes" / "f"
    assert "warm: stdout f seed=6" in evidence(store, "logs", "stdout.log").read_text()
    assert "warm: stderr f" in evidence(store, "logs", "stderr.log").read_text()
    h.assert_all_destroyed("w1")


async def test_failures_and_timeouts_are_outcomes_like_a_commands(h: Harness) -> None:
    manifests = [
        manifest("raise", task={"mode": "raise"}),
        manifest("nondict", task={"mode": "nondict"}),
        manifest("slow", task={"mode": "sleep"}, limits={"timeout_s": 1.5}),
    ]
    result = await h.ctl.run(manifests, h.baseline, run_id="w2")
    outcomes = {e.episode_id: (e.outcome, e.error) for e in result.episodes}
    assert outcomes["raise"] == (Outcome.EPISODE_ERROR, "entrypoint failed (exit code 1)")
    assert outcomes["nondict"] == (Outcome.EPISODE_ERROR, "entrypoint failed (exit code 1)")
    assert outcomes["slow"][0] is Outcome.TIMEOUT
    logs = h.tmp / "store" / "runs" / "w2" / "episodes"
    stderr = evidence(logs / "raise", "logs", "stderr.log").read_text()
    assert "Traceback (most recent call last)" in stderr and "ValueError: boom in raise" in stderr
    assert (
        "returned list, not a dict" in evidence(logs / "nondict", "logs", "stderr.log").read_text()
    )
    assert h.record("w2", "slow")["exit"]["timed_out"] is True
    h.assert_all_destroyed("w2")


async def test_secrets_reach_the_function_as_env_and_file_and_are_redacted(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = "hf_WarmSecretTokenValue"
    monkeypatch.setenv("HF_TOKEN", value)
    m = manifest("s", secrets=["HF_TOKEN"], task={"mode": "leak", "secret": "HF_TOKEN"})
    result = await h.ctl.run([m], h.baseline, run_id="w3")
    assert result.episodes[0].outcome is Outcome.COMPLETED, result.episodes[0].error
    record = h.record("w3", "s")
    assert record["info"]["file_matches"] is True
    assert record["info"]["leak"] == "[REDACTED:HF_TOKEN]"
    assert record["secrets"]["redactions"]["HF_TOKEN"] >= 4
    stored = [p for p in (h.tmp / "store").rglob("*") if p.is_file()]
    assert stored and not [p for p in stored if value.encode() in p.read_bytes()]


async def test_a_command_baselines_record_says_command(h: Harness) -> None:
    baseline = make_fake_baseline(h.tmp / "command")
    result = await h.ctl.run([manifest("c", seed=2)], baseline, run_id="w4")
    assert result.episodes[0].outcome is Outcome.COMPLETED
    provenance = h.record("w4", "c")["provenance"]
    assert provenance["entry_kind"] == "command" and "worker" not in provenance
