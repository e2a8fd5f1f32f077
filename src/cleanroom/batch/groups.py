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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cleanroom.batch.warm_parent import WarmParent, run_setup
from cleanroom.drivers.base import Env, EnvRequest
from cleanroom.errors import SetupError
from cleanroom.manifest import Group, Manifest
from cleanroom.record import Outcome

if TYPE_CHECKING:
    from cleanroom.baseline.model import Baseline
    from cleanroom.batch.runner import Controller, RunResult

Member = tuple[Manifest, int]  # a manifest and the attempt it runs as
Create = Callable[[EnvRequest], Awaitable[Env]]


@dataclass
class GroupReport:
    """What happened to one group in a run (``RunResult.groups``)."""

    group_id: str
    mode: str  # "fork" or "per-episode"
    episodes: list[str]
    setup_digest: str
    snapshot_id: str | None = None
    snapshot: str | None = None  # the snapshot's digest
    digest: str | None = None  # over setup_digest and snapshot
    parent_env: str | None = None
    # parent_s, setup_s; snapshot_s: saved, parent gone, files frozen; seal_s: digest known
    timings: dict[str, float] = field(default_factory=dict)
    classification: str | None = None  # setup_failed, fork_failed, cancelled
    error: str | None = None
    snapshot_deleted: bool | None = None
    leaked: list[str] = field(default_factory=list)  # parent env / snapshot not confirmed gone

    def facts(self) -> dict[str, Any]:
        """``provenance.group`` of each of its episodes."""
        out = {
            "id": self.group_id,
            "mode": self.mode,
            "setup_digest": self.setup_digest,
            "snapshot": self.snapshot,
            "digest": self.digest,
            "snapshot_id": self.snapshot_id,
            "parent_env": self.parent_env,
            **{k: round(v, 4) for k, v in self.timings.items()},
        }
        return {k: v for k, v in out.items() if v is not None}


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

    def __init__(self, ctl: Controller, report: GroupReport, group: Group) -> None:
        self.ctl, self.report, self.group = ctl, report, group

    async def create(self, request: EnvRequest) -> Env:
        env = await self.ctl.driver.create(request)
        try:
            setup_s = await run_setup(env, self.group)
        except BaseException:
            await asyncio.shield(env.aclose())
            raise
        env.info = dataclasses.replace(env.info, group={**self.report.facts(), "setup_s": setup_s})
        return env


async def run_group(
    ctl: Controller,
    gate: asyncio.Semaphore,
    run_id: str,
    members: list[Member],
    baseline: Baseline,
    result: RunResult,
) -> None:
    """Run one group's episodes: forked from a warm parent, or each with its own setup."""
    group = members[0][0].group
    assert group is not None
    fork = "fork" in ctl.driver.capabilities
    report = GroupReport(
        group.id,
        "fork" if fork else "per-episode",
        [m.episode_id for m, _ in members],
        group.setup.digest(),
    )
    result.groups.append(report)

    async def episodes(create: Create) -> None:
        async with asyncio.TaskGroup() as tasks:
            for manifest, attempt in members:
                tasks.create_task(
                    ctl._guarded(gate, run_id, manifest, attempt, baseline, result, create=create)
                )

    if not fork:
        await episodes(PerEpisode(ctl, report, group).create)
        return
    warm = WarmParent(ctl, run_id, group, members, baseline, report)
    try:
        try:
            async with gate:
                await warm.prepare()
        except asyncio.CancelledError:
            if warm.started:  # still queued: its episodes stay queued, like any other
                report.classification = "cancelled"
                warm.end_members(result, Outcome.CANCELLED, "cancelled during the group's setup")
            raise
        except Exception as exc:  # any failure of the shared setup ends its episodes, not the run
            report.classification = "setup_failed" if isinstance(exc, SetupError) else "fork_failed"
            report.error = f"{type(exc).__name__}: {exc}"
            error = f"{report.classification}: {exc}"
            warm.end_members(result, Outcome.INFRA_ERROR, error, exc)
            ctl.ledger.event(
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
