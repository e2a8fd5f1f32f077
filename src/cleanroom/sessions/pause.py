"""Pause and resume of a live session: its state saved as a sealed snapshot, its VM ended; a
new session later restored from it.

    paused = await pause_session(sb)        # sb forkable; then end sb's block (VM destroyed)
    async with session(baseline, forkable=True, resume=paused, run_id=..., hold=...) as sb2:
        ...                                 # the same guest state, in a new env

A pause is the live fork's snapshot (``Driver.fork_live``: the same ledger intent first, the
same files, seal and digest; ``sessions.fork``) taken for one restore later rather than ``n``
now: the snapshot's ledger row is ``pause:<episode>@<step>``, the transcript says ``pause``
(digest, snapshot id, step) and the caller then ends the session as any other (its record
durable, its env destroyed and confirmed absent). The files stay: private (0700 folder, files
the owner's; never exported as evidence: they may hold secrets), until ``discard`` deletes
them and confirms them gone, or the reaper does once their owner is dead.

Resume (``session(..., resume=paused)``) first hashes the files again
(``Driver.verify_snapshot``: ``SnapshotDrift`` if they no longer match the sealed digest, and
nothing starts), then opens a new episode whose env is restored from the snapshot
(``Driver.fork_resume``, forkable again; ``fork_clone`` otherwise); its provenance
``resumed`` names the paused incarnation (episode, env, step, snapshot digest and id, when).
Once the new env is ready the snapshot is deleted and its absence confirmed.

A named snapshot (E2B's ``create_snapshot``: ``pause_session(sb, kind="snapshot")``) is the
same files taken while the session serves on; it is ``keep``: each resume from it is a new
session (its own env, clone id and entropy: ``fork_resume``) and the files stay until their
owner deletes them (``discard``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from cleanroom.drivers.base import Env, EnvRequest, ForkSnapshot, new_snapshot_id
from cleanroom.errors import LaunchError, Unsupported
from cleanroom.lifecycle.context import CreateEnv, RunContext
from cleanroom.lifecycle.shield import until_done
from cleanroom.lifecycle.snapshots import delete_snapshot
from cleanroom.sessions.core import AsyncSession

__all__ = ["Paused", "discard", "pause_session", "resume_start"]


@dataclasses.dataclass(frozen=True)
class Paused:
    """A paused session: its sealed snapshot and the incarnation it was taken from."""

    snap: ForkSnapshot  # sealed: ``digest`` set
    run_id: str
    episode_id: str
    attempt: int
    env_id: str
    step: int
    at: float
    keep: bool = False  # a named snapshot: restored any number of times, deleted only by name

    @property
    def digest(self) -> str:
        assert self.snap.digest is not None
        return self.snap.digest

    def facts(self) -> dict[str, Any]:
        """The resumed env's ``provenance.resumed``."""
        return {
            "paused_episode": self.episode_id,
            "paused_attempt": self.attempt,
            "paused_env": self.env_id,
            "step": self.step,
            "snapshot": self.digest,
            "snapshot_id": self.snap.snapshot_id,
            "paused_at": self.at,
        }


async def pause_session(sb: AsyncSession, *, kind: str = "pause") -> Paused:
    """Save ``sb``'s state now as a sealed snapshot (module docstring). ``sb`` goes on (the
    caller ends it, or, a named snapshot (``kind="snapshot"``), serves on: the snapshot is
    then ``keep``, its ledger row ``snapshot:<episode>@<step>``); ``Unsupported`` on a driver
    without ``fork-live`` or a session not made forkable, before anything is made; on a
    failure the snapshot's files are deleted."""
    parent = sb.episode
    ctx, key = parent.ctx, parent.key
    sb.live_env()  # SessionClosed once it has ended
    if not ctx.driver.capabilities.fork_live:
        raise Unsupported(f"the {ctx.driver.name} driver cannot pause a live session")
    if sb.fork_ram is None:
        raise Unsupported(f"session {key.episode_id} was not created with forkable=True")
    step, snapshot_id = sb.steps, new_snapshot_id()
    ctx.ledger.snapshot_intent(
        snapshot_id,
        run_id=key.run_id,
        group_id=f"{kind}:{key.episode_id}@{step}",
        driver=ctx.driver.name,
        setup_digest=sb.transcript_digest(),
        **ctx.owner.ledger_fields(),
    )
    try:
        async with sb.guard.call() as env:  # a guest call: idle clock, limits, failures
            snap = await ctx.driver.fork_live(env, snapshot_id)
        snap = await ctx.driver.fork_sealed(snap)
        if snap.digest is None:
            raise LaunchError(f"snapshot {snapshot_id} was sealed without a digest")
    except BaseException:
        await until_done(asyncio.ensure_future(delete_snapshot(ctx, key.run_id, snapshot_id)))
        raise
    ctx.ledger.snapshot_saved(
        snapshot_id, parent_env_id=env.env_id, digest=snap.digest, group_digest=snap.digest
    )
    paused = Paused(
        snap,
        key.run_id,
        key.episode_id,
        key.attempt,
        env.env_id,
        step,
        time.time(),
        keep=kind != "pause",
    )
    sb.transcript.add(kind, snapshot=snap.digest, snapshot_id=snapshot_id, step=step)
    ctx.ledger.event(
        "session_paused" if kind == "pause" else "session_snapshotted",
        run_id=key.run_id,
        episode_id=key.episode_id,
        env_id=env.env_id,
        snapshot_id=snapshot_id,
    )
    return paused


def resume_start(ctx: RunContext, paused: Paused, fork_ram: str | None) -> CreateEnv:
    """The resumed episode's ``start``: its env restored from ``paused`` (a fork parent in
    ``fork_ram`` when forkable), ``provenance.resumed`` set, then the snapshot deleted (a
    named one, ``keep``, stays)."""

    async def start(request: EnvRequest) -> Env:
        if fork_ram is not None:
            env = await ctx.driver.fork_resume(request, paused.snap, fork_ram)
        else:
            env = await ctx.driver.fork_clone(request, paused.snap)
        env.info = dataclasses.replace(env.info, resumed=paused.facts())
        ctx.ledger.event(
            "env_resumed",
            run_id=request.labels.get("run_id", paused.run_id),  # a named snapshot's: a new run
            episode_id=request.labels.get("episode_id"),
            env_id=env.env_id,
            snapshot_id=paused.snap.snapshot_id,
            paused_episode=paused.episode_id,
        )
        if not paused.keep:
            await until_done(asyncio.ensure_future(discard(ctx, paused)))
        return env

    return start


async def discard(ctx: RunContext, paused: Paused) -> bool:
    """Delete the paused snapshot's files; True once their absence is confirmed (the ledger
    row says which either way; ``lifecycle.snapshots``)."""
    return await delete_snapshot(ctx, paused.run_id, paused.snap.snapshot_id)
