"""The warm Python worker: pre-imports a baseline's modules once, then forks a child per episode.

Standard library only; copied into every baseline next to the agent. The agent starts it as
``python3 -I -c '... worker.main()' FD CONFIG`` (``FD``: its end of a unix socket pair;
``CONFIG``: ``{"function": "module:function", "preimport": [...], "path": [...]}``). The worker
puts ``path`` first on ``sys.path``, imports every ``preimport`` module and the function's
module, says ``{"ready": true}`` (or ``{"ready": false, "error": traceback}`` and exits), and
waits. In a snapshot template it waits there: every clone restores it with its imports done.

It forks one child ahead, in its own process group, waiting for a job (a message carrying
the child's stdout and stderr pipes): in a template that child is saved too, so a clone forks
nothing. The child says ``{"pid"}`` and runs the job; the worker waits for it, reports
``{"code"}`` (negative: killed by that signal) and forks the next when the agent asks
(``{"next": true}``). To the episode the child looks like a fresh process: stdin
``/dev/null``, stdout/stderr the pipes, the job's cwd and environment, ``random`` (and
numpy's global generator, if loaded) reseeded from the job's seed. It calls
``function(manifest)`` and writes the returned dict as ``result.json``; a non-dict, an
unserialisable dict or an exception exits 1 with the traceback on stderr. The worker itself
never runs episode code.

A spare clone's agent may send it ``SIGUSR1`` before anyone takes the clone: the worker then
walks an episode's Python paths once in its own process (``rehearse_job``: a job with two
descriptors sent to itself on a socket pair, a seed, a file read, text written to
``/dev/null``, an exception caught; nothing written, nothing kept) and says
``{"warmed": true}``. Under TCG the child, a fork of it at the same addresses,
then finds that code translated.

Messages both ways: a 4-byte big-endian length, then a JSON object; a job's two descriptors
ride on its first bytes (``SCM_RIGHTS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

LENGTH = struct.Struct(">I")
MAX_MESSAGE = 8 * 1024 * 1024


def send_msg(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """Send one message (with ``fds`` attached to its first bytes)."""
    data = json.dumps(message, separators=(",", ":")).encode()
    payload = LENGTH.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [payload], list(fds))
        payload = payload[sent:]
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, size: int, start: bytes = b"") -> bytes:
    data = bytearray(start)
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("worker channel closed mid-message")
        data += chunk
    return bytes(data)


def recv_msg(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; ``(None, [])`` when the peer closed."""
    fds: list[int] = []
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, LENGTH.size, max_fds)
    else:
        head = sock.recv(LENGTH.size)
    if not head:
        return None, fds
    (size,) = LENGTH.unpack(_recv_exact(sock, LENGTH.size, head))
    if size > MAX_MESSAGE:
        raise ValueError(f"worker message of {size} bytes")
    message = json.loads(_recv_exact(sock, size))
    if not isinstance(message, dict):
        raise ValueError("worker message is not a JSON object")
    return message, fds


def resolve(spec: str) -> Any:
    """``module:function`` (the attribute may be dotted) -> the callable."""
    module_name, _, attr = spec.partition(":")
    __import__(module_name)
    target: Any = sys.modules[module_name]
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target


def reseed(seed: bytes) -> None:
    """Reseed ``random`` and numpy's global generator (only if already loaded) from ``seed``."""
    if "random" in sys.modules:
        sys.modules["random"].seed(seed)
    np_random = sys.modules.get("numpy.random")
    if np_random is not None and hasattr(np_random, "seed"):
        words = [int.from_bytes(seed[i : i + 4], "little") for i in range(0, len(seed) - 3, 4)]
        np_random.seed(words or [0])


# -- the child: one episode ----------------------------------------------------------------------


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def call_entry(job: dict[str, Any]) -> int:
    """Run the episode's function in this (child) process; returns its exit code."""
    import traceback  # imported by warm_up already: a child must not pay for imports

    root = job["root"]
    try:
        with open(root + "/manifest.json") as f:
            manifest = json.load(f)
        result = resolve(job["function"])(manifest)
        if not isinstance(result, dict):
            raise TypeError(f"{job['function']} returned {type(result).__name__}, not a dict")
        data = json.dumps(result)
        with open(root + "/result.json.tmp", "w") as f:
            f.write(data)
        os.replace(root + "/result.json.tmp", root + "/result.json")
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        return 1


def prepare_child() -> None:
    """What a child can do before its job arrives (in a template: before the snapshot): its
    own process group, stdin ``/dev/null``, fresh text streams on fds 0-2, an empty
    environment."""
    with contextlib.suppress(OSError):  # the worker may have set it already
        os.setpgid(0, 0)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # the worker's warm-up is not the child's
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", 8192, encoding="utf-8", closefd=False)  # noqa: SIM115 - no tty
    sys.stderr = open(  # noqa: SIM115
        2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False
    )
    os.environ.clear()


