"""The native agent's multiplexed requests (``agent/native/mux.c``) as a host process, driven by
the real host side (``AgentConnection``, ``commands``, ``transfers``) over a unix socket.

Each test protects what the host relies on once the HELLO lists "mux": two commands at once
(on the old agent the second waited for the first: "busy"), output streamed in order, stdin of
more than the window, a spawned process killed with its group, a timeout that kills
grandchildren, a user from /etc/passwd and a typed error for an unknown one, streams of more
than the window both ways, a missing file as ``GuestFileNotFound``, and a PTY (tar:
``test_native_tar``). Skips without gcc (the builder needs it too).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pwd
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.agent.test_native_agent import drive, pytestmark  # noqa: F401

from cleanroom.agent import native, protocol
from cleanroom.agent.connection import AgentConnection
from cleanroom.errors import CommandTimeout, GuestFileNotFound, QuotaExceeded, UnknownUser


@pytest.fixture(scope="module")
def agent_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native-mux") / native.BINARY
    subprocess.run(native.gcc_argv(out), cwd=native.NATIVE_DIR, check=True)
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


async def shown(marker: bytes, out: bytearray) -> None:
    """Wait (10 s at most) until a command's output shows ``marker``."""
    for _ in range(1000):
        if marker in out:
            return
        await asyncio.sleep(0.01)


async def gone(pid: int) -> bool:
    for _ in range(200):
        if not alive(pid):
            return True
        await asyncio.sleep(0.02)
    return False


def test_hello_lists_what_mux_c_serves(agent_binary: Path, root: Path) -> None:
    """The host multiplexes only for an agent that says so; tar (tar.c) is claimed, gym not."""

    async def body(session: AgentConnection) -> frozenset[str]:
        return session.features

    features = drive(agent_binary, root, body)
    assert features == {"mux", "stdin", "spawn", "pty", "user", "stream", "tar", "fs", "port"}


def test_commands_run_at_once_stream_and_take_stdin(agent_binary: Path, root: Path) -> None:
    """Two commands at once (the first waits for a file only the second makes), output in
    order before the end, and 5 MiB of stdin (more than the window: ACKs must flow)."""
    flag = root / "flag"

    async def body(session: AgentConnection) -> None:
        waiter = session.exec(["sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.01; done; echo a"])
        toucher = session.exec(["sh", "-c", f"touch {flag}; echo b"])
        first, second = await asyncio.wait_for(asyncio.gather(waiter, toucher), 30)
        assert (first.stdout, second.stdout) == (b"a\n", b"b\n")

        seen: list[bytes] = []
        result = await session.exec(["seq", "1", "30000"], on_stdout=seen.append)
        assert b"".join(seen) == result.stdout
        assert result.stdout.split() == [str(n).encode() for n in range(1, 30001)]

        data = os.urandom(5 << 20)
        result = await session.exec(["sha256sum"], stdin=data)
        assert result.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()

        missing = await session.exec(["no-such-program-here"])
        assert missing.exit_code == 127 and b"cannot start" in missing.stderr

    drive(agent_binary, root, body)


def test_kill_and_timeout_take_the_whole_group(agent_binary: Path, root: Path) -> None:
    """KILL is SIGKILL to the process group (a background grandchild dies too); a timeout
    kills grandchildren and says so."""

    async def body(session: AgentConnection) -> None:
        pids: list[bytes] = []
        script = "sleep 1000 & echo $!; wait"
        process = await session.spawn(["sh", "-c", script], on_stdout=pids.append)
        while not pids:
            await asyncio.sleep(0.01)
        await process.kill()
        assert (await asyncio.wait_for(process.wait(), 10)).signal == 9
        assert await gone(int(b"".join(pids)))

        inner = "sh -c 'sleep 1000 & echo $!; wait'; wait"
        result = await session.exec(["sh", "-c", inner], timeout_s=1)
        assert result.timed_out
        with pytest.raises(CommandTimeout):
            result.check()
        assert await gone(int(result.stdout))

    drive(agent_binary, root, body)


