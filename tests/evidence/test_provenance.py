"""Every durable record carries its full provenance (fake driver; tests/vm has a real VM run)."""

from __future__ import annotations

import itertools
import platform
import sys
from pathlib import Path
from typing import Any

import pytest

from cleanroom.agent import native
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence import provenance
from cleanroom.evidence.manifest import Manifest

from ..batch.test_controller import Harness


def assert_complete(record: dict[str, Any]) -> None:
    """Every required field present, and the phases in order without gaps or overlaps."""
    assert provenance.missing(record) == [], record["episode_id"]
    spans = record["timings"]["phases"]
    ends = [spans[p] for p in provenance.phases(record)]
    assert set(spans) == set(provenance.phases(record))
    for span in ends:
        assert span["start"] <= span["end"]
    for before, after in itertools.pairwise(ends):
        assert before["end"] == pytest.approx(after["start"], abs=1e-6)
    assert record["timings"]["started_at"] == pytest.approx(spans["queue"]["end"], abs=1e-6)
    assert spans["export"]["end"] <= record["timings"]["ended_at"]


@pytest.fixture
def h(tmp_path: Path) -> Any:
    harness = Harness(tmp_path)
    yield harness
    harness.ledger.close()


async def test_every_record_of_a_run_has_every_field(h: Harness) -> None:
    def manifest(eid: str, **extra: Any) -> Manifest:
        return Manifest.model_validate(
            {"episode_id": eid, "seed": 3, "policy": {"id": "p", "version": "2"}, **extra}
        )

    batch = [
        manifest("ok"),
        manifest("fails", task={"mode": "fail"}),
        manifest("slow", task={"mode": "sleep", "seconds": 30}, limits={"timeout_s": 1}),
        manifest("checked", verifier={"command": [sys.executable, "-c", "pass"]}),
    ]
    result = await h.ctl.run(batch, h.baseline, run_id="prov")
    assert len(result.episodes) == 4
    records = h.store.list_records("prov")
    assert {r["outcome"] for r in records} == {"completed", "episode_error", "timeout"}
    assert len(records) == 4
    for record in records:
        assert_complete(record)
        p = record["provenance"]
        assert p["baseline"] == h.baseline.digest and p["spec_digest"] == h.baseline.spec_digest
        assert (p["driver"], p["accelerator"], p["isolation"]) == ("fake", "none", "none")
        assert record["seed"] == 3 and record["policy"]["version"] == "2"
    checked = next(r for r in records if r["episode_id"] == "checked")
    assert list(provenance.summary(checked)) == provenance.required(checked)  # jail's too
    assert set(provenance.REQUIRED) <= set(provenance.summary(checked))
    assert "verify" in checked["timings"]["phases"] and "verify_s" in checked["timings"]
    plain = next(r for r in records if r["episode_id"] == "ok")
    assert "verify" not in plain["timings"]["phases"] and "verify_s" not in plain["timings"]


def test_missing_names_what_is_absent() -> None:
    assert "provenance.baseline" in provenance.missing({"provenance": {"baseline": ""}})
    jailed = {"provenance": {"driver": "qemu", "jail": {"identity": "cgroup", "user": "1:1"}}}
    assert "provenance.jail.limits" in provenance.missing(jailed)  # a qemu jail says its limits
    assert "provenance.jail.user" not in provenance.missing(jailed)
    assert provenance.lookup({"a": {"b": 1}}, "a.b") == 1
    assert provenance.lookup({"a": 1}, "a.b") is None


async def test_cli_checks_a_run(h: Harness) -> None:
    from typer.testing import CliRunner

    from cleanroom.checks.check_cli import check_app

    await h.ctl.run(
        [Manifest.model_validate({"episode_id": "a", "seed": 1, "policy": {"id": "p"}})],
        h.baseline,
        run_id="cli",
    )
    store = str(h.tmp / "store")
    result = CliRunner().invoke(check_app, ["provenance", "cli", "--store", store])
    assert result.exit_code == 0, result.output
    assert f"1/1 records carry all {len(provenance.REQUIRED)} fields" in result.output
    record = h.store.get_record("cli", "a")
    assert record is not None
    record["episode_id"] = "b"
    del record["provenance"]["kernel"]
    h.store.put_record("cli", "b", record)
    result = CliRunner().invoke(check_app, ["provenance", "cli", "--store", store])
    assert result.exit_code == 1 and "b: missing provenance.kernel" in result.output
    result = CliRunner().invoke(check_app, ["provenance", "nope", "--store", store])
    assert result.exit_code == 2


async def test_the_record_names_what_the_env_ran_on_not_the_drivers_default(
    tmp_path: Path,
) -> None:
    """Protects: provenance.accelerator and .isolation come from the env that ran (qemu may
    fall back from KVM to TCG per env), not the driver's description of itself; the kernel,
    agent version and boot time from the guest's HELLO, not the baseline's description."""

    class Claims(FakeDriver):
        def describe(self) -> dict[str, str]:
            return {**super().describe(), "accelerator": "kvm", "isolation": "vm"}

    h = Harness(tmp_path, Claims(run_root=tmp_path / "run"))
    try:
        one = Manifest.model_validate({"episode_id": "e", "seed": 1, "policy": {"id": "p"}})
        await h.ctl.run([one], h.baseline, run_id="rk")
        [record] = h.store.list_records("rk")
        p = record["provenance"]
        assert (p["driver"], p["accelerator"], p["isolation"]) == ("fake", "none", "none")
        assert p["start"] == "cold" and isinstance(p["guest_boot_s"], float)
        # the guest's own kernel and agent (its HELLO), not the baseline's description
        assert p["kernel"] == platform.release() != h.baseline.kernel_version
        assert p["agent_version"] == native.agent_version() != h.baseline.agent_version
    finally:
        h.ledger.close()
