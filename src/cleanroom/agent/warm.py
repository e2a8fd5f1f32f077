"""The agent's side of the warm Python worker (``worker.py``): start it, hand it episodes.

A baseline with a function entrypoint carries ``/opt/cleanroom/entry.json`` (the worker's
config). The agent starts the worker at boot and says HELLO once its imports are done, so a
snapshot template holds a ready worker and every clone restores it. Without that file (the
``fake`` driver) or after the worker died, ``run`` starts one on demand. Either way an episode
streams, times out and is killed like a command: its child has its own process group, which
the agent kills at the deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

if __package__:  # on the host, as part of the package (a failed import costs ~30 ms in a VM)
    from cleanroom.agent.protocol import Kind
    from cleanroom.agent.relay import Relay
    from cleanroom.agent.worker import recv_msg, send_msg
else:  # in the guest, next to protocol.py
    from protocol import Kind  # type: ignore[no-redef,import-not-found]
    from relay import Relay  # type: ignore[no-redef,import-not-found]
    from worker import recv_msg, send_msg  # type: ignore[no-redef,import-not-found]

HERE = os.path.dirname(os.path.abspath(__file__))
READY_S = 60.0  # a worker's imports must be done by then (the host's boot timeout is 90 s)
KILL_WAIT_S = 5.0
LAUNCHER = "import sys; sys.path.insert(0, {here!r}); import worker; sys.exit(worker.main())"


def boot_config(path: str) -> dict[str, Any] | None:
    """The baseline's worker config (``/opt/cleanroom/entry.json``), if it names a function."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and config.get("function") else None