def test_user_comes_from_etc_passwd_and_an_unknown_one_is_typed(
    agent_binary: Path, root: Path
) -> None:
    """``user``: its uid, gid and HOME from /etc/passwd (parsed in C), by name or uid; a user
    that is not there is ``UnknownUser`` and the agent goes on."""
    nobody = pwd.getpwnam("nobody")

    async def body(session: AgentConnection) -> None:
        script = "id -u; id -g; echo $HOME; echo $USER"
        for user in ("nobody", str(nobody.pw_uid)):
            who = await session.exec(["sh", "-c", script], user=user, cwd="/")
            expected = f"{nobody.pw_uid}\n{nobody.pw_gid}\n{nobody.pw_dir}\nnobody\n"
            assert who.stdout == expected.encode(), who
        assert (await session.exec(["id", "-u"])).stdout == b"0\n"
        with pytest.raises(UnknownUser):
            await session.exec(["true"], user="nobody-of-that-name")
        assert (await session.exec(["true"])).ok

    drive(agent_binary, root, body)


def test_streams_both_ways_and_what_is_not_served(agent_binary: Path, root: Path) -> None:
    """8 MiB up and back (twice the window each way), a missing file typed, and a tar stream
    of a folder that is not there typed too (tar itself: ``test_native_tar``)."""
    block = os.urandom(1 << 20)
    path = root / "big.bin"

    async def blocks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield block

    async def body(session: AgentConnection) -> None:
        assert await session.put_stream(str(path), blocks()) == 8 << 20
        back = hashlib.sha256()
        async for chunk in session.get_stream(str(path)):
            back.update(chunk)
        assert back.hexdigest() == hashlib.sha256(block * 8).hexdigest()
        await session.put(str(root / "a" / "small"), b"hello")
        assert await session.get(str(root / "a" / "small")) == b"hello"
        with pytest.raises(GuestFileNotFound):
            await session.get(str(root / "no-such-file"))
        with pytest.raises(GuestFileNotFound):
            async for _ in session.get_tar(str(root / "no-such-folder")):
                pass
        assert (await session.exec(["true"])).ok

    drive(agent_binary, root, body)
    assert path.read_bytes() == block * 8


def test_a_whole_file_get_is_held_to_max_size_at_the_byte(agent_binary: Path, root: Path) -> None:
    """``get`` joins the chunks once at the end (transfers.get_all): a file of exactly
    ``max_size`` bytes over several chunks arrives whole, one byte more is ``QuotaExceeded``
    (the download stopped, the session still usable); uploads of sizes around a chunk's edge
    land byte for byte (the agent reads bodies straight into their frames)."""
    chunk = protocol.CHUNK
    data = os.urandom(3 * chunk + 5)

    async def body(session: AgentConnection) -> None:
        for size in (0, 1, chunk - 1, chunk, chunk + 1, len(data)):
            await session.put(str(root / f"f{size}"), data[:size])
            assert (root / f"f{size}").read_bytes() == data[:size]
        path = str(root / f"f{len(data)}")
        assert await session.get(path, max_size=len(data)) == data
        with pytest.raises(QuotaExceeded):
            await session.get(path, max_size=len(data) - 1)
        assert await session.get(str(root / "f1")) == data[:1]
        assert (await session.exec(["true"])).ok

    drive(agent_binary, root, body)


def test_a_pty_has_its_size_takes_a_resize_and_delivers_ctrl_c(
    agent_binary: Path, root: Path
) -> None:
    """``pty``: one terminal for stdin, stdout and stderr, the controlling terminal of the
    process's session (so ^C written to it is SIGINT to the foreground group), RESIZE sets its
    window (the old agent refused a PTY: ``Unsupported``)."""

    async def body(session: AgentConnection) -> None:
        out = bytearray()
        script = (
            'trap "stty size; echo GOT-INT; exit 3" INT; stty size; while :; do sleep 0.05; done'
        )
        process = await session.spawn(["sh", "-c", script], pty=(24, 80), on_stdout=out.extend)
        await shown(b"24 80", out)
        await process.resize(30, 100)
        await process.write_stdin(b"\x03")
        result = await asyncio.wait_for(process.wait(), 20)
        assert b"GOT-INT" in out and b"30 100" in out and result.exit_code == 3, bytes(out)

        cat = await session.spawn(["cat"], pty=(10, 40), on_stdout=out.extend)
        await cat.write_stdin(b"typed\n")
        await cat.close_stdin()  # ^D on a terminal: cat ends
        assert (await asyncio.wait_for(cat.wait(), 20)).exit_code == 0

    drive(agent_binary, root, body)


