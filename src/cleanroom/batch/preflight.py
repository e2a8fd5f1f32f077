"""Before a run's first episode: refuse the run or reap leftovers, then queue what is to do.

``preflight``: a drifted baseline, a missing secret, a missing or drifted verifier baseline,
network beyond the baseline's, or a group whose episodes disagree on its setup refuse the whole
run before any env exists; then envs (and group snapshots) of dead controllers are reaped.
``queue_pending``: each manifest not yet durable in the run gets its next attempt, queued.
"""

from __future__ import annotations

from cleanroom.baseline import store as baseline_store
from cleanroom.batch.group_report import Member
from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import DriftError, ManifestError
from cleanroom.evidence.manifest import Manifest, check_groups
from cleanroom.evidence.secrets import resolve as resolve_secrets
from cleanroom.lifecycle.context import RunContext
from cleanroom.lifecycle.reaper import reap, reconcile_durable
from cleanroom.lifecycle.run import request_problems
from cleanroom.lifecycle.verify import Verifiers
from cleanroom.network.egress import check_manifests


async def preflight(
    ctx: RunContext, verifiers: Verifiers, manifests: list[Manifest], baseline: Baseline
) -> None:
    """Raise if the run must be refused; reap what dead controllers left behind."""
    try:
        # drift refuses the run: a full re-hash, except of files this process hashed clean
        # that have not changed since (same inode, size, mtime and ctime)
        baseline_store.require_intact(baseline, reuse=True)
    except DriftError as exc:
        ctx.emit("drift_refused", digest=exc.digest, drifted=exc.drifted)
        raise
    names = sorted({s.name for m in manifests for s in m.secrets})
    values = resolve_secrets(ctx.secret_provider, names)  # a missing secret refuses the run
    too_large = request_problems(manifests, baseline, values)  # so does a RUN request the
    if too_large:  # guest agent cannot take (BuildError if the baseline's entry alone is)
        raise ManifestError(f"{len(too_large)} manifest(s) too large to run", too_large)
    verifiers.prepare(manifests)  # so does a missing or drifted verifier baseline
    check_manifests(manifests, baseline, ctx.driver)  # and network beyond the baseline's
    check_groups(manifests)  # and a group whose episodes disagree on its setup or machine
    reaped = await reap(ctx.driver, ctx.ledger, ctx.store)  # reconcile first
    if reaped.destroyed or reaped.failed or reaped.snapshots:
        ctx.emit(
            "reaped",
            destroyed=reaped.destroyed,
            failed=reaped.failed,
            snapshots=reaped.snapshots,
        )


def queue_pending(
    ctx: RunContext, run_id: str, manifests: list[Manifest]
) -> tuple[list[Member], list[str]]:
    """Queue the next attempt of each manifest not yet durable; the rest (by id) are skipped."""
    assert ctx.store is not None
    todo, skipped = [], []
    for manifest in manifests:
        durable = ctx.store.get_record(run_id, manifest.episode_id)
        if durable is not None:
            reconcile_durable(ctx.ledger, durable)  # e.g. the last controller died after it
            skipped.append(manifest.episode_id)
            continue
        attempt = ctx.ledger.next_attempt(run_id, manifest.episode_id)
        ctx.ledger.episode_queued(run_id, manifest.episode_id, attempt)
        todo.append((manifest, attempt))
    return todo, skipped
