"""``cleanroom check repro`` with the fake driver: identical records pass, any difference fails."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.checks.check_cli import check_app
from cleanroom.checks.repro import Fields, comparable, differences, fields, flatten, run_repro
from cleanroom.core.baseline_model import Baseline, Component, identity
from cleanroom.core.limits import Limits
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import CheckError
from cleanroom.evidence.manifest import Manifest
from cleanroom.host.digests import digest_of, sha256_file
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline

RANDOM_ENTRY = """
import json, os, random
root = os.environ["CLEANROOM_DIR"]
json.dump({"reward": random.random(), "info": {"fixed": 1}}, open(root + "/result.json", "w"))
"""


def baseline_running(tmp: Path, source: str) -> Baseline:
    """A fake-driver baseline whose entrypoint is ``source`` (run by the host's Python)."""
    entry = tmp / "random-entry" / "entry.py"
    entry.parent.mkdir(parents=True)
    entry.write_text(source)
    component = Component("entry.py", entry.stat().st_size, sha256_file(entry))
    ident = identity(
        (component,), (sys.executable, str(entry)), Limits(), "host", "0.1.0", "sha256:" + "1" * 64
    )
    digest = digest_of(ident)
    folder = tmp / "baselines" / digest.removeprefix("sha256:")
    folder.mkdir(parents=True)
    os.link(entry, folder / "entry.py")
    baseline = Baseline(
        digest, folder, ident["spec_digest"], "random", (component,),
        tuple(ident["entrypoint"]), Limits(), "host", "0.1.0",
    )  # fmt: skip
    (folder / "baseline.json").write_text(json.dumps(baseline.to_json()))
    return baseline


def manifest(eid: str = "a") -> Manifest:
    return Manifest.model_validate({"episode_id": eid, "seed": 4, "policy": {"id": "p"}})


def test_flatten_and_ignore() -> None:
    record = {
        "run_id": "r1",
        "reward": 1.0,
        "timings": {"run_s": 3},
        "provenance": {"env_id": "env-1", "baseline": "sha256:x", "host": {"hostname": "h"}},
        "artifacts": [{"name": "a", "sha256": "s"}],
        "exit": {"code": 0, "duration_s": 0.3},
    }
    assert flatten(record)["artifacts.0.sha256"] == "s"
    assert set(comparable(record)) == {
        "reward",
        "provenance.baseline",
        "artifacts.0.name",
        "artifacts.0.sha256",
        "exit.code",
    }
    other = {**record, "run_id": "r2", "reward": 2.0, "timings": {"run_s": 9}}
    assert differences([record, other]) == {"reward": [1.0, 2.0]}
    assert differences([record, {**record, "extra": 1}]) == {"extra": ["<absent>", 1]}


def test_how_an_env_started_and_how_long_it_took_are_not_results() -> None:
    """Protects ``check repro`` on a batch with spares: ``provenance.spare_s`` (how long a
    spare waited), the worker's warmth and every other duration or start fact used to fail it."""
    cold = {
        "reward": 1.0,
        "provenance": {"start": "cold", "worker": "started", "guest_boot_s": 2.7, "kernel": "k"},
        "exit": {"code": 0, "duration_s": 0.3},
    }
    spare = {
        "reward": 1.0,
        "provenance": {
            "start": "snapshot",
            "spare_s": 0.8,
            "worker": "warm",
            "template": "t-1",
            "start_note": "from a spare",
            "guest_boot_s": 0.1,
            "reseed_ms": 3.0,
            "kernel": "k",
            "group": {"id": "g", "setup_s": 1.2, "parent_s": 3.0, "snapshot": "/x"},
        },
        "exit": {"code": 0, "duration_s": 0.2},
    }
    assert differences([cold, spare]) == {"provenance.group.id": ["<absent>", "g"]}
    assert differences([cold, {**cold, "provenance": {**cold["provenance"], "kernel": "j"}}]) == {
        "provenance.kernel": ["k", "j"]
    }


def test_ignore_and_only_narrow_the_comparison() -> None:
    """``--ignore`` (glob, covers what is below it) and ``--only`` (narrowing) work together."""
    a = {"reward": 1.0, "info": {"wall": 3, "steps": 9, "seen": {"x": 1}}, "metrics": {"fps": 50}}
    b = {"reward": 1.0, "info": {"wall": 4, "steps": 9, "seen": {"x": 2}}, "metrics": {"fps": 51}}
    assert set(differences([a, b])) == {"info.wall", "info.seen.x", "metrics.fps"}
    assert set(differences([a, b], fields(["info.w*", "metrics"]))) == {"info.seen.x"}
    assert differences([a, b], fields(only=["reward"])) == {}
    assert set(differences([a, b], fields(only=["info"]))) == {"info.wall", "info.seen.x"}
    assert set(comparable(a, fields(["info.seen"], ["info.*"]))) == {"info.wall", "info.steps"}
    assert comparable({"run_id": "r", "reward": 1}, Fields(only=("run_id",))) == {}
    with pytest.raises(CheckError, match="must not be empty"):
        fields([" "])


@pytest.fixture
def ctl(tmp_path: Path) -> Controller:
    ledger = Ledger(tmp_path / "ledger.db")
    return Controller(
        FakeDriver(run_root=tmp_path / "run"),
        ledger,
        LocalStore(tmp_path / "store"),
        options=RunOptions(staging_dir=tmp_path / "staging"),
    )


async def test_a_deterministic_episode_is_identical(ctl: Controller, tmp_path: Path) -> None:
    report = await run_repro(ctl, [manifest()], make_fake_baseline(tmp_path), repeat=3, parallel=2)
    [episode] = report.episodes
    assert report.ok and episode.identical, episode.differing
    assert episode.outcomes == ["completed"] * 3 and len(report.run_ids) == 3
    assert episode.compared > 10


async def test_a_random_reward_is_reported(ctl: Controller, tmp_path: Path) -> None:
    report = await run_repro(ctl, [manifest()], baseline_running(tmp_path, RANDOM_ENTRY), repeat=2)
    [episode] = report.episodes
    assert not report.ok
    assert set(episode.differing) == {"reward"}
    assert len(set(episode.differing["reward"])) == 2
    data = report.to_json()
    assert data["episodes"][0]["differing"]["reward"] == episode.differing["reward"]


def test_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))
    good = make_fake_baseline(tmp_path)
    bad = baseline_running(tmp_path, RANDOM_ENTRY)
    lines = tmp_path / "m.jsonl"
    lines.write_text(
        manifest("a").model_dump_json() + "\n" + manifest("b").model_dump_json() + "\n"
    )
    runner = CliRunner()
    args = ["repro", str(lines), "--repeat", "2", "--driver", "fake", "--episode", "b"]
    result = runner.invoke(check_app, [*args, "--baseline", good.digest])
    assert result.exit_code == 0, result.output
    assert "identical b" in result.output and " a:" not in result.output
    out = tmp_path / "repro.json"
    result = runner.invoke(check_app, [*args, "--baseline", bad.digest, "--json", str(out)])
    assert result.exit_code == 1, result.output
    assert "differs b" in result.output and "reward" in result.output
    assert json.loads(out.read_text())["ok"] is False
    result = runner.invoke(check_app, [*args[:-1], "nope", "--baseline", good.digest])
    assert result.exit_code == 2
    result = runner.invoke(check_app, [*args, "--baseline", bad.digest, "--ignore", "rew*"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(check_app, [*args, "--baseline", bad.digest, "--only", "info.*"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(check_app, [*args, "--baseline", good.digest, "--only", "rewrd"])
    assert result.exit_code == 1, result.output  # an --only that matches nothing proves nothing
    assert "no field compared" in result.output
