"""Reconcile and reap: destroy environments whose owner (a controller process) is gone.

Two sources, because either can be incomplete after a crash: the ledger (env rows never
confirmed absent) and the host (what the driver finds: processes, run folders). An env is an
orphan when its owner process is not alive on this host, or is a different process that reused
the pid (it started after the env's intent was written). Orphans are destroyed and confirmed;
their episodes, if they have no durable record and no outcome, are marked ``infra_error``. So
are the episodes of a controller killed after its env was confirmed absent but before it wrote
the outcome (the env is no orphan then); with a durable record they take its outcome.
A group's warm snapshot (files on the host, a ledger row) is reaped the same way: deleted when
its owner is gone, and its deletion confirmed and recorded. So is a run's staging folder (raw,
unredacted guest output in flight): removed once the ledger says its run finished or its
controller is gone (a ``staging_reaped`` event each); a run this ledger does not know is left
alone (it may be another ledger's, live).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Driver
from cleanroom.evidence.seal import seal_or_alert
from cleanroom.host import paths
from cleanroom.ledger import EnvRow, Ledger, SnapshotRow
from cleanroom.ledger.liveness import owner_alive
from cleanroom.store import Store

CONTROLLER_LOST = "controller lost: its environment was reaped"
CONTROLLER_GONE = "controller lost after its environment was destroyed"
__all__ = [
    "CONTROLLER_GONE",
    "CONTROLLER_LOST",
    "ReapReport",
    "owner_alive",
    "reap",
    "reconcile_durable",
]


@dataclass
class ReapReport:
    destroyed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # still present: an alert
    episodes_marked: list[tuple[str, str, int]] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)  # deleted (failed ones are in failed)
    staging: list[str] = field(default_factory=list)  # runs whose staging folder was removed
    sealed: list[str] = field(default_factory=list)  # runs whose ledger chain was sealed


def _orphans(driver: Driver, ledger: Ledger) -> dict[str, EnvRow | None]:
    found: dict[str, EnvRow | None] = {}
    for row in ledger.envs(live_only=True):
        if row.driver == driver.name and not owner_alive(
            row.owner_host, row.owner_pid, row.intent_at
        ):
            found[row.env_id] = row
    for env_id in driver.list_owned():
        if env_id in found:
            continue
        known = ledger.get_env(env_id)
        if not _claimed(known, driver.owner_of(env_id)):
            found[env_id] = known
    return found


def _claimed(row: EnvRow | SnapshotRow | None, owner: dict[str, Any] | None) -> bool:
    """Whether a live process still owns an env or snapshot: the one its ledger ``row`` names
    (``owner_host``, ``owner_pid``, ``intent_at``), else the one its files name (``owner``).
    With neither, nobody will ever clean it up."""
    if row is not None:
        return owner_alive(row.owner_host, row.owner_pid, row.intent_at)
    if owner is not None:
        return owner_alive(owner.get("host"), owner.get("pid"), owner.get("created_at"))
    return False


async def reap(
    driver: Driver,
    ledger: Ledger,
    store: Store | None = None,
    *,
    staging_root: Path | None = None,
) -> ReapReport:
    """Destroy every orphaned env of ``driver``; mark their unfinished episodes; remove the
    staging of dead controllers' runs (under ``staging_root``, default ``home/staging``)."""
    report = ReapReport()
    touched: set[str] = set()
    for env_id, row in sorted(_orphans(driver, ledger).items()):
        result = await driver.destroy(env_id)
        if row is not None and row.run_id:
            touched.add(row.run_id)
        if row is not None:
            ledger.env_destroyed(
                env_id,
                confirmed_absent=result.confirmed_absent,
                cleanup_ms=result.elapsed_ms,
                attempts=result.attempts,
            )
        ledger.event(
            "env_reaped" if result.confirmed_absent else "env_leaked",
            run_id=row.run_id if row else None,
            episode_id=row.episode_id if row else None,
            env_id=env_id,
            cleanup_ms=result.elapsed_ms,
        )
        (report.destroyed if result.confirmed_absent else report.failed).append(env_id)
        if row is None or not (row.run_id and row.episode_id and row.attempt):
            continue
        if _mark_lost(ledger, store, row.run_id, row.episode_id, row.attempt):
            report.episodes_marked.append((row.run_id, row.episode_id, row.attempt))
    for row in ledger.absent_envs_of_open_episodes():  # killed between destroy and outcome
        if row.driver != driver.name or not (row.run_id and row.episode_id and row.attempt):
            continue
        if owner_alive(row.owner_host, row.owner_pid, row.intent_at):
            continue
        touched.add(row.run_id)
        if _mark_lost(ledger, store, row.run_id, row.episode_id, row.attempt, CONTROLLER_GONE):
            report.episodes_marked.append((row.run_id, row.episode_id, row.attempt))
    await _reap_snapshots(driver, ledger, report)
    report.staging = reap_staging(ledger, staging_root or paths.home() / "staging")
    if store is not None:  # a crashed run's chain, with what reaping it added, signed
        for run_id in sorted(touched):
            if seal_or_alert(ledger, store, run_id, None, _quiet) is not None:
                report.sealed.append(run_id)
    return report


