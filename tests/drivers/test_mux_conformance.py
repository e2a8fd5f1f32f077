"""The shared host-side interface (issue 16) on every driver: ``fake``, ``gvisor`` and ``qemu``
(real VMs, the tiny baseline, the native agent). Concurrent commands on one env, output
streamed in order, stdin, a background process killed with its process group, a timeout that
kills grandchildren, ``user`` (``agent`` is uid 1000 in a baseline), PTY, a 64 MiB stream both
ways, a tar round trip, refused tar members, a missing file as ``GuestFileNotFound``, and a
hostile guest breaking the protocol ends that env only. On the old code the second command of
a pair waited for the first (the test timed out), and stdin, spawn, user, PTY, streams and tar
did not exist. The native agent (agent/native/mux.c, tar.c, pty.c) runs all of it too; before
tar.c it refused tar (``Unsupported``) and the tar round trip here failed for it, and before
pty.c it did not offer a PTY under gVisor (a ^C there reached nobody: the wait hung)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tarfile
from collections.abc import AsyncIterator

import pytest

from cleanroom.drivers.base import Env
from cleanroom.errors import (
    CommandTimeout,
    GuestFileNotFound,
    GuestUnsafePath,
    ProtocolError,
    UnknownUser,
)

from .conftest import Kit

pytestmark = pytest.mark.timeout(400)

STATE = (
    's=$(cut -d\' \' -f3 /proc/{pid}/stat 2>/dev/null); [ -z "$s" ] || [ "$s" = Z ] && echo gone'
)
HOSTILE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
agent = os.getppid()
for fd in os.listdir(f"/proc/{agent}/fd"):
    link = os.readlink(f"/proc/{agent}/fd/{fd}")
    if link.startswith("/dev/vport") or link.startswith("socket:"):
        pidfd = libc.syscall(434, agent, 0)
        stolen = libc.syscall(438, pidfd, int(fd), 0)
        if stolen >= 0:
            header = b'{"id":987654}'
            os.write(stolen, b"CR" + bytes([6]) + len(header).to_bytes(4, "big")
                     + (1).to_bytes(4, "big") + header + b"x")
            sys.exit(0)
sys.exit(7)  # no way into the channel here (a sandbox without pidfd_getfd)
"""


async def gone(env: Env, pid: int) -> bool:
    for _ in range(100):
        probe = await env.exec(["sh", "-c", STATE.format(pid=pid)])
        if probe.stdout == b"gone\n":
            return True
        await asyncio.sleep(0.05)
    return False


async def test_commands(kit: Kit) -> None:
    env = await kit.create()
    flag = f"{kit.scratch}/flag"
    await env.exec(["mkdir", "-p", kit.scratch])

    # two at once: the first waits for a file only the second makes
    waiter = env.exec(["sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.01; done; echo a"])
    first, second = await asyncio.gather(waiter, env.exec(["sh", "-c", f"touch {flag}; echo b"]))
    assert (first.stdout, second.stdout) == (b"a\n", b"b\n")

    # streamed in order, the callback before the end
    seen: list[bytes] = []
    result = await env.exec(["seq", "1", "30000"], on_stdout=seen.append)
    assert b"".join(seen) == result.stdout and result.stdout.split() == [
        str(n).encode() for n in range(1, 30001)
    ]

    # stdin of more than the window
    data = os.urandom(5 << 20)
    result = await env.exec(["sha256sum"], stdin=data)
    assert result.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()

    # background: kill takes the whole group
    pids: list[bytes] = []
    process = await env.spawn(["sh", "-c", "sleep 1000 & echo $!; wait"], on_stdout=pids.append)
    while not pids:
        await asyncio.sleep(0.01)
    await process.kill()
    assert (await process.wait()).signal == 9
    assert await gone(env, int(b"".join(pids)))

    # a timeout kills grandchildren
    result = await env.exec(["sh", "-c", "sh -c 'sleep 1000 & echo $!; wait'; wait"], timeout_s=2)
    assert result.timed_out
    with pytest.raises(CommandTimeout):
        result.check()
    assert await gone(env, int(result.stdout))

    # user: root by default; agent in a baseline; an unknown one is typed
    assert (await env.exec(["id", "-u"])).stdout == b"0\n"
    if kit.name != "fake":  # the fake driver's guest is this host, without that user
        who = await env.exec(["sh", "-c", "id -u; id -g; echo $HOME; pwd"], user="agent")
        assert who.stdout == b"1000\n1000\n/home/agent\n/home/agent\n", who
    with pytest.raises(UnknownUser):
        await env.exec(["true"], user="nobody-of-that-name")

    # a PTY: its size, a resize, ^C to the foreground (under gVisor the agents send the
    # SIGINT themselves: its line discipline signals nobody)
    assert "pty" in env.features
    out = bytearray()
    # the trap before the size: under TCG a ^C sent once the size shows must find it set
    script = 'trap "stty size; echo GOT-INT; exit 3" INT; stty size; while :; do sleep 0.05; done'
    process = await env.spawn(["sh", "-c", script], pty=(24, 80), on_stdout=out.extend)
    for _ in range(1000):
        if b"24 80" in out:
            break
        await asyncio.sleep(0.01)
    await process.resize(30, 100)
    await process.write_stdin(b"\x03")
    result = await process.wait()
    assert b"GOT-INT" in out and b"30 100" in out and result.exit_code == 3, bytes(out)


