"""The async half of ``CleanroomEnv``: one run, an episode (a session on a fresh VM) per reset.

Runs on the env's loop thread (``loop.LoopThread``). ``GymRun`` holds the driver, the ledger and
the store; each ``GymEpisode`` is ``cleanroom.sessions.session`` held open by a task until
``end``: on the way out the transcript (with one ``gym_step`` entry per step: the trajectory) is
exported, then the record (``completed`` with the return as its reward once ended normally),
then the VM is destroyed and confirmed absent. A failure of the in-VM env (``GymEnvError``) or
of its answers (``ProtocolError``), a step (or make, or reset) with no answer within
``step_timeout_s`` and an agent that died under the env (both ``GymEnvError``) end the episode
``episode_error``, final and durable (the guest's fault, said in the transcript); a
cancellation ends it the way any episode ends.

A reset should only reset: ``GymRun`` keeps the *next* episode opened ahead (``prepare``: its
session open on a fresh VM, the env made in it, policy ``gym-ahead``; ``lookahead`` of them for
episodes shorter than a VM's start, as early in training), which ``take`` hands out
and names (seed, policy ``gym``); the episode a reset leaves behind ends in the background
(``end_later``) and ``settle`` waits for every such end, raising the first failure. An episode
opened ahead that no reset took ends ``cancelled`` at ``aclose`` (its transcript says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.agent.protocol import Frame, Kind
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Failure, Outcome
from cleanroom.drivers import get_driver
from cleanroom.drivers.base import Driver, Owner
from cleanroom.errors import EnvCrashed, GymEnvError, LedgerError, ProtocolError
from cleanroom.evidence.manifest import Manifest
from cleanroom.gym import wire
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunContext, RunOptions
from cleanroom.lifecycle.lease import release_spares
from cleanroom.sessions import AsyncSession, session
from cleanroom.sessions.run_hold import RunHold
from cleanroom.store import Store, open_store

GUEST_FAULTS = (GymEnvError, ProtocolError)  # the guest's: the episode ends episode_error
AHEAD = "gym-ahead"  # the policy of an episode opened ahead, until a reset takes it
UNUSED = "opened ahead for a reset that never came (the env was closed)"


@dataclass
class GymRun:
    """Where a ``CleanroomEnv``'s episodes go: one run of the ledger and store."""

    baseline_ref: Baseline | str | Path
    env: str
    kwargs: dict[str, Any]
    driver_name: str = "qemu"
    store_ref: str | Path | None = None
    run_id: str = ""
    options: RunOptions = field(default_factory=lambda: RunOptions(parallel=1, spares=1))
    step_timeout_s: float = 60.0
    baseline: Baseline | None = None
    driver: Driver | None = None
    ledger: Ledger | None = None
    store: Store | None = None
    count: int = 0
    lookahead: int = 1  # episodes kept opened ahead (``prepare``): more for short episodes
    ahead: list[asyncio.Task[GymEpisode]] = field(default_factory=list)  # the next, opening
    ending: list[asyncio.Task[float]] = field(default_factory=list)  # ``end_later``'s
    end_s: list[float] = field(default_factory=list)  # how long each background end took
    owner: Owner | None = None  # every episode's: the run lock is this env's
    hold: RunHold | None = None  # the run is finished when the env closes

    async def start(self) -> None:
        """Resolve (or build) the baseline; open the driver, ledger and store."""
        if self.baseline is not None:
            return
        ref = self.baseline_ref
        self.baseline = (
            ref
            if isinstance(ref, Baseline)
            else await asyncio.to_thread(resolve_or_build, str(ref))
        )
        self.run_id = self.run_id or time.strftime("gym-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        self.driver = get_driver(self.driver_name)
        self.ledger = Ledger()
        self.store = open_store(self.store_ref)
        self.owner = Owner("gym-" + secrets.token_hex(6))
        self.hold = RunHold(self.ledger, self.run_id)
        self.hold.take()  # let go at ``aclose``: episodes overlap, the run stays held between
        spares = self.options.spares
        self.driver.keep_spares(max(self.lookahead, 1 if spares is None else spares))

    async def open_episode(self, policy: str) -> GymEpisode:
        """A fresh VM with the env made in it (the GYM_SPACES answer is ``episode.made``),
        not yet named by a reset (``GymEpisode.begin``)."""
        await self.start()
        self.count += 1
        episode = GymEpisode(self, f"ep-{self.count:06d}")
        task = {"gym": {"env": self.env, "kwargs": self.kwargs, "reset_seed": None}}
        await episode.open(task, policy)
        return episode

    def prepare(self) -> None:
        """Open the next ``lookahead`` episodes in the background (those not opening yet)."""
        while len(self.ahead) < self.lookahead:
            self.ahead.append(asyncio.ensure_future(self.open_episode(AHEAD)))

    async def take(self, seed: int, reset_seed: int | None) -> GymEpisode:
        """The episode opened ahead (or one opened now), begun with ``seed``."""
        ahead = self.ahead.pop(0) if self.ahead else None
        episode = await ahead if ahead is not None else await self.open_episode("gym")
        episode.begin(seed, reset_seed, "gym")
        return episode

    def end_later(self, episode: GymEpisode) -> None:
        """End ``episode`` in the background (``settle`` waits for it)."""
        self.ending.append(asyncio.ensure_future(self._timed_end(episode)))

    @staticmethod
    async def _timed_end(episode: GymEpisode) -> float:
        started = time.perf_counter()
        await episode.end()
        return time.perf_counter() - started

    async def settle(self) -> None:
        """Wait for every background end: each episode's evidence durable (or its failure
        recorded) and its VM confirmed absent; then raise the first failure, if any."""
        ending, self.ending = self.ending, []
        failure: BaseException | None = None
        for outcome in await asyncio.gather(*ending, return_exceptions=True):
            if isinstance(outcome, BaseException):
                failure = failure or outcome
            else:
                self.end_s.append(outcome)
        if failure is not None:
            raise failure

    def fresh_copy(self) -> GymRun:
        """This run's settings without its parts (a forked process's own: a run of its own)."""
        started = self.driver is not None
        return GymRun(
            self.baseline_ref,
            self.env,
            self.kwargs,
            self.driver_name,
            self.store_ref,
            f"{self.run_id}-{os.getpid()}" if started and self.run_id else self.run_id,
            self.options,
            self.step_timeout_s,
            lookahead=self.lookahead,
        )

    async def aclose(self) -> None:
        """Wait for the background ends, end the episode opened ahead (``cancelled``), destroy
        the spares (confirmed, in the ledger), then close the ledger; raise the first failure
        of those ends."""
        try:
            ahead, self.ahead = self.ahead, []
            for task in ahead:
                with contextlib.suppress(Exception):  # its failure is in its record already
                    self.end_later(await task)
            await self.settle()
        finally:
            if self.driver is not None and self.ledger is not None:
                ctx = RunContext(self.driver, self.ledger, self.store, Owner("gym-" + self.run_id))
                await release_spares(ctx, self.run_id)
            if self.hold is not None and self.count:  # a session started the run
                # an episode opened ahead for a reset that never came is no failure of the run
                self.hold.failed = self._failed(self.ledger)
                with contextlib.suppress(LedgerError):  # none did after all (it failed first)
                    self.hold.let_go(True)
            if self.ledger is not None:
                self.ledger.close()
            self.driver = self.ledger = self.store = self.hold = None
            if not isinstance(self.baseline_ref, Baseline):
                self.baseline = None

    def _failed(self, ledger: Ledger | None) -> bool:
        """True if an episode of this run failed (one opened ahead and never used did not)."""
        if ledger is None:
            return False
        return any(
            row.outcome not in (Outcome.COMPLETED.value, None)
            and not (row.outcome == Outcome.CANCELLED.value and UNUSED in (row.error or ""))
            for row in ledger.episodes(self.run_id)
        )


def _guest_fault(sb: AsyncSession, exc: BaseException) -> None:
    """End ``sb`` as the guest's failure (``episode_error``, final), said in its transcript."""
    error = f"{type(exc).__name__}: {exc}"[-2000:]
    sb.transcript.add("gym_error", error=error)
    if sb.guard.failure is None:
        sb.guard.failure, sb.guard.failed_by = Failure(Outcome.EPISODE_ERROR, error), exc


class _Unused(Exception):
    """Ends an episode opened ahead that no reset took (raised and swallowed in ``_hold``)."""


class GymEpisode:
    """One reset's episode: a session held open by a task until ``end``."""

    def __init__(self, run: GymRun, episode_id: str) -> None:
        self.run, self.episode_id, self.seed = run, episode_id, 0
        self.begun = False  # named by a reset (``begin``); else it ends ``cancelled``
        self.made: Any = None
        self.steps = 0
        self.total = 0.0
        self.ended = False
        self.facts: dict[str, Any] = {}
        self._sb: AsyncSession | None = None
        self._done = asyncio.Event()
        self._fault: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    def begin(self, seed: int, reset_seed: int | None, policy: str) -> None:
        """This episode is a reset's: its manifest (the record's) gets the seed and policy."""
        assert self._sb is not None and not self.begun
        self.seed, self.begun = seed, True
        manifest = self._sb.episode.manifest
        task = {"gym": {**manifest.task["gym"], "reset_seed": reset_seed}}
        self._sb.episode.manifest = Manifest.model_validate(
            {**manifest.model_dump(), "seed": seed, "policy": {"id": policy}, "task": task}
        )

    async def open(self, task: dict[str, Any], policy: str) -> None:
        opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._hold(task, policy, opened))
        try:
            await opened
        except BaseException:
            await asyncio.gather(self._task, return_exceptions=True)
            raise

    async def _hold(self, task: dict[str, Any], policy: str, opened: asyncio.Future[None]) -> None:
        run = self.run
        assert run.baseline is not None and run.driver is not None and run.ledger is not None
        assert run.store is not None
        try:
            async with session(
                run.baseline,
                driver=run.driver,
                ledger=run.ledger,
                store=run.store,
                seed=self.seed,
                policy={"id": policy},
                task=task,
                episode_id=self.episode_id,
                run_id=run.run_id,
                options=run.options,
                owner=run.owner,
                hold=run.hold,
            ) as sb:
                self._sb = sb
                try:
                    made = await self._ask(Kind.GYM_MAKE, {"env": run.env, "kwargs": run.kwargs})
                    self.made = wire.value(made, Kind.GYM_SPACES)
                except GUEST_FAULTS as exc:
                    _guest_fault(sb, exc)
                    raise
                opened.set_result(None)
                await self._done.wait()
                if not self.begun and self._fault is None:  # ends ``cancelled``, saying why
                    sb.transcript.add("gym_unused", reason=UNUSED)
                    unused = _Unused(UNUSED)
                    sb.guard.failure = Failure(Outcome.CANCELLED, UNUSED)
                    sb.guard.failed_by = unused
                    raise unused
                if isinstance(self._fault, GUEST_FAULTS):
                    _guest_fault(sb, self._fault)
                    raise self._fault
                if self._fault is not None:
                    raise self._fault
                else:
                    sb.finish(self.total, {"length": self.steps, **self.facts})
        except BaseException as exc:
            if not opened.done():
                opened.set_exception(exc)
            elif exc is not self._fault and self.begun:
                raise

    async def _ask(self, kind: int, header: dict[str, Any], body: bytes = b"") -> Frame:
        assert self._sb is not None
        env = self._sb.episode.env
        if env is None:
            raise GymEnvError(f"episode {self.episode_id}: its env is gone")
        env.session.require("gym", "cleanroom.gym")  # the native agent has no gym process
        try:
            async with asyncio.timeout(self.run.step_timeout_s):  # no task of its own
                return await env.session.request(kind, header, body)
        except TimeoutError:  # the guest's doing: a step that never answers
            raise GymEnvError(
                f"in-VM env: no answer within {self.run.step_timeout_s}s (step_timeout_s)"
            ) from None
        except EnvCrashed as exc:  # so is an agent (or VM) that died under the env
            raise GymEnvError(f"in-VM env: its VM's agent is gone: {exc}") from exc

    async def ask(self, kind: int, header: dict[str, Any], body: bytes = b"") -> tuple[Frame, Any]:
        """A GYM_RESET/STEP answer (the frame, its decoded tree); any failure ends the
        episode first, then raises."""
        try:
            frame = await self._ask(kind, header, body)
            return frame, wire.value(frame, Kind.GYM_OBS)
        except BaseException as exc:
            await self.end(exc)
            raise

    def record(self, op: str, **fields: Any) -> None:
        """An entry of the episode's transcript (a step of the trajectory)."""
        if self._sb is not None:
            self._sb.transcript.add(op, **fields)

    async def end(self, fault: BaseException | None = None) -> None:
        """Finish the episode: export its evidence, destroy its VM, confirm it absent."""
        if self.ended:
            return
        self.ended = True
        self._fault = fault
        self._done.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=fault is not None)
