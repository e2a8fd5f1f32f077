"""Function entrypoints on the native agent: it starts the warm Python worker (``worker.py``)
at boot and relays a function RUN to it.

The agent runs as a host process laid out as in a baseline (``<dir>/agent/agent``,
``<dir>/agent/worker.py``, ``<dir>/entry.json``), driven by the real host side over a unix
socket; the function is the warm test baseline's ``entry:run``. Protects: HELLO reports the
worker ready before any RUN (so a snapshot template holds it), the episode runs in a fork of
that pre-imported worker with the episode's environment, streams and artifacts, its exit code,
exception and deadline (the whole process group killed) come back as EXIT, the worker serves
the next RUN too, one is started on demand without ``entry.json``, and a worker whose imports
fail is reported in HELLO and as the episode's stderr instead of hanging the agent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from tests.agent.test_native_agent import drive

from cleanroom.agent import native
from cleanroom.agent.connection import AgentConnection

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")

ENTRY_DIR = Path(__file__).resolve().parents[1] / "baselines" / "warm" / "files"
CONFIG = {"function": "entry:run", "preimport": ["json", "random"], "path": [str(ENTRY_DIR)]}
WORKER = Path(native.NATIVE_DIR).parent / "worker.py"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native-warm") / native.BINARY
    subprocess.run(native.gcc_argv(out), cwd=native.NATIVE_DIR, check=True)
    return out


def lay_out(built: Path, where: Path, config: dict[str, Any] | None = CONFIG) -> Path:
    """The agent as a baseline holds it; returns the binary to start."""
    folder = where / "opt" / "agent"
    folder.mkdir(parents=True)
    shutil.copy(built, folder / native.BINARY)
    shutil.copy(WORKER, folder / "worker.py")
    if config is not None:
        (folder.parent / "entry.json").write_text(json.dumps(config, sort_keys=True) + "\n")
    return folder / native.BINARY


def episode(
    session: AgentConnection, root: Path, timeout_s: float = 30, **task: Any
) -> dict[str, Any]:
    manifest = {"episode_id": "ep-1", "seed": 6, "task": task}
    request = {
        "manifest": manifest,
        "function": CONFIG,
        "env": {"A": "1"},
        "timeout_s": timeout_s,
        "secret_files": {"token": "s3cret"},
    }
    return {"request": request, "staging": root / f"staging-{time.monotonic_ns()}"}


async def run(session: AgentConnection, root: Path, timeout_s: float = 30, **task: Any) -> Any:
    spec = episode(session, root, timeout_s, **task)
    return await session.run_episode(spec["request"], spec["staging"], quota_bytes=1 << 24)


def test_a_function_episode_runs_in_a_fork_of_the_worker_started_at_boot(
    built: Path, tmp_path: Path
) -> None:
    """HELLO says the worker is ready (its pid); RUN's function returns the result; stdout,
    stderr and the artifact come back; the child has the episode's env and is the worker's."""
    binary = lay_out(built, tmp_path)

    async def body(session: AgentConnection) -> Any:
        return session.hello, await run(session, tmp_path), await run(session, tmp_path)

    hello, first, second = drive(binary, tmp_path, body)
    assert hello["warm"]["ready"] is True and "mux" in hello["features"]
    assert first.exit.exit_code == 0 and first.entry == {"entry": "function", "worker": "warm"}
    result = json.loads(first.result_raw)
    assert result["reward"] == 3.0
    info = result["info"]
    assert info["imported_in"] == hello["warm"]["pid"] == info["ppid"]
    assert info["pgid"] == info["pid"]  # its own process group: the deadline kills it whole
    assert {"A", "CLEANROOM_DIR", "PATH", "HOME"} <= set(info["env"])
    assert first.stdout_path.read_bytes() == b"warm: stdout ep-1 seed=6\n"
    assert first.stderr_path.read_bytes() == b"warm: stderr ep-1\n"
    assert [a.name for a in first.artifacts] == ["hello.txt"]
    assert second.exit.exit_code == 0 and json.loads(second.result_raw)["reward"] == 3.0
    assert json.loads(second.result_raw)["info"]["pid"] != info["pid"]  # a new fork each time


def test_exit_codes_exceptions_and_the_deadline_come_back_as_exit(
    built: Path, tmp_path: Path
) -> None:
    """sys.exit(5) is code 5; an exception is code 1 with its traceback on stderr; past its
    deadline the child's whole group (a grandchild too) is killed and the worker still serves."""
    binary = lay_out(built, tmp_path)
    guest_root = tmp_path / "guest" / "run" / "cleanroom"

    async def body(session: AgentConnection) -> Any:
        code = await run(session, tmp_path, mode="exit", code=5)
        boom = await run(session, tmp_path, mode="raise")
        slow = await run(session, tmp_path, timeout_s=1.5, mode="sleep", seconds=60)
        grandchild = int((guest_root / "grandchild.pid").read_text())
        after = await run(session, tmp_path)
        return code, boom, slow, grandchild, after

    code, boom, slow, grandchild, after = drive(binary, tmp_path, body)
    assert code.exit.exit_code == 5
    assert boom.exit.exit_code == 1 and b"ValueError: boom in ep-1" in boom.stderr_path.read_bytes()
    assert slow.exit.timed_out and slow.exit.duration_s < 10
    assert not Path(f"/proc/{grandchild}").exists() or _is_zombie(grandchild)
    assert after.exit.exit_code == 0


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_without_entry_json_a_worker_is_started_for_the_first_function_run(
    built: Path, tmp_path: Path
) -> None:
    """No worker at boot (HELLO has no ``warm``); the RUN starts one (``worker: started``)."""
    binary = lay_out(built, tmp_path, config=None)

    async def body(session: AgentConnection) -> Any:
        return session.hello, await run(session, tmp_path)

    hello, output = drive(binary, tmp_path, body)
    assert "warm" not in hello
    assert output.exit.exit_code == 0 and output.entry["worker"] == "started"