async def _blocks(block: bytes, count: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield block


async def test_files(kit: Kit) -> None:
    env = await kit.create()
    await env.exec(["mkdir", "-p", kit.scratch])
    block = os.urandom(1 << 20)
    digest = hashlib.sha256(block * 64).hexdigest()
    path = f"{kit.scratch}/big.bin"
    assert await env.put_stream(path, _blocks(block, 64)) == 64 << 20
    inside = await env.exec(["sha256sum", path])
    assert inside.stdout.split()[0].decode() == digest
    back = hashlib.sha256()
    async for chunk in env.get_stream(path):
        back.update(chunk)
    assert back.hexdigest() == digest
    await env.exec(["rm", path])

    # a missing file: typed, and the env goes on
    with pytest.raises(GuestFileNotFound):
        await env.get(f"{kit.scratch}/no-such-file")
    assert (await env.exec(["true"])).ok
    assert "tar" in env.features

    # a folder as tar, and back into another
    src = f"{kit.scratch}/src"
    await env.exec(["sh", "-c", f"mkdir -p {src}/d && echo hi > {src}/d/f && ln -s d/f {src}/l"])
    archive = bytearray()
    async for chunk in env.get_tar(src):
        archive.extend(chunk)
    with tarfile.open(fileobj=io.BytesIO(bytes(archive))) as tar:
        assert sorted(tar.getnames()) == ["d", "d/f", "l"]

    async def one(data: bytes) -> AsyncIterator[bytes]:
        yield data

    await env.put_tar(f"{kit.scratch}/dest", one(bytes(archive)))
    check = await env.exec(
        ["sh", "-c", f"cat {kit.scratch}/dest/d/f; readlink {kit.scratch}/dest/l"]
    )
    assert check.stdout == b"hi\nd/f\n"

    # a member out of the folder is refused; nothing lands outside
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(GuestUnsafePath):
        await env.put_tar(f"{kit.scratch}/box/dest", one(evil.getvalue()))
    assert (await env.exec(["test", "-e", f"{kit.scratch}/box/escaped"])).exit_code == 1


async def test_a_guest_breaking_the_protocol_ends_that_env_only(kit: Kit) -> None:
    """A root process in the guest writes a frame for a request the host never opened into
    the agent's own channel (pidfd_getfd): that env's session breaks, its neighbour's not."""
    hostile, neighbour = await kit.create(), await kit.create()
    await hostile.put(f"{kit.scratch}/hostile.py", HOSTILE.encode())
    try:
        result = await hostile.exec([kit.python, f"{kit.scratch}/hostile.py"])
    except ProtocolError:
        pass
    else:
        assert result.exit_code == 7, result
        pytest.skip(f"{kit.name}: a guest process cannot take the agent's channel here")
    with pytest.raises(ProtocolError):
        await hostile.exec(["true"])
    assert (await neighbour.exec(["true"])).ok
    report = await hostile.aclose()
    assert report.confirmed_absent
