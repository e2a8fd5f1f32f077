"""A hostile guest on real QEMU microVMs (the ``hostile`` test baseline): deep JSON, NaN,
non-UTF-8 and overlong artifact names, a deep frame header written into the agent's own port, a
2 MiB result, a secret hidden in escapes, base64 and an artifact name. Protects issue 15 §1, §3
and §4 end to end: the controller stays alive, the whole batch finishes, each hostile episode
ends ``episode_error`` (the guest's fault, never a crash or ``infra_error``), every env is
confirmed absent, and no stored byte or name holds the secret. On the old code the deep result
and the surrogate name crashed ``Controller.run`` (the TaskGroup aborted the batch), the 2 MiB
result was refused, and the escaped secret reached the record."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests import vmkit
from tests.vmkit import Harness, assert_nothing_left, manifest

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence.manifest import Manifest

pytestmark = pytest.mark.vm

HOSTILE_SPEC = Path(__file__).resolve().parents[1] / "baselines" / "hostile" / "baseline.toml"
SECRET = "hf_Hidd3nTok/en+Value"
HOSTILE = ["deep-result", "nan-metrics", "surrogate-name", "long-name", "deep-header"]


@pytest.fixture(scope="module")
def hostile_baseline() -> Baseline:
    """The hostile baseline (the native agent relays its attacks), built once and cached."""
    from cleanroom.baseline.resolve import resolve_or_build

    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (run `make setup`)")
    return resolve_or_build(str(HOSTILE_SPEC), progress=lambda step, detail: print(step, detail))


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    yield from vmkit.harness(tmp_path, QemuDriver())


async def test_a_hostile_batch_finishes_with_the_guests_own_outcomes(
    harness: Harness,
    hostile_baseline: Baseline,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ctl, ledger, store, driver = harness
    monkeypatch.setenv("HOSTILE_TOKEN", SECRET)
    hide = Manifest.model_validate(
        {
            **manifest("hide-secret", 1, mode="hide-secret", secret="HOSTILE_TOKEN").model_dump(),
            "secrets": ["HOSTILE_TOKEN"],
        }
    )
    batch = [
        *(manifest(mode, i, mode=mode) for i, mode in enumerate(HOSTILE)),
        manifest("big-result", 9, mode="big-result", bytes=2 << 20),
        hide,
    ]
    result = await ctl.run(batch, hostile_baseline, run_id="vm-hostile")  # returns: alive

    by_id = {e.episode_id: e for e in result.episodes}
    assert set(by_id) == {m.episode_id for m in batch}
    for mode in HOSTILE:
        assert by_id[mode].outcome is Outcome.EPISODE_ERROR, (mode, by_id[mode].error)
    assert "deeper" in (by_id["deep-result"].error or "")
    assert by_id["big-result"].outcome is Outcome.COMPLETED, by_id["big-result"].error
    assert by_id["hide-secret"].outcome is Outcome.COMPLETED, by_id["hide-secret"].error
    for mode in ("deep-result", "nan-metrics"):  # a bad result.json has a durable record
        record = store.get_record("vm-hostile", mode)
        assert record is not None and record["outcome"] == "episode_error"

    record = store.get_record("vm-hostile", "hide-secret")
    assert record is not None
    assert record["info"] == {"[REDACTED:HOSTILE_TOKEN]": "[REDACTED:HOSTILE_TOKEN]"}
    assert [a["name"] for a in record["artifacts"]] == ["[REDACTED:HOSTILE_TOKEN].txt"]
    assert record["secrets"]["redactions"]["HOSTILE_TOKEN"] == 5  # b64, url, name, key, value
    for path in tmp_path.rglob("*"):  # the ledger and the store
        assert "Hidd3n" not in str(path), path
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
            assert b"aGZfSGlkZDNu" not in path.read_bytes(), path  # its base64

    assert_nothing_left(driver, ledger, "vm-hostile")