def child(job: dict[str, Any], out_fd: int, err_fd: int) -> int:
    """Become the episode's process (pipes, cwd, environment, seed), run it."""
    for fd, target in ((out_fd, 1), (err_fd, 2)):
        os.dup2(fd, target)  # the streams made by prepare_child now write to the pipes
        os.close(fd)
    os.chdir(job.get("cwd") or "/")
    os.environ.update(job.get("env") or {})
    sys.argv = [job["function"]]
    reseed(bytes.fromhex(job.get("seed") or "") or os.urandom(32))
    code = call_entry(job)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code


# -- the worker ---------------------------------------------------------------------------------


def next_job(sock: socket.socket) -> int:
    """A child forked ahead of its job: prepare, wait for the job, say ``{"pid"}``, run it."""
    prepare_child()
    job, fds = recv_msg(sock, max_fds=2)
    if job is None:
        return 0  # the agent is gone
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        send_msg(sock, {"error": "a job needs its stdout and stderr descriptors"})
        return 1
    send_msg(sock, {"pid": os.getpid()})
    sock.close()  # the episode's code never holds the agent's channel
    return child(job, fds[0], fds[1])


def serve(sock: socket.socket, facts: dict[str, Any]) -> None:
    """Fork a child that waits for the next job (in a template it is saved too: a clone forks
    nothing); report each child's exit code. Says ``facts`` (ready) once the first one waits.

    After a child ended, the next is forked only when the agent asks (``{"next"}``, just
    before its job): a VM runs one episode, and forking ahead again would only take CPU from
    the end of that episode (~20% of a trivial one in a fresh clone under TCG).
    """
    while True:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = next_job(sock)
            finally:
                os._exit(code)
        with contextlib.suppress(OSError):  # the child may have done it first
            os.setpgid(pid, pid)
        if facts:
            send_msg(sock, facts)
            facts = {}
        _, status = os.waitpid(pid, 0)
        try:
            send_msg(sock, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})
            request, _ = recv_msg(sock)
        except (OSError, ValueError, EOFError):
            return  # the agent closed the channel
        if request is None:
            return


def rehearse_job() -> dict[str, Any]:
    """An episode's Python paths walked once in the worker (``SIGUSR1``): what ``next_job``,
    ``child`` and ``call_entry`` do, on a socket pair, a pipe and ``/dev/null`` of its own.
    Nothing is written and no module state is touched (``random`` only through an instance)."""
    started = time.monotonic()
    job = {"function": "m:f", "root": "/run", "cwd": "/", "env": {"K": "v"}, "seed": "ab" * 32}
    ours, theirs = socket.socketpair()
    read_end, write_end = os.pipe()
    try:
        send_msg(ours, job, (read_end, write_end))  # a job with its two descriptors
        again, fds = recv_msg(theirs, max_fds=2)
        for fd in fds:
            os.close(fd)
        assert again is not None
        if "random" in sys.modules:
            sys.modules["random"].Random(bytes.fromhex(again["seed"])).random()
        with open(__file__, encoding="utf-8") as f:
            text = f.read(4096)
        with open(os.devnull, "w", encoding="utf-8") as out:
            print(
                again["function"], len(text), json.dumps({"reward": 1.0, "info": again}), file=out
            )
            try:
                raise TypeError(f"{again['function']} returned list, not a dict")
            except TypeError as exc:
                out.write(str(exc))
            out.flush()
    finally:
        for closing in (ours, theirs):
            closing.close()
        os.close(read_end)
        os.close(write_end)
    return {"warmed": True, "ms": round((time.monotonic() - started) * 1000, 1)}


def warm_up(config: dict[str, Any]) -> dict[str, Any]:
    """Put ``path`` on ``sys.path`` and import every module the config names; returns facts."""
    import traceback  # noqa: F401 - what a child needs, imported once (the template keeps it)

    started = time.monotonic()
    sys.path[:0] = [p for p in config.get("path") or [] if p not in sys.path]
    for name in config.get("preimport") or []:
        __import__(name)
    if config.get("function"):
        resolve(config["function"])
    return {"ready": True, "pid": os.getpid(), "import_s": round(time.monotonic() - started, 4)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    sys.modules.pop("worker", None)  # leave the name free for the episode's own modules
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p != here]
    sock = socket.socket(fileno=int(argv[1]))
    try:
        facts = warm_up(json.loads(argv[2]))
    except BaseException:
        import traceback

        send_msg(sock, {"ready": False, "error": traceback.format_exc()})
        return 1
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: send_msg(sock, rehearse_job()))
    serve(sock, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
