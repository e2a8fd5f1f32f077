"""Fork of a live session: N branches restored from a snapshot of its VM as it is now.

    async with cr.session(baseline, forkable=True) as sb:
        await sb.commands.run("make build")
        for branch in await sb.fork(4):               # 4 sessions from this exact state
            async with branch:                        # its own episode: exported, destroyed
                await branch.commands.run("./try-one-thing"); branch.finish(reward=1.0)

The session must be ``forkable`` (its guest RAM in a file of its own: the groups' machinery,
``batch/groups.py``). ``fork_session`` then writes the snapshot's ledger intent, saves the VM
while it stands still for one pass over its touched RAM (``Driver.fork_live``; the parent runs
on, reseeded like a clone) and restores ``n`` branches from it. Each branch is an episode of
the same run: its own id (``<parent>.b1``, ``.b2``, ... counting on across forks), attempt,
ledger intent before its VM exists, transcript and record; its own entropy and clone id
(RESEED); its provenance ``branch`` names the parent episode, the step (the parent's
transcript length) and the snapshot's digest, which the snapshot's ledger row holds too. Once
every branch is restored the snapshot's files are deleted and confirmed absent, on every path.
A branch is an ``AsyncSession`` and an async context manager: leaving it ends it as a
session's block ends (``opening.interact``: evidence exported, VM destroyed and confirmed
absent). Closing the parent closes no branch; the run is finished when the last of them ends
(``RunHold``). A driver without ``fork-live``, or a session not made forkable, raises
``Unsupported`` before anything is made.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any

from cleanroom.drivers.base import Env, EnvRequest, ForkSnapshot, new_snapshot_id
from cleanroom.errors import ConfigError, LaunchError, Unsupported
from cleanroom.evidence.manifest import Manifest
from cleanroom.lifecycle.context import CreateEnv
from cleanroom.lifecycle.episode import Episode, EpisodeKey
from cleanroom.lifecycle.shield import until_done
from cleanroom.lifecycle.snapshots import delete_snapshot
from cleanroom.sessions.core import AsyncSession
from cleanroom.sessions.interact import interact

__all__ = ["MAX_BRANCHES", "Branch", "fork_session"]

MAX_BRANCHES = 64  # per fork; each is a VM


class Branch(AsyncSession):
    """A session restored from another's snapshot; leaving ``async with`` (or ``aclose``)
    ends it like a session's block: evidence exported, VM destroyed and confirmed absent."""

    def __init__(self, episode: Episode) -> None:
        super().__init__(episode, forker=fork_session)
        self._stack: AsyncExitStack | None = None  # the branch's ``interact`` block

    async def __aenter__(self) -> Branch:
        self.owner = asyncio.current_task()  # its limits cancel the block it is used in
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._end(et, exc, tb)

    async def aclose(self) -> None:
        """End the branch now (idempotent)."""
        await self._end(None, None, None)

    async def _end(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        ok = False
        try:
            await stack.__aexit__(et, exc, tb)
            ok = exc is None
        finally:
            assert self.hold is not None
            self.hold.let_go(ok)


async def fork_session(sb: AsyncSession, n: int) -> list[Branch]:
    """``n`` new sessions restored from ``sb``'s VM as it is now (see the module docstring)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BRANCHES:
        raise ConfigError(f"fork_session: n must be a whole number 1..{MAX_BRANCHES}, not {n!r}")
    parent = sb.episode
    ctx, key = parent.ctx, parent.key
    sb.live_env()  # SessionClosed once it has ended
    if not ctx.driver.capabilities.fork_live:
        raise Unsupported(f"the {ctx.driver.name} driver cannot fork a live session")
    if sb.fork_ram is None or sb.hold is None:
        raise Unsupported(f"session {key.episode_id} was not created with forkable=True")
    step, snapshot_id = sb.steps, new_snapshot_id()
    ctx.ledger.snapshot_intent(
        snapshot_id,
        run_id=key.run_id,
        group_id=f"{key.episode_id}@{step}",
        driver=ctx.driver.name,
        setup_digest=sb.transcript_digest(),
        **ctx.owner.ledger_fields(),
    )
    ids = [f"{key.episode_id}.b{sb.branched + i}" for i in range(1, n + 1)]
    sb.branched += n
    done: list[Branch | BaseException] = []
    restore: _Restore | None = None
    cancelled = False
    try:
        async with sb.guard.call() as env:  # a guest call: idle clock, limits, failures
            snap = await ctx.driver.fork_live(env, snapshot_id)
        restore = _Restore(sb, env, snap, step)
        opening = [asyncio.ensure_future(_open(sb, eid, restore.clone)) for eid in ids]
        settling = asyncio.ensure_future(_settle(opening))
        cancelled = await until_done(settling)  # cancelled: every opening still waited out
        done = settling.result()
    finally:
        ending = asyncio.ensure_future(_end_snapshot(sb, snapshot_id, restore))
        cancelled = await until_done(ending) or cancelled
    branches = [b for b in done if isinstance(b, Branch)]
    failed = [e for e in done if isinstance(e, BaseException)]
    if cancelled or failed:  # none is left open: the ones that opened end at once
        for branch in branches:
            await until_done(asyncio.ensure_future(branch.aclose()))
        raise asyncio.CancelledError() if cancelled else failed[0]
    assert restore is not None
    sb.transcript.add(
        "fork", branches=ids, snapshot=restore.digest, snapshot_id=snapshot_id, step=step
    )
    return branches


async def _settle(opening: list[asyncio.Task[Branch]]) -> list[Branch | BaseException]:
    """Every branch's opening, waited out: the branch, or what it failed with."""
    return list(await asyncio.gather(*opening, return_exceptions=True))


class _Restore:
    """One fork's snapshot: its digest recorded (while the branches restore), their envs."""

    def __init__(self, sb: AsyncSession, env: Env, snap: ForkSnapshot, step: int) -> None:
        self.sb, self.parent_env, self.snap, self.step = sb, env, snap, step
        self.digest: str | None = None
        self.sealed = asyncio.ensure_future(self._seal())

    async def _seal(self) -> None:
        """Wait for the snapshot's digest (hashed while the branches restore), record it."""
        ctx = self.sb.episode.ctx
        snap = await ctx.driver.fork_sealed(self.snap)
        if snap.digest is None:
            raise LaunchError(f"snapshot {snap.snapshot_id} was sealed without a digest")
        self.digest = snap.digest
        ctx.ledger.snapshot_saved(
            snap.snapshot_id,
            parent_env_id=self.parent_env.env_id,
            digest=snap.digest,
            group_digest=snap.digest,
        )

    async def clone(self, request: EnvRequest) -> Env:
        """A branch's ``start``: its env restored, handed over once the digest is recorded."""
        parent = self.sb.episode
        ctx = parent.ctx
        labels = {**request.labels, "branch_of": parent.key.episode_id}
        env = await ctx.driver.fork_clone(dataclasses.replace(request, labels=labels), self.snap)
        try:
            await asyncio.shield(self.sealed)
        except BaseException:
            await asyncio.shield(env.aclose())
            raise
        env.info = dataclasses.replace(env.info, branch=self.facts())
        ctx.ledger.event(
            "env_forked",
            run_id=parent.key.run_id,
            episode_id=request.labels.get("episode_id"),
            env_id=env.env_id,
            snapshot_id=self.snap.snapshot_id,
            parent_episode=parent.key.episode_id,
        )
        return env

    def facts(self) -> dict[str, Any]:
        """A branch's ``provenance.branch``."""
        parent = self.sb.episode
        return {
            "parent_episode": parent.key.episode_id,
            "parent_attempt": parent.key.attempt,
            "parent_env": self.parent_env.env_id,
            "step": self.step,
            "snapshot": self.digest,
            "snapshot_id": self.snap.snapshot_id,
        }


async def _end_snapshot(sb: AsyncSession, snapshot_id: str, restore: _Restore | None) -> None:
    """Every branch restored (or failed): the seal is done with, the files deleted."""
    if restore is not None:
        restore.sealed.cancel()  # done already unless no branch was restored
        await asyncio.gather(restore.sealed, return_exceptions=True)
    await delete_snapshot(sb.episode.ctx, sb.episode.key.run_id, snapshot_id)


async def _open(sb: AsyncSession, episode_id: str, start: CreateEnv) -> Branch:
    """One branch: its ledger rows, then its env (``start``), as an open session."""
    parent, hold = sb.episode, sb.hold
    assert hold is not None
    ctx, run_id = parent.ctx, parent.key.run_id
    manifest = _branch_manifest(parent.manifest, episode_id)
    attempt = ctx.ledger.next_attempt(run_id, episode_id)
    ctx.ledger.episode_queued(run_id, episode_id, attempt)
    episode = Episode(
        ctx,
        EpisodeKey(run_id, episode_id, attempt),
        manifest,
        parent.baseline,
        absorb=False,
        start=start,
    )
    stack = AsyncExitStack()
    hold.take()
    try:
        branch = await stack.enter_async_context(interact(episode, None, make=Branch))
    except BaseException:  # ``interact`` ended the episode (its outcome, the env destroyed);
        hold.let_go(True)  # the fork's caller gets the error: the run failed only if it fails
        raise
    assert isinstance(branch, Branch)
    branch.hold, branch._stack = hold, stack
    return branch


def _branch_manifest(parent: Manifest, episode_id: str) -> Manifest:
    """The parent's manifest under the branch's id (validated: a long id may not fit)."""
    data = parent.model_dump(mode="json", by_alias=True, exclude_none=True)
    try:
        return Manifest.model_validate({**data, "episode_id": episode_id})
    except ValueError as exc:
        raise ConfigError(f"branch id {episode_id!r} is not a valid episode id: {exc}") from exc
