"""Shared pieces of the real-VM tests (tests/drivers/qemu, tests/vm): manifests, env requests, a
controller over a qemu driver, the checks that an env is gone (for any run-folder driver: the
fake driver's controller tests use them too) and that the next episode sees nothing of the
previous one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import EnvRequest, Owner, RunFolderDriver, new_env_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.host import hostproc
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore, Store

CANARIES = ["/canary-root", "/tmp/canary-tmp", "/root/canary-home", "/var/tmp/canary-vartmp"]
Harness = tuple[Controller, Ledger, LocalStore, QemuDriver]


def manifest(eid: str, seed: int, *, policy: str = "test", **task: Any) -> Manifest:
    """An episode of the tiny baseline's entry (``task``: its mode and arguments; ``limits``)."""
    limits = task.pop("limits", {})
    return Manifest.model_validate(
        {
            "episode_id": eid,
            "seed": seed,
            "policy": {"id": policy, "version": "1"},
            "task": task,
            "limits": limits,
        }
    )


def request(
    baseline: Baseline, limits: ResolvedLimits | None = None, owner: str = "vm-tests"
) -> EnvRequest:
    """A driver-level request for a new env (default limits: a manifest's over the baseline's)."""
    limits = limits or manifest("x", 0).limits.merged_over(baseline.limits)
    return EnvRequest(new_env_id(), baseline, limits, Owner(owner), hard_deadline_s=300)


def harness(tmp: Path, driver: QemuDriver, parallel: int = 2) -> Iterator[Harness]:
    """A controller over ``driver`` with its own ledger and store in ``tmp`` (for a fixture:
    ``yield from``; the ledger is closed after the test)."""
    ledger = Ledger(tmp / "ledger.db")
    store = LocalStore(tmp / "store")
    options = RunOptions(
        parallel=parallel, cleanup_window_s=30, spares=parallel
    )  # spares on 2 cores
    yield Controller(driver, ledger, store, options=options), ledger, store, driver
    ledger.close()


def assert_gone(driver: RunFolderDriver, env_id: str) -> None:
    """No process carries the env's marker and its run folder is gone."""
    assert not driver.exists(env_id)
    assert not hostproc.pids_with_marker(env_id)
    assert not driver.run_dir(env_id).exists()


def assert_nothing_left(
    driver: RunFolderDriver, ledger: Ledger, run_id: str, store: Store | None = None
) -> None:
    """Every env of the run: confirmed absent in the ledger, and gone from the host; and no env
    of the driver is left on the host at all (a spare nobody took has no ledger row). With the
    run's ``store``: ``assert_records_match`` too."""
    envs = ledger.envs(run_id=run_id)
    assert envs, "the ledger has no env rows"
    for env in envs:
        assert env.confirmed_absent_at is not None, env
        assert env.intent_at is not None and env.intent_at <= (env.created_at or env.intent_at)
        assert_gone(driver, env.env_id)
    assert driver.list_owned() == []
    if store is not None:
        assert_records_match(ledger, store, run_id)


def assert_records_match(ledger: Ledger, store: Store, run_id: str) -> None:
    """Every final outcome has a durable record with that outcome; every non-final one, and
    every episode that never started, has none (the promise for resumes in docs/concepts.md)."""
    for row in ledger.episodes(run_id):
        record = store.get_record(run_id, row.episode_id)
        if row.outcome is None:  # never started (a cancelled run): nothing durable
            assert row.state == "PENDING" and record is None, (row, record)
        elif Outcome(row.outcome).final:
            assert record is not None, f"final {row.outcome} of {row.episode_id}: no record"
            assert record["outcome"] == row.outcome, (record["outcome"], row)
        else:
            assert record is None, f"non-final {row.outcome} of {row.episode_id} has a record"


async def writer_then_prober(
    h: Harness, baseline: Baseline, run_id: str, policy: str = "test"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two episodes in turn: one writes the canaries, the next looks for them (and must see
    none); their records, once every env of the run is confirmed gone."""
    ctl, ledger, store, driver = h
    writer = manifest("writer", 1, policy=policy, mode="write", paths=CANARIES, probe=CANARIES)
    prober = manifest("prober", 2, policy=policy, mode="write", paths=[], probe=CANARIES)
    await ctl.run([writer], baseline, run_id=run_id)
    await ctl.run([prober], baseline, run_id=run_id)
    records = store.get_record(run_id, "writer"), store.get_record(run_id, "prober")
    assert records[0] is not None and records[1] is not None
    assert sorted(records[0]["info"]["seen"]) == sorted(CANARIES)  # the probe can see a canary
    assert records[1]["info"]["seen"] == {}  # ...but not one from the previous episode
    assert_nothing_left(driver, ledger, run_id, store)
    return records[0], records[1]
