"""Before a run's first episode: refuse the run or reap leftovers, then queue what is to do.

``preflight``: a drifted baseline, a missing secret, a missing or drifted verifier baseline,
network beyond the baseline's, or a group whose episodes disagree on its setup refuse the whole
run before any env exists; then envs (and group snapshots) of dead controllers are reaped.
``queue_pending``: each manifest not yet durable in the run gets its next attempt, queued.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cleanroom.baseline import store as baseline_store
from cleanroom.baseline.model import Baseline
from cleanroom.errors import DriftError
from cleanroom.manifest import Manifest, check_groups
from cleanroom.network.egress import check_manifests
from cleanroom.reaper import reap, reconcile_durable
from cleanroom.secrets import resolve as resolve_secrets

if TYPE_CHECKING:
    from cleanroom.batch.groups import Member
    from cleanroom.batch.result import RunResult
    from cleanroom.batch.runner import Controller


async def preflight(ctl: Controller, manifests: list[Manifest], baseline: Baseline) -> None:
    """Raise if the run must be refused; reap what dead controllers left behind."""
    try:
        # drift refuses the run: a full re-hash, except of files this process hashed clean
        # that have not changed since (same inode, size, mtime and ctime)
        baseline_store.require_intact(baseline, reuse=True)
    except DriftError as exc:
        ctl._emit("drift_refused", digest=exc.digest, drifted=exc.drifted)
        raise
    names = sorted({s.name for m in manifests for s in m.secrets})
    resolve_secrets(ctl.secret_provider, names)  # a missing secret refuses the whole run
    ctl.verifiers.prepare(manifests)  # so does a missing or drifted verifier baseline
    check_manifests(manifests, baseline, ctl.driver)  # and network beyond the baseline's
    check_groups(manifests)  # and a group whose episodes disagree on its setup or machine
    reaped = await reap(ctl.driver, ctl.ledger, ctl.store)  # reconcile first
    if reaped.destroyed or reaped.failed or reaped.snapshots:
        ctl._emit(
            "reaped",
            destroyed=reaped.destroyed,
            failed=reaped.failed,
            snapshots=reaped.snapshots,
        )


def queue_pending(
    ctl: Controller, run_id: str, manifests: list[Manifest], result: RunResult
) -> list[Member]:
    """Queue the next attempt of each manifest not yet durable; skip (``result``) the rest."""
    todo = []
    for manifest in manifests:
        durable = ctl.store.get_record(run_id, manifest.episode_id)
        if durable is not None:
            reconcile_durable(ctl.ledger, durable)  # e.g. the last controller died after it
            result.skipped.append(manifest.episode_id)
            continue
        attempt = ctl.ledger.next_attempt(run_id, manifest.episode_id)
        ctl.ledger.episode_queued(run_id, manifest.episode_id, attempt)
        todo.append((manifest, attempt))
    return todo