DETACHED = """
import fcntl, os, signal, termios, time
signal.signal(signal.SIGHUP, signal.SIG_IGN)
fcntl.ioctl(0, termios.TIOCNOTTY)  # the terminal is nobody's controlling terminal now
signal.signal(signal.SIGINT, lambda *_: (os.write(1, b"GOT-INT\\n"), os._exit(3)))
print("detached", flush=True)
while True:
    time.sleep(0.05)
"""


def test_ctrl_c_reaches_a_command_whose_terminal_signals_nobody(
    agent_binary: Path, root: Path
) -> None:
    """gVisor's case, made on this kernel: the PTY is no session's controlling terminal (the
    command gave it up; under gVisor its line discipline never signals), so a ^C written to
    it reaches nobody unless the agent sends SIGINT to the command's group itself
    (``pty.c``). On the old agent the command never saw the ^C and the wait timed out. The
    agent does not write that ^C: the line discipline, reaching it after the handler had
    written, flushed the handler's output (lost in 7 of 100 rounds on a loaded host), so
    several rounds, each with exactly the handler's output."""

    async def body(session: AgentConnection) -> None:
        for _ in range(8):
            out = bytearray()
            argv = [sys.executable, "-c", DETACHED]
            process = await session.spawn(argv, pty=(24, 80), on_stdout=out.extend)
            await shown(b"detached", out)
            await process.write_stdin(b"\x03")
            result = await asyncio.wait_for(process.wait(), 20)
            assert bytes(out) == b"detached\r\nGOT-INT\r\n" and result.exit_code == 3, bytes(out)

        script = "stty raw -echo; echo ready; head -c 1 | od -An -tx1"
        raw = await session.spawn(["sh", "-c", script], pty=(24, 80), on_stdout=out.extend)
        await shown(b"ready", out)
        await raw.write_stdin(b"\x03")
        assert (await asyncio.wait_for(raw.wait(), 20)).exit_code == 0  # a key, not a signal
        assert b" 03" in out, bytes(out)

    drive(agent_binary, root, body)


def test_a_request_it_cannot_take_is_refused_under_its_own_id(
    agent_binary: Path, tmp_path: Path
) -> None:
    """A new request whose id is not an integer is refused ("unsupported") and a request that
    fails (a folder to DOWNLOAD) fails, each in one FAILED naming the id it came with, and the
    agent serves on: the host matches a FAILED to its request by that id (``mux.c:
    send_failed``, from the reading thread and from a request's own)."""
    sock_path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen(1)
    server.settimeout(10)
    env = {
        "PATH": os.environ["PATH"],
        "CLEANROOM_AGENT_SOCKET": str(sock_path),
        "CLEANROOM_GUEST_ROOT": str(tmp_path / "guest"),
    }
    proc = subprocess.Popen([str(agent_binary)], env=env, start_new_session=True)
    try:
        conn, _ = server.accept()
        conn.settimeout(10)
        stream = conn.makefile("rb")
        assert protocol.read_frame(stream).kind == protocol.Kind.HELLO
        conn.sendall(protocol.encode(protocol.Kind.EXEC, {"id": "x1", "argv": ["true"]}))
        conn.sendall(protocol.encode(protocol.Kind.DOWNLOAD, {"id": 41, "path": "/"}))
        conn.sendall(protocol.encode(protocol.Kind.PING, {}))
        frames = [protocol.read_frame(stream) for _ in range(3)]
    finally:
        proc.kill()
        proc.wait()
        server.close()
    failed = {f.header.get("id"): f.header for f in frames if f.kind == protocol.Kind.FAILED}
    assert failed.keys() == {"x1", 41}, failed
    assert failed["x1"]["code"] == "unsupported" and failed["x1"]["message"]
    assert failed[41]["code"] == "is_a_directory" and "'/'" in failed[41]["message"]
    assert [f.kind for f in frames].count(protocol.Kind.PONG) == 1  # still serving