def _quiet(kind: str, **data: Any) -> None:
    """No one listens to ``reap``'s alerts: a failed seal is its ledger event."""


def reap_staging(ledger: Ledger, root: Path) -> list[str]:
    """Remove ``root/<run>`` for every run of ``ledger`` that finished or whose controller is
    gone (its envs were reaped first: nothing is still writing there); the runs removed."""
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return []
    removed = []
    for folder in folders:
        run = ledger.get_run(folder.name)
        if run is None or (run.finished is None and owner_alive(run.host, run.pid, None)):
            continue
        files = sum(len(names) for _, _, names in os.walk(folder))
        shutil.rmtree(folder, ignore_errors=True)
        gone = not folder.exists()
        ledger.event("staging_reaped" if gone else "staging_leaked", run_id=run.run_id, files=files)
        if gone:
            removed.append(run.run_id)
    return removed


async def _reap_snapshots(driver: Driver, ledger: Ledger, report: ReapReport) -> None:
    """Delete every snapshot of ``driver`` whose owner is gone (ledger rows and host files)."""
    live = {r.snapshot_id for r in ledger.snapshots(live_only=True) if r.driver == driver.name}
    for snapshot_id in sorted(live | set(driver.list_snapshots())):
        row = ledger.get_snapshot(snapshot_id)
        if _claimed(row, driver.snapshot_owner(snapshot_id)):
            continue
        gone = await driver.delete_snapshot(snapshot_id)
        if row is not None:
            ledger.snapshot_deleted(snapshot_id, confirmed_absent=gone)
        ledger.event(
            "snapshot_reaped" if gone else "snapshot_leaked",
            run_id=row.run_id if row else None,
            snapshot_id=snapshot_id,
        )
        (report.snapshots if gone else report.failed).append(snapshot_id)


def reconcile_durable(ledger: Ledger, record: dict[str, Any]) -> bool:
    """Give the ledger the outcome of a durable record whose attempt it never saw finish."""
    run_id, eid, attempt = record["run_id"], record["episode_id"], record["attempt"]
    if _has_outcome(ledger, run_id, eid, attempt) is not False:
        return False
    error = (record.get("error") or {}).get("message")
    ledger.episode_finished(
        run_id, eid, attempt, outcome=record["outcome"], reward=record.get("reward"), error=error
    )
    ledger.event("episode_reconciled", run_id=run_id, episode_id=eid, attempt=attempt)
    return True


def _has_outcome(ledger: Ledger, run_id: str, eid: str, attempt: int) -> bool | None:
    """True/False for a known attempt, None if the ledger has no such attempt."""
    for row in ledger.episodes(run_id, all_attempts=True):
        if row.episode_id == eid and row.attempt == attempt:
            return row.outcome is not None
    return None


def _mark_lost(
    ledger: Ledger,
    store: Store | None,
    run_id: str,
    eid: str,
    attempt: int,
    why: str = CONTROLLER_LOST,
) -> bool:
    record = store.get_record(run_id, eid) if store is not None else None
    if record is not None:  # durable: the evidence survived the controller
        reconcile_durable(ledger, record)
        return False
    if _has_outcome(ledger, run_id, eid, attempt) is not False:
        return False
    ledger.episode_finished(run_id, eid, attempt, outcome=Outcome.INFRA_ERROR, error=why)
    return True
