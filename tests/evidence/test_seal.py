"""A crashed run's chain is sealed by ``reap``; a run's end seals it (tests/evidence/test_audit)."""

from __future__ import annotations

import json
from pathlib import Path

from cleanroom.checks.audit import verify_run
from cleanroom.drivers.base import Owner
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence import attest, keys
from cleanroom.evidence.seal import CHAIN_EVENTS, CHAIN_HEAD
from cleanroom.ledger import Ledger, chain
from cleanroom.lifecycle.reaper import reap
from cleanroom.store import LocalStore
from tests.lifecycle.test_reaper import _create, dead_pid


async def test_reap_seals_the_chain_of_a_run_whose_controller_died(tmp_path: Path) -> None:
    driver = FakeDriver(run_root=tmp_path / "run")
    store = LocalStore(tmp_path / "store")
    with Ledger(tmp_path / "ledger.db") as ledger:
        orphan = await _create(driver, ledger, tmp_path, Owner("gone", pid=dead_pid()), "lost")
        assert store.get_run_bytes("r", CHAIN_HEAD) is None  # the controller died unsealed
        report = await reap(driver, ledger, store)
        assert report.sealed == ["r"] and report.destroyed == [orphan]
    raw = store.get_run_bytes("r", CHAIN_EVENTS)
    assert raw is not None
    events = list(chain.parse(raw))
    assert [e["kind"] for e in events] == [
        "env_intent",
        "env_destroyed",
        "env_reaped",
        "episode_finished",
    ]
    assert json.loads(events[-1]["data"])["outcome"] == "infra_error"
    head = store.get_run_bytes("r", CHAIN_HEAD)
    assert head is not None
    trusted = [keys.signing_key().public_key()]
    pred = attest.open_envelope(head, trusted, "head")["predicate"]
    assert (pred["events"], pred["head"]) == (4, events[-1]["hash"])
    audit = verify_run(store, "r", trusted)
    assert audit.ok, audit.problems  # the env is confirmed gone; infra_error needs no record