def test_a_worker_whose_imports_fail_is_reported_not_waited_for(
    built: Path, tmp_path: Path
) -> None:
    """A function that cannot be imported: HELLO says why; the episode exits 1 saying so."""
    binary = lay_out(built, tmp_path, config={**CONFIG, "function": "no_such_module:run"})

    async def body(session: AgentConnection) -> Any:
        spec = episode(session, tmp_path)
        spec["request"]["function"] = {**CONFIG, "function": "no_such_module:run"}
        out = await session.run_episode(spec["request"], spec["staging"], quota_bytes=1 << 20)
        return session.hello, out

    hello, output = drive(binary, tmp_path, body)
    assert hello["warm"]["ready"] is False and "no_such_module" in hello["warm"]["error"]
    assert output.exit.exit_code == 1
    assert b"warm Python worker did not start" in output.stderr_path.read_bytes()


def test_a_warm_up_runs_in_the_worker_and_the_episode_after_it_is_untouched(
    built: Path, tmp_path: Path
) -> None:
    """WARM_UP (a spare's, before its take) is answered ``warmed`` by the worker itself; the
    episode after it still runs in the child forked ahead at boot, with ``random`` as it would
    have been (the warm-up touched no module state) and no file left by the warm-up. Without a
    worker, WARM_UP answers ``warmed: false`` and the agent serves on."""
    binary = lay_out(built, tmp_path)
    guest = tmp_path / "guest"

    async def body(session: AgentConnection) -> Any:
        before = sorted(p.name for p in guest.iterdir()) if guest.exists() else []
        warmed = await session.warm_up()
        after = sorted(p.name for p in guest.iterdir()) if guest.exists() else []
        return session.hello, warmed, before, after, await run(session, tmp_path)

    hello, warmed, before, after, output = drive(binary, tmp_path, body)
    assert hello["warm"]["warm_up"] is True
    assert warmed["warmed"] is True and warmed["warm_up_ms"] >= 0
    assert before == after  # nothing written by the warm-up
    assert output.exit.exit_code == 0 and output.entry == {"entry": "function", "worker": "warm"}
    info = json.loads(output.result_raw)["info"]
    assert info["ppid"] == hello["warm"]["pid"]  # the worker survived its SIGUSR1

    bare = lay_out(built, tmp_path / "bare", config=None)

    async def without_worker(session: AgentConnection) -> Any:
        return await session.warm_up(), await session.ping()

    warmed_bare, _ = drive(bare, tmp_path / "bare", without_worker)
    assert warmed_bare["warmed"] is False
