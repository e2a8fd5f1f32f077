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
streaming, background processes and ``cleanroom shell`` are to come on the same object. A
session made ``forkable`` branches with ``session.fork.fork_session`` (see there).
"""

from __future__ import annotations

import asyncio
import functools
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
from cleanroom.drivers.base import Driver, Env, Owner, new_snapshot_id
from cleanroom.errors import CleanroomError, ManifestError, Unsupported
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import CreateEnv, RunContext, RunOptions
from cleanroom.lifecycle.episode import Episode, EpisodeKey
from cleanroom.lifecycle.run import result_problem
from cleanroom.lifecycle.shield import until_done
from cleanroom.lifecycle.snapshots import delete_snapshot
from cleanroom.manifest import Manifest, describe
from cleanroom.network.egress import episode_policy
from cleanroom.record import Outcome
from cleanroom.session.run_hold import RunHold
from cleanroom.store import Store

__all__ = ["Session", "session"]

TRANSCRIPT = "transcript.jsonl"
OUTPUT_KEPT = 64 * 1024  # of each command's stdout and stderr, in the transcript


class Session:
    """Commands and files in one live episode's env, each kept in its transcript.

    ``hold``: the run it belongs to (finished once it and its branches ended); ``fork_ram``:
    the snapshot id of its RAM file when it was made ``forkable`` (``session.fork``)."""

    def __init__(
        self, episode: Episode, hold: RunHold | None = None, fork_ram: str | None = None
    ) -> None:
        self.episode = episode
        self.hold = hold
        self.fork_ram = fork_ram
        self.branched = 0  # branches forked from it so far (their ids count on: .b1, .b2, ...)
        self.steps = 0
        self._result: bytes | None = None
        self._path = episode.staging / "logs" / TRANSCRIPT
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._path.touch(mode=0o600)

    def _env(self) -> Any:
        if self.episode.state is not EpisodeState.RUNNING or self.episode.env is None:
            raise CleanroomError(f"session {self.episode.key.episode_id} is closed")
        return self.episode.env

    def live_env(self) -> Env:
        """The session's env (CleanroomError once the session is closed)."""
        env: Env = self._env()
        return env

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
    ) -> ExecResult:
        """Run ``argv`` in the guest; its exit status is data (``check()`` raises)."""
        started = time.time()
        result: ExecResult = await self._env().exec(
            list(argv), timeout_s=timeout_s, env=env, cwd=cwd
        )
        self._note(
            {
                "op": "exec",
                "argv": list(argv),
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

    def transcript_digest(self) -> str:
        """sha256 of the transcript so far: what brought the env to its state now."""
        return "sha256:" + hashlib.sha256(self._path.read_bytes()).hexdigest()

    def note(self, op: str, **facts: Any) -> None:
        """Add a step other than a command or a file (e.g. ``fork``) to the transcript."""
        self._note({"op": op, "at": time.time(), **facts})

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
    forkable: bool = False,
) -> AsyncIterator[Session]:
    """One interactive episode (see the module docstring): a run of its own unless ``run_id``
    names one this session may take (the run lock applies). ``network``: the egress allowlist
    (``HOST:PORT`` entries within the baseline's; ``[]``: none at all); None: the baseline's.
    ``forkable``: its guest RAM in a file of its own, so ``session.fork.fork_session`` can
    branch it (costs: no spare, a copy of the template's RAM at the start, that file on disk;
    ``Unsupported`` on a driver without fork or with egress)."""
    controller_id = "ses-" + secrets.token_hex(6)
    run_id = run_id or time.strftime("session-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    try:
        manifest = _manifest(episode_id, seed, policy, task, network)
    except ValidationError as exc:
        raise ManifestError(f"session {episode_id!r}: invalid", describe(exc)) from exc
    if forkable:
        refuse_fork(driver, baseline, manifest)
    ctx = RunContext(driver, ledger, store, Owner(controller_id), options or RunOptions())
    ledger.start_run(
        run_id,
        controller_id=controller_id,
        baseline=baseline.digest,
        driver=driver.name,
        parallel=1,
        meta={"kind": "session"},
    )
    hold, ok, fork_ram = RunHold(ledger, run_id), False, None
    hold.take()
    try:
        attempt = ledger.next_attempt(run_id, episode_id)
        ledger.episode_queued(run_id, episode_id, attempt)
        key = EpisodeKey(run_id, episode_id, attempt)
        start: CreateEnv | None = None
        if forkable:
            fork_ram = ram_intent(ctx, run_id, episode_id, baseline)
            start = functools.partial(driver.fork_parent, snapshot_id=fork_ram)
        async with Episode(ctx, key, manifest, baseline, absorb=False, start=start) as episode:
            await episode.provision()
            sb = Session(episode, hold, fork_ram)
            try:
                yield sb
            except BaseException:
                episode.output = sb.output()  # the transcript, kept with the attempt
                raise
            sb.conclude()
        ok = True
    finally:
        try:
            if fork_ram is not None:  # the env is gone: its RAM file may go
                await until_done(asyncio.ensure_future(delete_snapshot(ctx, run_id, fork_ram)))
        finally:
            hold.let_go(ok)


def refuse_fork(driver: Driver, baseline: Baseline, manifest: Manifest) -> None:
    """``Unsupported`` unless a session of ``manifest`` on ``driver`` could be forked."""
    if "fork-live" not in driver.capabilities:
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
