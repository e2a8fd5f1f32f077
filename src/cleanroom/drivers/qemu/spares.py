"""Spare clones for the qemu driver: started and run once ahead, so an episode's snapshot
start is only ``cont``, RESEED and HELLO, on code the clone has already translated.

A spare is a clone in all but use: its own env id (the QEMU process's marker and its run folder,
with owner.json naming this controller), the template's RAM mapped copy-on-write, the device
state loaded. It starts with ``-S``, then ``run_ahead`` runs it once (RESEED, a warm-up) and
stops its vCPU again; the take RESEEDs it once more (fresh entropy, the clock). QEMU's own start
(~55 ms of CPU under TCG) and the first translation of the paths every episode runs are then
off the episode's path.

The driver keeps ``target`` spares per shape (baseline, limits) that ``take_id`` was asked for,
topped up in the background after each snapshot start of that shape, once no create is in
flight. ``take_id`` hands out a spare's env id, so the controller's ledger intent names the env
before it is used, and ``create`` with that id resumes the spare (``claim`` + ``resume``). A
spare that no longer fits (its template was replaced, its QEMU died, it is older than
``MAX_AGE_S``) is destroyed instead, and the env starts the usual way under the same id.
``release`` destroys the spares nobody took and returns each destroy's report (the controller
calls it at the end of a run); after a crash the reaper finds them by their run folders and dead
owner, like any orphaned env.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cleanroom.agent.connection import AgentConnection
from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers import qmp, snapshot
from cleanroom.drivers.base import DestroyReport, Env, EnvRequest, new_env_id, write_owner
from cleanroom.drivers.qemu.clone import Cloner, load_accepted, reseed, reseed_again
from cleanroom.drivers.qemu.context import QemuContext
from cleanroom.drivers.qemu.live import Live, first_line
from cleanroom.drivers.qemu.touch import touch_guest_paths

if TYPE_CHECKING:
    from cleanroom.core.baseline_model import Baseline

MAX_AGE_S = 120.0  # a spare not taken by then is destroyed, not used
Shape = tuple[str, ResolvedLimits]  # (baseline digest, limits): what a spare can serve


def shape_of(baseline: Baseline, limits: ResolvedLimits) -> Shape:
    return (baseline.digest, limits)


@dataclass
class Spare:
    env_id: str
    shape: Shape
    template: snapshot.Template
    live: Live
    monitor: tuple[asyncio.StreamReader, asyncio.StreamWriter]  # its load monitor, kept open
    session: AgentConnection  # its agent, which said HELLO once already (``run_ahead``)
    warmed: str  # what ran ahead: "command" (touch.py's paths), "worker" (WARM_UP) or "none"
    started: float  # monotonic: when its QEMU was spawned
    deadline: float  # monotonic: when its supervisor kills it

    def stale(self, now: float) -> str | None:
        """Why this spare can serve nobody any more (None: it still can)."""
        if self.live.proc.returncode is not None:
            return f"its QEMU exited ({self.live.proc.returncode})"
        if now - self.started > MAX_AGE_S:
            return f"it is older than {MAX_AGE_S:.0f}s"
        return None

    def fits(self, request: EnvRequest, template: snapshot.Template, now: float) -> str | None:
        """Why this spare cannot serve ``request`` (None: it can)."""
        if why := self.stale(now):
            return why
        if template.digest != self.template.digest:
            return "its template was replaced"
        if shape_of(request.baseline, request.limits) != self.shape or request.network:
            return "the request has another shape"
        if now + request.hard_deadline_s > self.deadline:
            return "its hard deadline is too close"
        return None


class TemplateSource(Protocol):
    """What spares use of ``templates.Templates``: the checked template of a request."""

    async def template_for(
        self, request: EnvRequest, accel: accel_mod.Accel
    ) -> tuple[snapshot.Template, str | None]: ...


class Spares:
    """The spares of one driver: ready ones by shape, taken ones by env id, starting ones."""

    def __init__(self, ctx: QemuContext, templates: TemplateSource, cloner: Cloner) -> None:
        self.ctx = ctx
        self.templates = templates
        self.cloner = cloner
        self.target = 0
        self.wanted: set[Shape] = set()  # shapes ``take_id`` was asked for
        self.ready: dict[Shape, list[Spare]] = {}
        self.taken: dict[str, Spare] = {}
        self.starting: dict[str, tuple[Shape, asyncio.Task[None]]] = {}
        self.chores: set[asyncio.Task[DestroyReport]] = set()  # destroys of unfit spares
        self.last_error: str | None = None  # why the last spare failed to start
        self.creating = 0  # the driver's creates in flight: spares start only in between
        self.quiet = asyncio.Event()
        self.quiet.set()

    @contextlib.contextmanager
    def create_in_flight(self) -> Iterator[None]:
        """Around a create: spares wait for the creates in flight, whose CPU they would take
        (a burst of 8 creates is ready sooner if the spares it uses up are replaced after)."""
        self.creating += 1
        self.quiet.clear()
        try:
            yield
        finally:
            self.creating -= 1
            if not self.creating:
                self.quiet.set()

    def take_id(self, baseline: Baseline, limits: ResolvedLimits) -> str | None:
        """Reserve the oldest ready spare of this shape and return its env id, if any. Only
        shapes asked for here get spares (not, say, a verifier's envs)."""
        now = time.monotonic()
        shape = shape_of(baseline, limits)
        self.wanted.add(shape)
        queue = self.ready.get(shape, [])
        while queue:
            spare = queue.pop(0)
            if spare.stale(now) is None:
                self.taken[spare.env_id] = spare
                return spare.env_id
            self.discard(spare)
        return None

    def claim(self, env_id: str) -> Spare | None:
        """The spare reserved under ``env_id`` (once)."""
        return self.taken.pop(env_id, None)

    def discard(self, spare: Spare) -> None:
        """Destroy a spare in the background (``release`` waits for it)."""
        task = asyncio.ensure_future(self._destroy(spare))
        self.chores.add(task)
        task.add_done_callback(self.chores.discard)

    def top_up(self, request: EnvRequest, accel: accel_mod.Accel) -> None:
        """Start spares of ``request``'s shape until ``target`` are ready or starting."""
        shape = shape_of(request.baseline, request.limits)
        if self.target <= 0 or request.network is not None or shape not in self.wanted:
            return
        have = len(self.ready.get(shape, [])) + sum(s == shape for s, _ in self.starting.values())
        for _ in range(self.target - have):
            env_id = new_env_id()
            spare_request = dataclasses.replace(
                request,
                env_id=env_id,
                labels={"spare": "true"},
                hard_deadline_s=request.hard_deadline_s + MAX_AGE_S,
            )
            task = asyncio.ensure_future(self._start(spare_request, accel, shape))
            self.starting[env_id] = (shape, task)

    async def _start(self, request: EnvRequest, accel: accel_mod.Accel, shape: Shape) -> None:
        env_id = request.env_id
        monitor: socket.socket | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            await self.quiet.wait()
            template, _ = await self.templates.template_for(request, accel)
            started = time.monotonic()
            live, monitor = await self.cloner.spawn_restoring(request, accel, template, paused=True)
            reader, writer = await asyncio.open_unix_connection(sock=monitor)
            monitor = None  # the streams own it now
            timeout_s = self.ctx.config.restore_timeout_s
            await asyncio.wait_for(load_accepted(live, reader), timeout_s)
            command = request.baseline.function is None  # a function episode runs no command
            ahead = run_ahead(env_id, live, reader, writer, command=command)
            session, warmed = await asyncio.wait_for(ahead, timeout_s)
        except BaseException as exc:
            if monitor is not None:
                monitor.close()
            if writer is not None:  # cancelled (release) after the streams took the monitor
                writer.close()
            await asyncio.shield(self.ctx.destroy(env_id))
            if not isinstance(exc, Exception):
                raise  # cancelled (release): nothing to report
            self.last_error = first_line(exc)
            return
        finally:
            self.starting.pop(env_id, None)
        deadline = started + request.hard_deadline_s
        spare = Spare(
            env_id, shape, template, live, (reader, writer), session, warmed, started, deadline
        )
        self.ready.setdefault(shape, []).append(spare)

    async def settled(self) -> None:
        """Wait until no spare is starting (benchmarks and tests)."""
        while self.starting:
            await asyncio.gather(*(t for _, t in self.starting.values()), return_exceptions=True)

    async def release(self) -> list[DestroyReport]:
        """Stop topping up; destroy every spare nobody took (and any starting). Their reports."""
        self.target = 0
        self.wanted.clear()
        starting = [task for _, task in self.starting.values()]
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        await asyncio.gather(*self.chores, return_exceptions=True)
        spares = [s for queue in self.ready.values() for s in queue]
        self.ready.clear()
        return [await self._destroy(s) for s in spares]

    async def _destroy(self, spare: Spare) -> DestroyReport:
        """Destroy a spare nobody will take, its load monitor and agent streams closed first
        (left to the garbage collector they were ``ResourceWarning: unclosed`` after a Gym
        env's ``close``)."""
        _close_monitor(spare)
        with contextlib.suppress(Exception):
            await spare.session.aclose()
        return await self.ctx.destroy(spare.env_id)

    def forget(self, env_id: str) -> None:
        """``env_id`` is being destroyed: no longer a spare anyone can take."""
        spare = self.taken.pop(env_id, None)
        for queue in self.ready.values():
            queue[:] = [s for s in queue if s.env_id != env_id]
        if spare is not None:
            _close_monitor(spare)

    async def resume(
        self, spare: Spare, request: EnvRequest, accel: accel_mod.Accel, started: float
    ) -> Env:
        """Run the spare for ``request`` (its env id): ``cont``, RESEED, HELLO."""
        write_owner(spare.live.run_dir, request, self.ctx.config.name)  # the episode's labels
        reader, writer = spare.monitor

        async def resumed() -> AgentConnection:
            await spare.live.while_running(qmp.command(reader, writer, "cont"))
            await spare.live.while_running(reseed_again(request.env_id, spare.session))
            return spare.session

        launcher = self.ctx.launcher
        try:
            session = await launcher.ready_or_destroy(
                request.env_id,
                spare.live,
                resumed(),
                self.ctx.config.restore_timeout_s,
                "resume",
            )
        finally:
            _close_monitor(spare)
        return launcher.env(
            request,
            accel,
            spare.live,
            started,
            session,
            start_kind="snapshot",
            template=spare.template.digest,
            spare_s=round(started - spare.started, 3),
        )


async def run_ahead(
    env_id: str,
    live: Live,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    command: bool,
) -> tuple[AgentConnection, str]:
    """Run a restored spare once before anyone takes it, then stop its vCPU again; its agent
    session and what warmed it (``Spare.warmed``).

    ``cont``, RESEED (its id), HELLO, a warm-up, ``stop``. Under TCG each new QEMU process
    translates every guest code path it runs for the first time; here that happens off the
    episode's path. A command baseline runs the paths a session's first steps take
    (``touch.py``: a shell writing a file in /tmp, the agent reading one): the agent's RESEED,
    EXEC and DOWNLOAD paths, the guest kernel's ``fork``/``exec``/``exit`` and file paths (with
    ``norandmaps`` the loader's and libc's too); a baseline without a shell still gets the
    kernel's and the agent's, its exit 127 is not an error. A function baseline's episodes run
    no command (its worker's child is forked already): its spares' warm worker walks an
    episode's Python paths instead (WARM_UP; the function episode from a spare took 279 -> 111
    ms when a `python3` ran such code first, same run), where its HELLO says it can. The take
    RESEEDs the spare again (fresh entropy, the clock).
    """
    await live.while_running(qmp.command(reader, writer, "cont"))
    session = await reseed(env_id, live)
    warmed = "none"
    try:
        if command:
            await live.while_running(touch_guest_paths(session))
            warmed = "command"
        elif isinstance(worker := session.hello.get("warm"), dict) and worker.get("warm_up"):
            answer = await live.while_running(session.warm_up())
            warmed = "worker" if answer["warmed"] else "none"
        await live.while_running(qmp.command(reader, writer, "stop"))
    except BaseException:
        await asyncio.shield(session.aclose())
        raise
    return session, warmed


def _close_monitor(spare: Spare) -> None:
    with contextlib.suppress(Exception):
        spare.monitor[1].close()
