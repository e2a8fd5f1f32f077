"""The hostile entrypoint (``tests/baselines/hostile``) through the real controller and the real
agent, on the fake driver (the agent as a host process: fast, no isolation): the batch
finishes, each attack is the guest's ``episode_error``, every env is confirmed absent, no stored
byte or name holds the secret. The modes that write into a virtio port run in
``test_hostile_vm.py`` only. On the old code the deep result and the surrogate name crashed
``Controller.run``, and the escaped secret reached the record."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import make_fake_baseline
from tests.vmkit import assert_nothing_left

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.states import Outcome
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

HOSTILE_ENTRY = Path(__file__).resolve().parents[1] / "baselines" / "hostile" / "files" / "entry.py"
SECRET = "hf_Hidd3nTok/en+Value"


def manifest(mode: str, **extra: object) -> Manifest:
    return Manifest.model_validate(
        {"episode_id": mode, "seed": 1, "policy": {"id": "p"}, "task": {"mode": mode}, **extra}
    )


async def test_hostile_results_and_names_on_the_fake_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOSTILE_TOKEN", SECRET)
    ledger, store = Ledger(tmp_path / "ledger.db"), LocalStore(tmp_path / "store")
    driver = FakeDriver(run_root=tmp_path / "run")
    options = RunOptions(parallel=2, cleanup_window_s=5, staging_dir=tmp_path / "staging")
    ctl = Controller(driver, ledger, store, options=options)
    hide = manifest("hide-secret", secrets=["HOSTILE_TOKEN"])
    hide = Manifest.model_validate(
        {**hide.model_dump(), "task": {"mode": "hide-secret", "secret": "HOSTILE_TOKEN"}}
    )
    batch = [manifest(m) for m in ("deep-result", "nan-metrics", "surrogate-name", "big-result")]
    result = await ctl.run([*batch, hide], make_fake_baseline(tmp_path, HOSTILE_ENTRY), run_id="h")

    got = {e.episode_id: e for e in result.episodes}
    for mode in ("deep-result", "nan-metrics", "surrogate-name"):
        assert got[mode].outcome is Outcome.EPISODE_ERROR, (mode, got[mode].error)
    assert got["big-result"].outcome is Outcome.COMPLETED, got["big-result"].error
    assert got["hide-secret"].outcome is Outcome.COMPLETED, got["hide-secret"].error
    record = store.get_record("h", "hide-secret")
    assert record is not None
    assert record["info"] == {"[REDACTED:HOSTILE_TOKEN]": "[REDACTED:HOSTILE_TOKEN]"}
    assert [a["name"] for a in record["artifacts"]] == ["[REDACTED:HOSTILE_TOKEN].txt"]
    assert record["secrets"]["redactions"]["HOSTILE_TOKEN"] == 5  # b64, url, name, key, value
    for path in [*(tmp_path / "store").rglob("*"), *tmp_path.glob("ledger.db*")]:
        assert "Hidd3n" not in str(path), path
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
            assert b"aGZfSGlkZDNu" not in path.read_bytes(), path  # its base64
    assert_nothing_left(driver, ledger, "h")
    ledger.close()
