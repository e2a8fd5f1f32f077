"""The checks on real QEMU microVMs: isolation, provenance, verifiers, reproducibility."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests import vmkit

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.checks.isolation import IsolationCheck
from cleanroom.checks.repro import run_repro
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence import provenance
from cleanroom.evidence.manifest import Manifest, load_manifests
from cleanroom.host import hostproc
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ledger(tmp_path: Path) -> Any:
    with Ledger(tmp_path / "ledger.db") as led:
        yield led


def controller(tmp_path: Path, ledger: Ledger, driver: QemuDriver | None = None) -> Controller:
    return Controller(
        driver or QemuDriver(),
        ledger,
        LocalStore(tmp_path / "store"),
        options=RunOptions(parallel=2, spares=2, staging_dir=tmp_path / "staging"),
    )


async def test_isolation_check_passes_on_vms(tiny_baseline: Baseline, ledger: Ledger) -> None:
    driver = QemuDriver()
    report = await IsolationCheck(driver, tiny_baseline, ledger).run()
    bad = {
        (v.name, name): cell
        for v in report.variants
        for name, cell in v.cells.items()
        if cell.status != "PASS"
    }
    assert not bad, bad  # every canary, every variant: the login shell and sysctls included
    assert [v.error for v in report.variants] == [None, None, None]
    assert report.leftovers == [] and report.ok
    for env in ledger.envs(run_id=report.check_id):
        assert env.confirmed_absent_at is not None, env
        assert not driver.exists(env.env_id) and not hostproc.pids_with_marker(env.env_id)
    assert len(ledger.envs(run_id=report.check_id)) == 6  # A and B of three variants


async def test_provenance_and_in_env_verifier_on_a_vm(
    tiny_baseline: Baseline, ledger: Ledger, tmp_path: Path
) -> None:
    script = (
        "import json, os; d = os.environ['CLEANROOM_DIR']; "
        "r = json.load(open(d + '/input/result.json')); "
        "json.dump({'pass': r['reward'] == 2.5, 'score': r['reward'], "
        "'details': {'kernel': os.uname().release}}, open(d + '/verdict.json', 'w'))"
    )
    manifest = Manifest.model_validate(
        {
            "episode_id": "prov",
            "seed": 5,
            "policy": {"id": "p", "version": "3"},
            "verifier": {"command": ["python3", "-c", script], "in_env": True},
        }
    )
    ctl = controller(tmp_path, ledger)
    result = await ctl.run([manifest], tiny_baseline, run_id="vm-prov")
    [episode] = result.episodes
    assert episode.outcome.value == "completed", episode.error
    record = ctl.store.get_record("vm-prov", "prov")
    assert record is not None
    assert provenance.missing(record) == []
    p = record["provenance"]
    assert p["driver"] == "qemu" and p["accelerator"] in ("kvm", "tcg")
    assert p["accelerator_version"].startswith("qemu ")
    assert p["isolation"] in ("hardware-vm", "emulated-vm")
    assert p["kernel"] == record["verdict"]["details"]["kernel"]  # the guest's own kernel
    assert record["verdict"]["pass"] is True and record["verdict"]["score"] == 2.5


async def test_code_repair_verdicts(
    ledger: Ledger, tmp_path: Path, tiny_baseline: Baseline
) -> None:
    example = ROOT / "examples" / "code-repair"
    episode_baseline = resolve_or_build(str(example / "baseline.toml"))
    lines = []
    for m in load_manifests(example / "manifests.jsonl")[:4]:
        data = m.model_dump(mode="json")
        data["verifier"]["baseline"] = str(example / "verifier.toml")  # not relative to the cwd
        lines.append(Manifest.model_validate(data))
    ctl = controller(tmp_path, ledger)
    result = await ctl.run(lines, episode_baseline, run_id="vm-repair")
    assert result.counts() == {"completed": 4}
    verdicts = {
        r["episode_id"]: (r["reward"], r["verdict"]["pass"], round(r["verdict"]["score"], 3))
        for r in ctl.store.list_records("vm-repair")
    }
    assert verdicts == {
        "repair-000": (1.0, True, 1.0),
        "repair-001": (1.0, False, 0.714),
        "repair-002": (1.0, True, 1.0),
        "repair-003": (1.0, False, 0.714),
    }
    rows = {row.episode_id: row.verdict for row in ledger.episodes("vm-repair")}
    assert rows == {
        "repair-000": "pass",
        "repair-001": "fail",
        "repair-002": "pass",
        "repair-003": "fail",
    }
    envs = ledger.envs(run_id="vm-repair")
    assert len(envs) == 8  # one episode env and one verifier env each
    assert all(e.confirmed_absent_at is not None for e in envs)
    record = ctl.store.get_record("vm-repair", "repair-001")
    assert record is not None
    assert record["verdict"]["details"]["failed"] == [
        "test_hidden.HiddenTests.test_median_empty",
        "test_hidden.HiddenTests.test_median_even_unsorted",
    ]
    assert record["verdict"]["verifier"]["baseline"] != episode_baseline.digest


async def test_cartpole_is_reproducible(
    ledger: Ledger, tmp_path: Path, tiny_baseline: Baseline
) -> None:
    cartpole = resolve_or_build(str(ROOT / "examples" / "cartpole" / "baseline.toml"))
    line = (ROOT / "examples" / "cartpole" / "manifests.jsonl").read_text().splitlines()[1]
    manifest = Manifest.model_validate(json.loads(line))
    report = await run_repro(controller(tmp_path, ledger), [manifest], cartpole, repeat=3)
    [episode] = report.episodes
    assert episode.outcomes == ["completed"] * 3, episode.errors
    assert episode.missing == [] and episode.differing == {}, episode.differing
    assert episode.compared > 20 and report.ok


async def test_repro_passes_a_deterministic_batch_started_from_spares(
    ledger: Ledger, tmp_path: Path, tiny_baseline: Baseline
) -> None:
    """A batch long enough that spares start envs is still reproducible: how an env started
    (``provenance.spare_s``, ``start``, ``worker``) is not a result (issue 14 §2)."""
    manifests = [vmkit.manifest(f"rp-{i}", i, mode="ok") for i in range(5)]
    ctl = controller(tmp_path, ledger)
    report = await run_repro(ctl, manifests, tiny_baseline, repeat=2)
    records = [ctl.store.get_record(r, m.episode_id) for r in report.run_ids for m in manifests]
    assert any(r and r["provenance"].get("spare_s") is not None for r in records), records
    assert all(e.outcomes == ["completed"] * 2 for e in report.episodes), report.to_json()
    assert report.ok, {e.episode_id: e.differing for e in report.episodes}


async def test_repro_fails_naming_a_field_the_guest_filled_with_entropy(
    ledger: Ledger, tmp_path: Path, tiny_baseline: Baseline
) -> None:
    """A really non-deterministic entrypoint fails the check, naming the field: the tiny entry
    reads ``/proc/sys/kernel/random/uuid`` (the kernel's CRNG, as /dev/urandom) into ``info``."""
    uuid = "/proc/sys/kernel/random/uuid"
    manifests = [vmkit.manifest("rnd", 1, mode="write", paths=[], probe=[uuid])]
    report = await run_repro(controller(tmp_path, ledger), manifests, tiny_baseline, repeat=2)
    [episode] = report.episodes
    assert episode.outcomes == ["completed"] * 2, episode.errors
    assert not report.ok and set(episode.differing) == {f"info.seen.{uuid}"}, episode.differing
