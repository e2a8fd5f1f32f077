"""The ``recovery`` variant of the isolation check: a controller killed mid-episode.

``recovery`` starts a child process (a stand-in controller, run under ``hostproc.supervised``
like every env process) that records its env's intent in the ledger, creates env A, plants the
canaries and reports them on stdout, then waits. The parent SIGKILLs it mid-episode, restarts
the way a new controller does (``reaper.reap``), checks that A's env was reaped and is gone,
and only then creates B to probe.

The child gets its configuration (a picklable driver factory, the baseline, the ledger path,
the token) pickled on stdin; ``main`` is its entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from cleanroom.checks.isolation.cells import CLEANUP, FAIL, PASS, Cell, Variant, evaluate
from cleanroom.checks.isolation.plant import run_canary
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import Limits
from cleanroom.drivers.base import Driver, Env, EnvRequest, Owner, new_env_id
from cleanroom.errors import CheckError
from cleanroom.host import hostproc
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunContext
from cleanroom.lifecycle.lease import EnvLease
from cleanroom.lifecycle.reaper import reap

CHILD_DEADLINE_S = 900.0
REPORT_TIMEOUT_S = 600.0


class Check(Protocol):
    """What the recovery variant uses of the isolation check that runs it."""

    factory: Callable[[], Driver]
    driver: Driver
    baseline: Baseline
    ledger: Ledger
    check_id: str
    env_ids: list[str]

    async def create(self, v: Variant, role: str) -> Env: ...

    async def destroy(self, env: Env) -> bool: ...


async def recovery(check: Check, v: Variant) -> None:
    """Run the recovery variant of ``check`` into ``v`` (see the module docstring)."""
    config = {
        "factory": check.factory,
        "baseline": check.baseline,
        "ledger": str(check.ledger.path),
        "token": v.token,
        "run_id": check.check_id,
        "label": f"{v.name}-A",
    }
    argv = [sys.executable, "-c", "from cleanroom.checks.isolation.recovery import main; main()"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = await asyncio.create_subprocess_exec(
        *hostproc.supervised(argv, CHILD_DEADLINE_S),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    report: dict[str, Any] = {}
    seen: dict[str, Any] = {}  # the child controller's pid, once it said it
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(pickle.dumps(config))
        await child.stdin.drain()
        child.stdin.close()
        report = await asyncio.wait_for(
            _read_report(child.stdout, check, v, seen), REPORT_TIMEOUT_S
        )
    except CheckError as exc:
        raise CheckError(f"{exc}: {await _stderr_tail(child)}") from exc
    finally:
        controller = int(seen.get("pid") or child.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(controller, signal.SIGKILL)  # the controller dies mid-episode
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)  # and its supervisor with it
        await child.wait()
        await hostproc.wait_gone([controller], 10.0)
    if "error" in report:
        raise CheckError(f"recovery: the child controller failed: {report['error']}")
    env_a = v.envs["A"]
    reaped = await reap(check.driver, check.ledger)  # what a restarted controller does first
    gone_a = env_a in reaped.destroyed and not check.driver.exists(env_a)
    b = await check.create(v, "B")
    try:
        probe = await run_canary(check.driver, b, "probe", v.token)
    finally:
        gone_b = await check.destroy(b)
    v.cells = evaluate(report["planted"], report["own"], probe)
    if gone_a and gone_b:
        v.cells[CLEANUP] = Cell(PASS, "A's controller SIGKILLed; the restart reaped A")
    else:
        v.cells[CLEANUP] = Cell(FAIL, f"A reaped: {env_a in reaped.destroyed}; B gone: {gone_b}")


async def _read_report(
    stdout: asyncio.StreamReader, check: Check, v: Variant, seen: dict[str, Any]
) -> dict[str, Any]:
    while line := await stdout.readline():
        data = json.loads(line)
        if "env_id" in data and "planted" not in data:
            check.env_ids.append(data["env_id"])  # known before the env exists: audit it
            v.envs["A"] = data["env_id"]
            seen["pid"] = data["pid"]
            continue
        return dict(data)
    raise CheckError("recovery: the child controller exited without a report")


async def _stderr_tail(child: asyncio.subprocess.Process) -> str:
    if child.stderr is None:
        return ""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(child.wait(), 5.0)
        data = await asyncio.wait_for(child.stderr.read(), 5.0)
        return data[-600:].decode(errors="replace").strip()
    return ""


def _say(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


async def _child(config: dict[str, Any]) -> None:
    driver = config["factory"]()
    baseline = config["baseline"]
    owner = Owner(config["run_id"] + "-child")
    env_id = new_env_id()
    _say({"env_id": env_id, "pid": os.getpid()})
    with Ledger(Path(config["ledger"])) as ledger:
        ctx = RunContext(driver, ledger, None, owner)
        lease = EnvLease(
            ctx, env_id, run_id=config["run_id"], episode_id=config["label"], attempt=1
        )
        limits = Limits().merged_over(baseline.limits)
        request = EnvRequest(env_id, baseline, limits, owner, hard_deadline_s=CHILD_DEADLINE_S)
        try:
            env = await lease.start(request)
            planted = await run_canary(driver, env, "plant", config["token"])
            own = await run_canary(driver, env, "probe", config["token"])
        except BaseException:
            await lease.close()
            raise
        _say({"planted": planted, "own": own})
        await asyncio.sleep(CHILD_DEADLINE_S)  # mid-episode: until the parent kills us


def main() -> None:
    """Entry point of the child controller (configuration pickled on stdin)."""
    config = pickle.loads(sys.stdin.buffer.read())
    try:
        asyncio.run(_child(config))
    except Exception as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)
