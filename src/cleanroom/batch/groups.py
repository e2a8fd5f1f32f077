"""Groups: episodes that share one setup step, run once in a warm parent and then forked.

A manifest's ``group`` (``{"id", "setup": {"command", ...}}``) puts it in a group, e.g. one GRPO
task with N rollouts. With a driver that can fork (capability ``fork``: qemu) a group runs as

    snapshot intent (ledger) -> parent env intent -> parent env (restored from the template, its
    RAM in a shared file) -> setup command -> SNAPSHOT_PREPARE, save, parent destroyed and
    confirmed absent -> snapshot frozen, then hashed (digest) while the clones restore -> one
    clone per episode, handed over once the digest is recorded: an ordinary episode with its
    own seed, RESEED (host entropy, clone id, clock) and durable record -> snapshot files
    deleted once the last clone is restored (on every path: in a shielded finally too).

A setup that fails (non-zero exit, timeout) ends every episode of the group ``infra_error``
with the classification ``setup_failed`` (``fork_failed``: the parent could not be made or
saved) and the setup's output under ``attempts/<n>/logs/``; cancellation ends them
``cancelled``. Drivers without ``fork`` (fake, gvisor) run the setup in each episode's own env
before its episode (``provenance.group.mode = "per-episode"``): the same result for N times
the setup's cost. ``provenance.group`` names the group, its ``setup_digest`` and, forked, the
snapshot's digest and ``digest`` (over both), which the ledger's snapshot row holds as well.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any

from cleanroom.batch.group_report import GroupReport, Member
from cleanroom.batch.warm_parent import WarmParent, run_setup
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Env, EnvRequest
from cleanroom.errors import SetupError
from cleanroom.evidence.manifest import Group, Manifest
from cleanroom.lifecycle.context import CreateEnv, RunContext
from cleanroom.lifecycle.episode import EpisodeResult

# run one episode of the batch (its gate, its Episode), its env made by ``create``
Schedule = Callable[[Manifest, int, CreateEnv | None], Coroutine[Any, Any, None]]


def plan(todo: list[Member]) -> tuple[list[Member], dict[str, list[Member]]]:
    """Split a run's work into single episodes and groups (by id, in manifest order)."""
    singles: list[Member] = []
    grouped: dict[str, list[Member]] = {}
    for manifest, attempt in todo:
        if manifest.group is None:
            singles.append((manifest, attempt))
        else:
            grouped.setdefault(manifest.group.id, []).append((manifest, attempt))
    return singles, grouped


class PerEpisode:
    """The fallback without ``fork``: each episode's env runs the setup before its episode."""

    def __init__(self, ctx: RunContext, report: GroupReport, group: Group) -> None:
        self.ctx, self.report, self.group = ctx, report, group

    async def create(self, request: EnvRequest) -> Env:
        env = await self.ctx.driver.create(request)
        try:
            setup_s = await run_setup(env, self.group)
        except BaseException:
            await asyncio.shield(env.aclose())
            raise
        env.info = dataclasses.replace(env.info, group={**self.report.facts(), "setup_s": setup_s})
        return env


async def run_group(
    ctx: RunContext,
    gate: asyncio.Semaphore,
    run_id: str,
    members: list[Member],
    baseline: Baseline,
    schedule: Schedule,
    reports: list[GroupReport],
    ended: list[EpisodeResult],
) -> None:
    """Run one group's episodes (``schedule``): forked from a warm parent, or each with its
    own setup; ``reports`` gets the group's report, ``ended`` the episodes it ends itself."""
    group = members[0][0].group
    assert group is not None
    fork = ctx.driver.capabilities.fork
    report = GroupReport(
        group.id,
        "fork" if fork else "per-episode",
        [m.episode_id for m, _ in members],
        group.setup.digest(),
    )
    reports.append(report)

    async def episodes(create: CreateEnv) -> None:
        async with asyncio.TaskGroup() as tasks:
            for manifest, attempt in members:
                tasks.create_task(schedule(manifest, attempt, create))

    if not fork:
        await episodes(PerEpisode(ctx, report, group).create)
        return
    warm = WarmParent(ctx, run_id, group, members, baseline, report)
    try:
        try:
            async with gate:
                await warm.prepare()
        except asyncio.CancelledError:
            if warm.started:  # still queued: its episodes stay queued, like any other
                report.classification = "cancelled"
                warm.end_members(ended, Outcome.CANCELLED, "cancelled during the group's setup")
            raise
        except Exception as exc:  # any failure of the shared setup ends its episodes, not the run
            report.classification = "setup_failed" if isinstance(exc, SetupError) else "fork_failed"
            report.error = f"{type(exc).__name__}: {exc}"
            error = f"{report.classification}: {exc}"
            warm.end_members(ended, Outcome.INFRA_ERROR, error, exc)
            ctx.ledger.event(
                "group_failed",
                run_id=run_id,
                group=group.id,
                classification=report.classification,
                error=report.error[-2000:],
            )
            return
        await episodes(warm.clone)
    finally:
        await warm.aclose()
