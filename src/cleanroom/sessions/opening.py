"""``session(...)``: open one interactive episode, hand out its ``AsyncSession``, end it.

A session is one episode of a run (ledger intent before the VM, a run lock, an attempt). On
leaving the block the ending is decided (``AsyncSession.conclude``), the evidence exported (the
transcript, the command log, the artifacts, then the record), the VM destroyed and confirmed
absent, and only then does ``async with`` return or raise:

- normally: ``completed`` (or ``episode_error``: see ``core``);
- ``timeout_s`` / ``idle_timeout_s`` passed: ``timeout``, then ``SessionTimeout`` is raised;
- the guest broke the protocol (``episode_error``) or died (``env_crashed``): that error;
- an exception of the caller's: ``infra_error`` (``core.states.classify``), raised again;
- cancellation: ``cancelled``; an abandoned session (garbage-collected, left open at exit):
  ``cancelled`` with a ``ResourceWarning``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from secrets import token_hex
from typing import Any

from pydantic import ValidationError

from cleanroom.baseline.resolve import resolve_baseline
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers import get_driver
from cleanroom.drivers.base import Driver, Owner, new_snapshot_id
from cleanroom.errors import ManifestError, Unsupported
from cleanroom.evidence.manifest import Manifest, describe
from cleanroom.evidence.secrets import provider_from
from cleanroom.host import private
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import CreateEnv, RunContext, RunOptions
from cleanroom.lifecycle.episode import Episode, EpisodeKey
from cleanroom.lifecycle.shield import until_done
from cleanroom.lifecycle.snapshots import delete_snapshot
from cleanroom.network.egress import episode_policy
from cleanroom.sessions.core import AsyncSession
from cleanroom.sessions.fork import fork_session
from cleanroom.sessions.interact import interact
from cleanroom.sessions.pause import Paused, resume_start
from cleanroom.sessions.run_hold import RunHold
from cleanroom.store import Store, open_store


def _manifest(
    episode_id: str,
    seed: int,
    policy: dict[str, Any] | None,
    task: dict[str, Any] | None,
    network: list[str] | None,
    timeout_s: float | None,
    secret_names: list[str] | None,
) -> Manifest:
    return Manifest.model_validate(
        {
            "episode_id": episode_id,
            "seed": seed,
            "policy": policy or {"id": "interactive"},
            "task": task or {},
            "limits": {"timeout_s": timeout_s} if timeout_s is not None else {},
            "secrets": list(secret_names or []),
            **({"network": {"allow": network}} if network is not None else {}),
        }
    )


@asynccontextmanager
async def session(
    baseline: Baseline | str | Path,
    *,
    driver: Driver | str = "qemu",
    ledger: Ledger | None = None,
    store: Store | str | Path | None = None,
    seed: int = 0,
    policy: dict[str, Any] | None = None,
    task: dict[str, Any] | None = None,
    episode_id: str = "session",
    run_id: str | None = None,
    options: RunOptions | None = None,
    network: list[str] | None = None,
    timeout_s: float | None = None,
    idle_timeout_s: float | None = None,
    secrets: list[str] | None = None,
    secrets_from: str | None = None,
    forkable: bool = False,
    owner: Owner | None = None,
    hold: RunHold | None = None,
    resume: Paused | None = None,
) -> AsyncIterator[AsyncSession]:
    """One interactive episode (module docstring) on a fresh env of ``baseline`` (a
    ``Baseline``, or a baseline.toml / folder, built if needed, as ``cleanroom.run`` does).

    ``driver``/``ledger``/``store``: default the home's (``qemu``, its ledger, its store).
    ``run_id``: a run of its own unless it names one this session may take (the run lock
    applies). ``timeout_s``: the session's whole life from ready (default: the baseline's
    ``timeout_s``; the deadman ends the VM soon after it even if this process dies);
    ``idle_timeout_s``: how long it may sit with no call running. ``secrets``: names resolved
    by the provider (``secrets_from``, as ``cleanroom run``), given to every command as
    environment variables and redacted everywhere. ``network``: the egress allowlist (within
    the baseline's; ``[]``: none); None: the baseline's. ``forkable``: its guest RAM in a file
    of its own, so ``fork`` (``sessions.fork``) can branch it (costs: no spare, a copy of the
    template's RAM at the start, that file on disk; ``Unsupported`` on a driver without
    ``fork-live`` or with egress, before anything is made). ``owner``/``hold``: a caller with
    several sessions of one run open at once (``cleanroom.gym``) gives them one owner (the run
    lock is its) and one ``RunHold`` of ``run_id`` it has taken (the run finishes when the last
    holder lets go). ``resume``: a paused session (``sessions.pause``) this one restores
    (its files checked against their digest first: ``SnapshotDrift``, before anything
    starts)."""
    async with AsyncExitStack() as stack:
        if ledger is None or isinstance(store, str | Path | None) or isinstance(driver, str):
            private.check_home()  # the home is private (0700, ours); else PrivacyError
        if ledger is None:
            ledger = stack.enter_context(Ledger())
        ctx = RunContext(
            get_driver(driver) if isinstance(driver, str) else driver,
            ledger,
            store if isinstance(store, Store) else open_store(store),
            owner or Owner("ses-" + token_hex(6)),
            options or RunOptions(),
            secret_provider=provider_from(secrets_from),
        )
        try:
            manifest = _manifest(episode_id, seed, policy, task, network, timeout_s, secrets)
        except ValidationError as exc:
            raise ManifestError(f"session {episode_id!r}: invalid", describe(exc)) from exc
        resolved = resolve_baseline(baseline)
        if forkable:
            refuse_fork(ctx.driver, resolved, manifest)
        if resume is not None:
            await ctx.driver.verify_snapshot(resume.snap)
        opened = _episode(ctx, resolved, manifest, run_id, forkable, hold, resume)
        make = functools.partial(AsyncSession, forker=fork_session)
        async with (
            opened as (episode, hold, fork_ram),
            interact(episode, idle_timeout_s, make) as sb,
        ):
            sb.hold, sb.fork_ram = hold, fork_ram
            if resume is not None:
                sb.transcript.add("resume", **resume.facts())
            yield sb


@asynccontextmanager
async def _episode(
    ctx: RunContext,
    baseline: Baseline,
    manifest: Manifest,
    run_id: str | None,
    forkable: bool,
    hold: RunHold | None = None,
    resume: Paused | None = None,
) -> AsyncIterator[tuple[Episode, RunHold, str | None]]:
    """The session's run and its one episode attempt (not yet provisioned); the run's hold
    (it ends when the session and its branches have); a forkable one's RAM snapshot id."""
    ledger, eid = ctx.ledger, manifest.episode_id
    run_id = run_id or time.strftime("session-%Y%m%d-%H%M%S-") + token_hex(3)
    ledger.start_run(
        run_id,
        controller_id=ctx.owner.controller_id,
        baseline=baseline.digest,
        driver=ctx.driver.name,
        parallel=1,
        meta={"kind": "session"},
    )
    hold, ok, fork_ram = hold or RunHold(ledger, run_id), False, None
    hold.take()
    try:
        attempt = ledger.next_attempt(run_id, eid)
        ledger.episode_queued(run_id, eid, attempt)
        key = EpisodeKey(run_id, eid, attempt)
        start: CreateEnv | None = None
        if forkable:
            fork_ram = ram_intent(ctx, run_id, eid, baseline)
            start = functools.partial(ctx.driver.fork_parent, snapshot_id=fork_ram)
        if resume is not None:
            start = resume_start(ctx, resume, fork_ram)
        yield Episode(ctx, key, manifest, baseline, absorb=False, start=start), hold, fork_ram
        ok = True
    finally:
        try:
            if fork_ram is not None:  # the env is gone: its RAM file may go
                await until_done(asyncio.ensure_future(delete_snapshot(ctx, run_id, fork_ram)))
        finally:
            hold.let_go(ok)


def refuse_fork(driver: Driver, baseline: Baseline, manifest: Manifest) -> None:
    """``Unsupported`` unless a session of ``manifest`` on ``driver`` could be forked."""
    if not driver.capabilities.fork_live:
        raise Unsupported(f"the {driver.name} driver cannot fork a live session")
    if episode_policy(baseline, manifest):
        raise Unsupported("a session with egress cannot fork (its NIC has no snapshot template)")


def ram_intent(ctx: RunContext, run_id: str, episode_id: str, baseline: Baseline) -> str:
    """The ledger intent of a forkable session's RAM file (a snapshot row: reaped as one)."""
    snapshot_id = new_snapshot_id()
    ctx.ledger.snapshot_intent(
        snapshot_id,
        run_id=run_id,
        group_id=f"session:{episode_id}",
        driver=ctx.driver.name,
        setup_digest=baseline.digest,
        **ctx.owner.ledger_fields(),
    )
    return snapshot_id
