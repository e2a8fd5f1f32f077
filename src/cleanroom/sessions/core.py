"""``AsyncSession``: one live session (``commands``, ``files``, ``finish``) over its ``Episode``.

The session's end is decided here and handed to the episode (``conclude``): ``completed``
after ``finish(reward)``; ``episode_error`` after ``finish(..., error=...)``, without
``finish``, when an artifact named in ``finish`` is missing, or when the guest broke the
protocol; ``env_crashed`` when the env died; ``timeout`` when ``timeout_s`` or
``idle_timeout_s`` passed. The artifacts named in ``finish`` are fetched from the env before it
is destroyed and exported with the record.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol

from cleanroom.agent import wire
from cleanroom.agent.connection import Artifact, EpisodeOutput, ExecResult
from cleanroom.core.states import Failure, Outcome
from cleanroom.drivers.base import Env
from cleanroom.errors import (
    CleanroomError,
    ManifestError,
    QuotaExceeded,
    SessionTimeout,
    UnsafePath,
    Unsupported,
)
from cleanroom.lifecycle.episode import Episode
from cleanroom.lifecycle.run import result_problem
from cleanroom.sessions.commands import Commands
from cleanroom.sessions.files import Files
from cleanroom.sessions.guard import Guard
from cleanroom.sessions.lifetime import Lifetime
from cleanroom.sessions.run_hold import RunHold
from cleanroom.sessions.transcript import Transcript, digest


class Forker(Protocol):
    """What ``AsyncSession.fork`` calls (``sessions.fork.fork_session``, given by whoever opens
    the session: this module never imports the fork's)."""

    async def __call__(self, sb: AsyncSession, n: int) -> Sequence[AsyncSession]: ...


class AsyncSession:
    """Commands and files in one live episode's env, each kept in its transcript."""

    def __init__(self, episode: Episode, forker: Forker | None = None) -> None:
        self.episode = episode
        self.forker = forker
        self.quota_bytes = episode.limits.output_quota_mib * 1024 * 1024
        self.transcript = Transcript(episode.staging / "logs", self.quota_bytes)
        self.transcript.redactor = episode.redactor
        self.guard = Guard(episode, self.transcript)
        self.commands = Commands(self.guard, episode.secret_values)
        self.files = Files(self.guard, self.quota_bytes)
        self.owner: asyncio.Task[Any] | None = None  # cancelled when a limit passes
        self._result: bytes | None = None
        self._artifacts: list[str] = []
        self._error: str | None = None
        self._concluded = False
        self.hold: RunHold | None = None  # the run, ended once it and its branches have
        self.fork_ram: str | None = None  # made ``forkable``: its RAM file's snapshot id
        self.branched = 0  # branches forked from it so far (their ids count on: .b1, .b2)

    @property
    def episode_id(self) -> str:
        return self.episode.key.episode_id

    @property
    def steps(self) -> int:
        return self.transcript.steps

    def live_env(self) -> Env:
        """The session's env (``SessionClosed`` once it has ended)."""
        return self.guard.env()

    def transcript_digest(self) -> str:
        """sha256 of the transcript so far: what brought the env to its state now."""
        return "sha256:" + hashlib.sha256(self.transcript.path.read_bytes()).hexdigest()

    @property
    def expired(self) -> str | None:
        """``timeout_s`` / ``idle_timeout_s`` once one of them passed, else None."""
        return self.guard.lifetime.expired if self.guard.lifetime else None

    def start_clocks(self, timeout_s: float | None, idle_timeout_s: float | None) -> None:
        """Start ``timeout_s`` and ``idle_timeout_s`` now (the env is ready)."""
        self.owner = asyncio.current_task()
        self.guard.lifetime = Lifetime(timeout_s, idle_timeout_s, self._expire)

    def _expire(self, limit: str) -> None:
        assert self.guard.lifetime is not None
        self.guard.closed = self.guard.lifetime.describe()
        self.transcript.add("expired", limit=limit)
        self._cancel()

    def _cancel(self) -> None:
        """Cancel the owner and the calls, again every 0.2 s until the session concludes:
        Python 3.11's ``wait_for`` drops a cancellation that meets a frame arriving."""
        if self._concluded:
            return
        self.guard.cancel_calls(also=self.owner)
        asyncio.get_running_loop().call_later(0.2, self._cancel)

    def stop_clocks(self) -> None:
        """No limit fires, no cancellation is sent any more (the block has ended)."""
        self._concluded = True
        if self.guard.lifetime is not None:
            self.guard.lifetime.stop()

    def timeout_error(self) -> SessionTimeout:
        assert self.guard.lifetime is not None and self.expired is not None
        why = self.guard.lifetime.describe()
        return SessionTimeout(f"session {self.episode_id}: {why}", self.expired)

    # -- the low-level names of the first session API (kept for its callers) ---------------

    async def exec(self, argv: list[str], **kw: Any) -> ExecResult:
        """``commands.run(argv)``'s raw ``ExecResult`` (``timeout_s``, ``env``, ``cwd``)."""
        r = await self.commands.run(list(argv), timeout=kw.pop("timeout_s", None), **kw)
        assert r.raw is not None
        return r.raw  # type: ignore[no-any-return]

    async def put(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await self.files.write(path, data, mode)

    async def get(self, path: str) -> bytes:
        return await self.files.read(path)

    async def fork(self, n: int) -> list[AsyncSession]:
        """``n`` new sessions from this one's state now (``sessions.fork``)."""
        if self.forker is None:
            raise Unsupported(f"session {self.episode_id}: opened without a way to fork")
        return list(await self.forker(self, n))

    # -- the end ----------------------------------------------------------------------------

    def finish(
        self,
        reward: float,
        info: dict[str, Any] | None = None,
        artifacts: list[str] | None = None,
        *,
        error: str | None = None,
    ) -> None:
        """The session's result; ``artifacts`` (guest paths) are fetched when it closes;
        ``error``: the caller's word that the episode failed (``episode_error``)."""
        names: dict[str, str] = {}  # one path per artifact name: a repeat is listed once
        for path in artifacts or []:
            names.setdefault(_artifact_name(path), path)  # refused now, not at close
        body = {"reward": reward, "terminated": True, "info": info or {}}
        self._result = json.dumps(body).encode()
        self._artifacts, self._error = list(names.values()), error
        self.transcript.add("finish", reward=reward, artifacts=self._artifacts, error=error)

    def output(self, artifacts: list[Artifact] | None = None) -> EpisodeOutput:
        """The session as an episode's output: transcript and command log, ``finish``'s result."""
        return EpisodeOutput(
            exit=ExecResult(0, None, b"", b"", 0.0, False),
            artifacts=artifacts or [],
            result_raw=self._result,
            stdout_path=self.transcript.path,
            stderr_path=self.transcript.log_path,
        )

    async def _collect(self) -> list[Artifact]:
        """Fetch the artifacts named in ``finish`` into the staging (within the quota)."""
        folder, left, out = self.episode.staging / "artifacts", self.quota_bytes, []
        for path in self._artifacts:
            name = _artifact_name(path)
            async with self.guard.call() as env:
                data: bytes = await env.get(path)
            self.transcript.add("artifact", path=path, name=name, **digest(data))
            left -= len(data)
            if left < 0:
                raise QuotaExceeded(f"artifacts over the output quota ({self.quota_bytes} B)")
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            out.append(Artifact(name, len(data), hashlib.sha256(data).hexdigest(), target))
        return out

    async def conclude(self, failure: Failure | None = None) -> None:
        """End the RUNNING phase: ``failure`` (a limit, the guest) or what ``finish`` said."""
        self.stop_clocks()
        artifacts: list[Artifact] = []
        problem: str | None = None
        if failure is None and self._result is not None:
            try:
                artifacts = await self._collect()
            except CleanroomError as exc:
                problem = f"artifact: {type(exc).__name__}: {exc}"
        self.guard.closed = self.guard.closed or "it was closed"
        output = self.output(artifacts)
        if failure is not None:
            self.episode.conclude(failure.outcome, failure.error, output)
            return
        problem = problem or self._error or result_problem(output)
        if self._result is None:
            problem = "the session ended without finish()"
        outcome = Outcome.EPISODE_ERROR if problem else Outcome.COMPLETED
        self.episode.conclude(outcome, problem, output)


def _artifact_name(path: str) -> str:
    """A guest path as the artifact's name (``/repo/patch.diff`` -> ``repo/patch.diff``)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise ManifestError(f"finish: artifact {path!r} is not an absolute guest path")
    try:
        return str(wire.guest_name(path.lstrip("/"), "artifact path"))
    except UnsafePath as exc:  # the caller's argument, not the guest's doing
        raise ManifestError(f"finish: artifact {path!r}: {exc}") from exc
