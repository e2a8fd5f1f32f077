"""What the guest agent does for the host's requests: PUT, GET, EXEC and RUN (the episode).

``Handlers`` is a mixin of ``guest.Agent`` (which reads frames, keeps one request running at
a time and sends the answers with ``send``). Here live the episode's environment too: the
guest root ``/run/cleanroom`` (manifest, secrets, ``out/`` for artifacts, ``result.json``),
the base environment of every process, and the proxy variables of a networked VM.
Standard library only, like the rest of the agent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

if __package__:  # on the host, as part of the package (a failed import costs ~30 ms in a VM)
    from cleanroom.agent.protocol import CHUNK, RESULT_MAX_BYTES, Kind, dumps
    from cleanroom.agent.relay import Relay
else:  # in the guest, next to protocol.py
    from protocol import CHUNK, RESULT_MAX_BYTES, Kind, dumps  # type: ignore[no-redef,import-not-found]
    from relay import Relay  # type: ignore[import-not-found,no-redef]

NETWORK: dict[str, Any] = {}  # guestnet.setup() at boot: the NIC's address and proxy env, if any
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}


def guest_root() -> str:
    return os.environ.get("CLEANROOM_GUEST_ROOT", "") + "/run/cleanroom"


def prepare_guest_root() -> None:
    """Create /run/cleanroom (the initramfs already mounted /proc, /sys, /run and /dev)."""
    os.makedirs(guest_root() + "/out", exist_ok=True)
    os.makedirs(guest_root() + "/secrets", mode=0o700, exist_ok=True)


class Handlers:
    """The request handlers; the agent provides ``send`` and ``entropy``."""

    entropy: bytes

    def send(self, kind: int, header: dict[str, Any] | None = None, body: bytes = b"") -> None:
        raise NotImplementedError

    def put(self, header: dict[str, Any], body: bytes) -> None:
        """One chunk of a file (``offset`` 0 creates or truncates it); OK with its size so far."""
        path = header["path"]
        offset = int(header.get("offset") or 0)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset == 0 else 0)
        if offset == 0:
            os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        fd = os.open(path, flags, int(header.get("mode", 0o644)))
        try:
            if body:
                os.pwrite(fd, body, offset)
        finally:
            os.close(fd)
        self.send(Kind.OK, {"path": path, "size": offset + len(body)})

    def send_file(self, path: str, name: str, kind: str, limit: int | None = None) -> None:
        """A file as chunks: FILE frames ``{name, offset, eof, kind}`` (``kind`` "result":
        RESULT frames ``{present, offset, eof}``); at most ``limit`` bytes of it."""
        offset = 0
        with open(path, "rb") as f:
            while True:
                size = CHUNK if limit is None else min(CHUNK, limit - offset)
                chunk = f.read(size)
                eof = len(chunk) < CHUNK or offset + len(chunk) == limit
                if kind == "result":
                    self.send(Kind.RESULT, {"present": True, "offset": offset, "eof": eof}, chunk)
                else:
                    header = {"name": name, "offset": offset, "eof": eof, "kind": kind}
                    self.send(Kind.FILE, header, chunk)
                offset += len(chunk)
                if eof:
                    return

    def run_process(self, header: dict[str, Any], req: Any = None) -> None:
        """Run argv, relaying its output; send EXIT. Kills its process group on timeout.

        With ``req`` (a multiplexed ``muxed.Request``) the frames carry its id, STARTED
        comes first, and the header may ask for ``stdin`` (a pipe the request feeds), ``pty``
        ([rows, cols]: one terminal for stdin, stdout and stderr) and ``user`` (run as that
        user: its groups, uid, HOME; an unknown one is ``Failed("unknown_user")``).
        """
        send = self.send if req is None else req.send
        env = {**BASE_ENV, **(NETWORK.get("env") or {})}
        cwd = header.get("cwd")
        ids: dict[str, Any] = {}
        if header.get("user") is not None:
            account = lookup_user(header["user"])
            env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name)
            ids = {
                "user": account.pw_uid,
                "group": account.pw_gid,
                "extra_groups": os.getgrouplist(account.pw_name, account.pw_gid),
            }
            if cwd is None and os.path.isdir(account.pw_dir):
                cwd = account.pw_dir
        env.update(header.get("env") or {})
        started = time.monotonic()
        pty = header.get("pty") if req is not None else None
        wants_stdin = req is not None and (header.get("stdin") or pty)
        ends = Ends(pty, bool(wants_stdin))
        try:
            proc = subprocess.Popen(
                header["argv"],
                cwd=cwd or "/",
                env=env,
                stdin=ends.child_stdin,
                stdout=ends.child_out,
                stderr=ends.child_err,
                start_new_session=True,
                preexec_fn=_take_terminal if pty else None,
                **ids,
            )
        except OSError as exc:
            ends.close_all()
            if req is not None:
                req.send(Kind.STARTED, {"pid": None})
            send(Kind.STDERR, {}, f"cannot start {header['argv']!r}: {exc}\n".encode())
            send(Kind.EXIT, {"code": 127, "signal": None, "duration_s": 0.0, "timed_out": False})
            return
        finally:
            ends.close_child()
        if req is not None:
            req.attach(proc, ends.stdin, pty=ends.master)
            req.send(Kind.STARTED, {"pid": proc.pid})
        output = Relay(send, ends.reads)
        timeout_s = header.get("timeout_s")
        deadline = None if timeout_s is None else started + timeout_s
        timed_out = not output.until_exit(proc, deadline)
        if timed_out:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        output.drain()
        if req is not None:
            req.detach()
        code = proc.returncode
        send(
            Kind.EXIT,
            {
                "code": code if code >= 0 else None,
                "signal": -code if code < 0 else None,
                "duration_s": round(time.monotonic() - started, 6),
                "timed_out": timed_out,
            },
        )

    def run_episode(self, header: dict[str, Any]) -> None:
        """The episode: manifest in, entrypoint run, artifacts and result record out."""
        root = guest_root()
        if not (os.path.isdir(root + "/out") and os.path.isdir(root + "/secrets")):
            prepare_guest_root()  # made at boot; makedirs(exist_ok) would raise and catch
        with open(root + "/manifest.json", "w") as f:
            f.write(dumps(header["manifest"], (", ", ": ")))  # as json.dump writes it
        secret_paths = []
        for name, value in (header.get("secret_files") or {}).items():
            path = f"{root}/secrets/{name}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(value)
            secret_paths.append(path)
            lifetime = (header.get("secret_lifetimes") or {}).get(name)
            if lifetime:
                timer = threading.Timer(float(lifetime), _remove, args=(path,))
                timer.daemon = True
                timer.start()
        env = {"CLEANROOM_DIR": root, **(header.get("env") or {})}
        try:
            if header.get("function"):
                seed = self.entropy + os.urandom(16)  # the host's bytes, and this guest's own
                exit_header = warm_module().run(
                    self, header, {**BASE_ENV, **(NETWORK.get("env") or {}), **env}, seed
                )
                self.send(Kind.EXIT, exit_header)
            else:
                self.run_process(
                    {
                        "argv": header["entrypoint"],
                        "env": env,
                        "cwd": header.get("cwd"),
                        "timeout_s": header.get("timeout_s"),
                    }
                )
        finally:
            for path in secret_paths:  # a secret lives no longer than the entrypoint
                _remove(path)
        for dirpath, dirnames, filenames in os.walk(root + "/out", followlinks=False):
            dirnames.sort()
            for filename in sorted(filenames):
                path = os.path.join(dirpath, filename)
                if os.path.islink(path) or not os.path.isfile(path):
                    continue
                self.send_file(path, os.path.relpath(path, root + "/out"), "artifact")
        result = root + "/result.json"
        if os.path.isfile(result) and not os.path.islink(result):  # enough to say "too large"
            self.send_file(result, "result.json", "result", RESULT_MAX_BYTES + 1)
        else:
            self.send(Kind.RESULT, {"present": False})
        self.send(Kind.DONE)


class Failed(Exception):
    """A request failed in a way the host maps to a typed error (FAILED ``code``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def lookup_user(name: Any) -> Any:
    """The passwd entry of ``name`` (a user name, or a uid as digits)."""
    import pwd

    try:
        if isinstance(name, str) and name.isdigit():
            return pwd.getpwuid(int(name))
        if isinstance(name, str) and name:
            return pwd.getpwnam(name)
    except KeyError:
        pass
    raise Failed("unknown_user", f"no user {name!r} in this guest")


def _take_terminal() -> None:
    """In the child of a PTY command (a new session): make the terminal on fd 0 its own, so
    Ctrl-C and window changes reach its foreground process group."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Ends:
    """The descriptors of one command: the child's (closed in the agent once it started) and
    the agent's (``reads``: fd -> frame kind; ``stdin``: where its input goes, or None)."""

    def __init__(self, pty: Any, stdin: bool) -> None:
        self.master: int | None = None
        self.stdin: int | None = None
        self.child: list[int] = []
        self.child_stdin: Any = subprocess.DEVNULL
        if pty:
            master, slave = os.openpty()
            set_window(master, pty)
            self.master, self.stdin = master, os.dup(master)  # the Relay closes ``master``
            self.child_stdin = self.child_out = self.child_err = slave
            self.child = [slave]
            self.reads = {master: Kind.STDOUT}
            return
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.child_out, self.child_err = out_w, err_w
        self.child = [out_w, err_w]
        self.reads = {out_r: Kind.STDOUT, err_r: Kind.STDERR}
        if stdin:
            in_r, in_w = os.pipe()
            self.child_stdin, self.stdin = in_r, in_w
            self.child.append(in_r)

    def close_child(self) -> None:
        for fd in self.child:
            os.close(fd)
        self.child = []

    def close_all(self) -> None:
        self.close_child()
        for fd in {*self.reads, *([self.stdin] if self.stdin is not None else [])}:
            with contextlib.suppress(OSError):
                os.close(fd)


def set_window(fd: int, size: Any) -> None:
    """A terminal's window size (``[rows, cols]``); its process group gets SIGWINCH."""
    import fcntl
    import struct
    import termios

    rows, cols = (int(n) for n in size)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def warm_module() -> Any:
    """``warm.py``, imported on first use (a command baseline never pays for it)."""
    if "warm" in sys.modules:  # in the guest (a clone: no import machinery to run)
        return sys.modules["warm"]
    if __package__:
        from cleanroom.agent import warm
    else:
        import warm  # type: ignore[import-not-found,no-redef]
    return warm
