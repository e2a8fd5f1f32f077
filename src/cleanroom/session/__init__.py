"""Interactive sessions: an ``Episode`` whose RUN phase is commands and files sent from outside.

    async with session(baseline, driver=d, ledger=l, store=s, seed=3) as sb:
        r = await sb.exec(["pytest", "-q"])        # an ExecResult: the exit code is data
        await sb.put("/repo/fix.py", b"...");  data = await sb.get("/repo/out.txt")
        sb.finish(reward=1.0, info={...})

A session is one episode of a run (ledger intent before the VM, a run lock, an attempt), so it
keeps every lifecycle guarantee of a batch episode: on leaving the block the transcript is
exported as the episode's evidence (``logs/transcript.jsonl``: every command with its argv,
cwd, variable names, start, duration, exit status and output; every file put or read with size
and sha256), then the record (``completed`` once ``finish`` was called, else ``episode_error``),
and only then is the VM destroyed and confirmed absent. An exception in the block ends it the
way it ends any episode (``core.states.classify``) and is raised again.

This is the minimal layer issue 16 asks for on top of ``lifecycle.Episode`` (commands, files);
streaming, background processes, fork and ``cleanroom shell`` are to come on the same object.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pydantic import ValidationError

from cleanroom.agent.session import EpisodeOutput, ExecResult
from cleanroom.baseline.model import Baseline
from cleanroom.core.states import EpisodeState
from cleanroom.drivers.base import Driver, Owner
from cleanroom.errors import CleanroomError, ManifestError
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunContext, RunOptions
from cleanroom.lifecycle.episode import Episode, EpisodeKey
from cleanroom.lifecycle.run import result_problem
from cleanroom.manifest import Manifest, describe
from cleanroom.record import Outcome
from cleanroom.store import Store

__all__ = ["Session", "session"]

TRANSCRIPT = "transcript.jsonl"
OUTPUT_KEPT = 64 * 1024  # of each command's stdout and stderr, in the transcript


class Session:
    """Commands and files in one live episode's env, each kept in its transcript."""

    def __init__(self, episode: Episode) -> None:
        self.episode = episode
        self.steps = 0
        self._result: bytes | None = None
        self._path = episode.staging / "logs" / TRANSCRIPT
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._path.touch(mode=0o600)

    def _env(self) -> Any:
        if self.episode.state is not EpisodeState.RUNNING or self.episode.env is None:
            raise CleanroomError(f"session {self.episode.key.episode_id} is closed")
        return self.episode.env

    def _note(self, entry: dict[str, Any]) -> None:
        self.steps += 1
        with self._path.open("a") as f:
            f.write(json.dumps({"step": self.steps, **entry}, sort_keys=True) + "\n")

    async def exec(
        self,
        argv: list[str],
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the guest; its exit status is data (``check()`` raises). As with
        ``docker exec``, an image baseline's ``Env`` (under ``env``) and ``WorkingDir`` (unless
        ``cwd``) apply, and it runs as the image's ``User`` unless ``user="root"``."""
        started = time.time()
        baseline = self.episode.baseline
        wrapped = baseline.as_user(list(argv), user)
        result: ExecResult = await self._env().exec(
            wrapped,
            timeout_s=timeout_s,
            env={**baseline.env_for(user), **(env or {})} or None,
            cwd=cwd or baseline.workdir,
        )
        self._note(
            {
                "op": "exec",
                "argv": list(argv),
                "user": user or (run_as.user if (run_as := baseline.run_as) else None),
                "cwd": cwd,
                "env_names": sorted(env or {}),  # names, never values
                "started_at": started,
                "duration_s": round(time.time() - started, 6),
                "exit_code": result.exit_code,
                "signal": result.signal,
                "timed_out": result.timed_out,
                "stdout": result.stdout[-OUTPUT_KEPT:].decode(errors="replace"),
                "stderr": result.stderr[-OUTPUT_KEPT:].decode(errors="replace"),
            }
        )
        return result

    async def put(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await self._env().put(path, data, mode)
        self._note({"op": "put", "path": path, **_digest(data)})

    async def get(self, path: str) -> bytes:
        data: bytes = await self._env().get(path)
        self._note({"op": "get", "path": path, **_digest(data)})
        return data

    def finish(self, reward: float, info: dict[str, Any] | None = None) -> None:
        """The session's result (as an entrypoint's result.json); the block's end records it."""
        self._result = json.dumps({"reward": reward, "info": info or {}}).encode()

    def output(self) -> EpisodeOutput:
        """The session as an episode's output: the transcript as its log, ``finish``'s result."""
        return EpisodeOutput(
            exit=ExecResult(0, None, b"", b"", 0.0, False),
            result_raw=self._result,
            stdout_path=self._path,
        )

    def conclude(self) -> None:
        """Hand the transcript and the result to the episode (the end of its RUNNING phase)."""
        output = self.output()
        problem = result_problem(output)
        if self._result is None:
            problem = "the session ended without finish()"
        outcome = Outcome.EPISODE_ERROR if problem else Outcome.COMPLETED
        self.episode.conclude(outcome, problem, output)


def _manifest(
    episode_id: str,
    seed: int,
    policy: dict[str, Any] | None,
    task: dict[str, Any] | None,
    network: list[str] | None,
) -> Manifest:
    return Manifest.model_validate(
        {
            "episode_id": episode_id,
            "seed": seed,
            "policy": policy or {"id": "interactive"},
            "task": task or {},
            **({"network": {"allow": network}} if network is not None else {}),
        }
    )


def _digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@asynccontextmanager
async def session(
    baseline: Baseline,
    *,
    driver: Driver,
    ledger: Ledger,
    store: Store,
    seed: int = 0,
    policy: dict[str, Any] | None = None,
    task: dict[str, Any] | None = None,
    episode_id: str = "session",
    run_id: str | None = None,
    options: RunOptions | None = None,
    network: list[str] | None = None,
) -> AsyncIterator[Session]:
    """One interactive episode (see the module docstring): a run of its own unless ``run_id``
    names one this session may take (the run lock applies). ``network``: the egress allowlist
    (``HOST:PORT`` entries within the baseline's; ``[]``: none at all); None: the baseline's."""
    controller_id = "ses-" + secrets.token_hex(6)
    run_id = run_id or time.strftime("session-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    try:
        manifest = _manifest(episode_id, seed, policy, task, network)
    except ValidationError as exc:
        raise ManifestError(f"session {episode_id!r}: invalid", describe(exc)) from exc
    ctx = RunContext(driver, ledger, store, Owner(controller_id), options or RunOptions())
    ledger.start_run(
        run_id,
        controller_id=controller_id,
        baseline=baseline.digest,
        driver=driver.name,
        parallel=1,
        meta={"kind": "session"},
    )
    status = "failed"
    try:
        attempt = ledger.next_attempt(run_id, episode_id)
        ledger.episode_queued(run_id, episode_id, attempt)
        key = EpisodeKey(run_id, episode_id, attempt)
        async with Episode(ctx, key, manifest, baseline, absorb=False) as episode:
            await episode.provision()
            sb = Session(episode)
            try:
                yield sb
            except BaseException:
                episode.output = sb.output()  # the transcript, kept with the attempt
                raise
            sb.conclude()
        status = "completed"
    finally:
        ledger.finish_run(run_id, status)