class Worker:
    """One worker process and the agent's end of its socket pair."""

    def __init__(self, config: dict[str, Any], env: dict[str, str]) -> None:
        self.config = config
        self.state = "starting"  # -> "ready" | "failed"
        self.facts: dict[str, Any] = {}
        self.ahead = False  # a child is forked and waits for its job (true once ready)
        self.error = ""
        self.sock, self.proc = spawn(LAUNCHER.format(here=HERE), json.dumps(config), env)

    def serves(self, config: dict[str, Any]) -> bool:
        return self.config == config and self.state != "failed" and self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait for the worker's imports; False (worker stopped, ``error`` set) if they fail."""
        if self.state == "starting":
            message: dict[str, Any] | None = None
            self.sock.settimeout(max(timeout_s, 0.001))
            try:
                message, _ = recv_msg(self.sock)
            except TimeoutError:
                self.error = f"its imports took over {timeout_s:.1f}s"
            except (OSError, ValueError, EOFError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                self.sock.settimeout(None)
            if message is not None and message.get("ready") is True:
                self.state, self.facts, self.ahead = "ready", message, True
            else:
                self.state = "failed"
                self.error = str((message or {}).get("error") or self.error or "it exited")
                self.stop()
        return self.state == "ready"

    def hello_facts(self) -> dict[str, Any]:
        if self.state == "ready":
            return {
                "ready": True,
                "pid": self.facts.get("pid"),
                "import_s": self.facts.get("import_s"),
            }
        return {"ready": False, "error": self.error[-400:]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()


def spawn(code: str, config: str, env: dict[str, str]) -> tuple[socket.socket, Any]:
    """``python3 -I -c CODE FD CONFIG`` in a session of its own, ``FD`` its end of a new socket
    pair; returns our end and the process (the warm worker, ``gym_worker``'s gym process)."""
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code, str(theirs.fileno()), config],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
            cwd="/",
            start_new_session=True,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours, proc


def start(config: dict[str, Any], env: dict[str, str]) -> Worker:
    return Worker(config, env)


def _remaining(started: float, timeout_s: float | None) -> float | None:
    return None if timeout_s is None else timeout_s - (time.monotonic() - started)


def _recv(sock: socket.socket, timeout_s: float | None) -> dict[str, Any] | None:
    """The worker's next message; None if it closed the channel; TimeoutError past timeout."""
    sock.settimeout(None if timeout_s is None else max(timeout_s, 0.001))
    try:
        message, _ = recv_msg(sock)
    except (EOFError, ConnectionError, ValueError):
        return None
    finally:
        sock.settimeout(None)
    return message


def _kill_group(pid: int | None) -> None:
    if pid:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def run(agent: Any, header: dict[str, Any], env: dict[str, str], seed: bytes) -> dict[str, Any]:
    """Run one function episode through ``agent.warm`` (started now if needed), streaming its
    stdout/stderr as the agent's STDOUT/STDERR frames; returns the EXIT header."""
    started = time.monotonic()
    timeout_s = header.get("timeout_s")
    config = header["function"]
    how = "warm"
    worker: Worker | None = agent.warm
    if worker is None or not worker.serves(config):
        if worker is not None:
            worker.stop()
        worker = agent.warm = start(config, env_for_worker(env))
        how = "started"
    exit_header = {"entry": "function", "worker": how}
    remaining = _remaining(started, timeout_s)
    if not worker.wait_ready(READY_S if remaining is None else min(remaining, READY_S)):
        why = f"cleanroom-agent: the warm Python worker did not start: {worker.error}\n"
        agent.send(Kind.STDERR, {}, why.encode())
        late = timeout_s is not None and (_remaining(started, timeout_s) or 0) <= 0
        return {**_exit(1, started, late), **exit_header}
    if not worker.ahead:  # its child ran an earlier episode: ask for the next one
        send_msg(worker.sock, {"next": True})
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    job = {
        "function": config["function"],
        "root": env["CLEANROOM_DIR"],
        "cwd": header.get("cwd"),
        "env": env,
        "seed": seed.hex(),
    }
    try:
        send_msg(worker.sock, job, (out_w, err_w))
    finally:
        os.close(out_w)
        os.close(err_w)
    worker.ahead = False
    output = Relay(agent.send, {out_r: Kind.STDOUT, err_r: Kind.STDERR})
    try:
        code, timed_out = _await_child(worker, output, started, timeout_s)
    finally:
        output.drain()
    return {**_exit(code, started, timed_out), **exit_header}


def _await_child(
    worker: Worker, output: Relay, started: float, timeout_s: float | None
) -> tuple[int | None, bool]:
    """Relay the child's output until the worker reports its exit code; kill the child's
    group at the deadline. Returns (code, timed out); code None if the worker died."""
    deadline = None if timeout_s is None else started + timeout_s
    pid: int | None = None
    timed_out = False
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            if timed_out:  # the worker never answered the kill
                message = None
            else:
                timed_out = True
                _kill_group(pid)
                deadline = time.monotonic() + KILL_WAIT_S
                continue
        elif not output.step(remaining, watch=(worker.sock.fileno(),)):
            continue
        else:
            message = _recv(worker.sock, KILL_WAIT_S)  # readable: a whole message follows
        if message is None:  # the worker died (or never answered the kill)
            _kill_group(pid)
            worker.state, worker.error = "failed", "the worker died"
            return None, timed_out
        if "code" in message:
            return int(message["code"]), timed_out
        pid = message.get("pid") if isinstance(message.get("pid"), int) else pid
        if timed_out:  # the child started after the deadline passed
            _kill_group(pid)


def _exit(code: int | None, started: float, timed_out: bool) -> dict[str, Any]:
    return {
        "code": code if code is None or code >= 0 else None,
        "signal": -code if code is not None and code < 0 else None,
        "duration_s": round(time.monotonic() - started, 6),
        "timed_out": timed_out,
    }


def env_for_worker(env: dict[str, str]) -> dict[str, str]:
    """The worker's own environment: the base one, none of an episode's values or secrets."""
    return {k: env[k] for k in ("PATH", "HOME", "LANG") if k in env}
