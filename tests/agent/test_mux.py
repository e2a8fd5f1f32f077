"""The multiplexed protocol (issue 16, "the protocol carries it") between the real guest agent (the
native agent as a host process; its commands are host processes) and the real host session. Each
test would fail on the one-request-at-a-time protocol: there a second request waited for the first
(the concurrency tests time out), stdin, spawn, PTY, user, streams and tar did not exist, and a
missing file was a bare ``ProtocolError``. The same API on real VMs: ``tests/vm/test_mux_vm.py``."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cleanroom.agent import protocol
from cleanroom.agent.connection import AgentConnection
from cleanroom.errors import (
    CommandFailed,
    CommandTimeout,
    GuestFileNotFound,
    GuestOperationError,
    GuestUnsafePath,
    UnknownUser,
)

pytestmark = pytest.mark.timeout(60)  # a request that waits for another hangs without mux


@pytest.fixture
def session(agent_session: AgentConnection) -> AgentConnection:
    return agent_session


def gone(pid: int) -> bool:
    """No such process any more (or only its zombie, waiting for a parent's wait)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def wait_gone(pid: int) -> bool:
    for _ in range(500):
        if gone(pid):
            return True
        await asyncio.sleep(0.01)
    return False


MAYBE = {"gym", "bulk"}  # gym: where its files and a Python are beside the agent; bulk: in a VM


async def test_hello_lists_the_features(session: AgentConnection) -> None:
    assert session.hello.get("agent") == "native"
    assert session.mux and set(protocol.FEATURES) - MAYBE <= session.features


async def test_two_commands_run_at_once(session: AgentConnection, tmp_path: Path) -> None:
    """The first waits for a file only the second creates: one at a time, it never ends."""
    flag = tmp_path / "flag"
    waiter = session.exec(["sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.01; done; echo a"])
    maker = session.exec(["sh", "-c", f"touch {flag}; echo b"])
    first, second = await asyncio.gather(waiter, maker)
    assert (first.stdout, second.stdout) == (b"a\n", b"b\n")


async def test_output_streams_while_the_command_runs(
    session: AgentConnection, tmp_path: Path
) -> None:
    """The callback gets "first" before the command ends: it writes the file (another request
    at the same time) that lets the command go on; chunks arrive in order."""
    go = tmp_path / "go"
    seen: list[bytes] = []

    async def on_stdout(chunk: bytes) -> None:
        seen.append(chunk)
        if b"first" in chunk:
            await session.put(str(go), b"")

    script = f"echo first; while [ ! -e {go} ]; do sleep 0.01; done; seq 1 20000"
    result = await session.exec(["sh", "-c", script], on_stdout=on_stdout)
    assert result.ok and b"".join(seen) == result.stdout
    numbers = result.stdout.decode().split()[1:]
    assert numbers == [str(n) for n in range(1, 20001)]


async def test_stdin_of_any_size(session: AgentConnection) -> None:
    """More stdin than the window: flow control, and every byte arrives in order."""
    data = os.urandom(3 * protocol.WINDOW + 123)
    result = await session.exec(["sha256sum"], stdin=data)
    assert result.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


async def test_spawn_write_close_wait(session: AgentConnection) -> None:
    process = await session.spawn(["cat"])
    await process.write_stdin(b"one ")
    await process.write_stdin(b"two")
    await process.close_stdin()
    result = await process.wait()
    assert result.ok and result.stdout == b"one two"
    assert process.pid is not None and process.id > 0


async def test_kill_ends_the_whole_process_group(session: AgentConnection) -> None:
    """A background child of the spawned shell dies with it (SIGKILL to the group)."""
    pids: list[bytes] = []
    process = await session.spawn(["sh", "-c", "sleep 1000 & echo $!; wait"], on_stdout=pids.append)
    while not pids:
        await asyncio.sleep(0.01)
    await process.kill()
    result = await process.wait()
    assert result.signal == 9 and not result.ok
    assert await wait_gone(int(b"".join(pids)))


async def test_a_timeout_kills_grandchildren(session: AgentConnection) -> None:
    result = await session.exec(
        ["sh", "-c", "sh -c 'sleep 1000 & echo $!; wait' ; sleep 1000"], timeout_s=1
    )
    assert result.timed_out
    with pytest.raises(CommandTimeout):
        result.check()
    assert await wait_gone(int(result.stdout))


async def test_failed_command_is_command_failed(session: AgentConnection) -> None:
    with pytest.raises(CommandFailed) as raised:
        (await session.exec(["sh", "-c", "exit 3"])).check()
    assert not isinstance(raised.value, CommandTimeout)
    assert isinstance(raised.value, GuestOperationError)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
async def test_user_drops_to_that_user(session: AgentConnection) -> None:
    result = await session.exec(["sh", "-c", "id -u; id -G; echo $HOME"], user="nobody")
    uid, groups, home = result.stdout.decode().split("\n")[:3]
    assert uid == "65534" and "0" not in groups.split() and home
    assert (await session.exec(["id", "-u"])).stdout == b"0\n"  # user=None: root


async def test_an_unknown_user_is_a_typed_error(session: AgentConnection) -> None:
    with pytest.raises(UnknownUser):
        await session.exec(["true"], user="no-such-user-here")
    assert (await session.exec(["true"])).ok  # the env is fine


async def test_pty_size_resize_and_ctrl_c(session: AgentConnection) -> None:
    """A PTY process sees its window size, a resize, and ^C as SIGINT to its foreground."""
    out = bytearray()
    # the trap before the size: under TCG a ^C sent once the size shows must find it set
    script = 'trap "stty size; echo GOT-INT; exit 3" INT; stty size; while :; do sleep 0.05; done'
    process = await session.spawn(["sh", "-c", script], pty=(24, 80), on_stdout=out.extend)
    while b"24 80" not in out:
        await asyncio.sleep(0.01)
    await process.resize(30, 100)
    await process.write_stdin(b"\x03")
    result = await process.wait()
    assert b"GOT-INT" in out and b"30 100" in out and result.exit_code == 3


async def test_a_64_mib_stream_both_ways(session: AgentConnection, tmp_path: Path) -> None:
    block = os.urandom(1 << 20)
    digest = hashlib.sha256(block * 64).hexdigest()

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield block

    path = str(tmp_path / "big.bin")
    assert await session.put_stream(path, chunks()) == 64 << 20
    back = hashlib.sha256()
    async for chunk in session.get_stream(path):
        back.update(chunk)
    assert back.hexdigest() == digest == hashlib.sha256(Path(path).read_bytes()).hexdigest()


async def test_leaving_a_stream_early_stops_it_and_the_env_goes_on(
    session: AgentConnection, tmp_path: Path
) -> None:
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(8 * protocol.WINDOW))
    stream = session.get_stream(str(path))
    async for _ in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]
    assert (await session.exec(["true"])).ok
    assert await session.get(str(path)) == path.read_bytes()


async def test_a_missing_file_is_guest_file_not_found(session: AgentConnection) -> None:
    with pytest.raises(GuestFileNotFound):
        await session.get("/no/such/file")
    with pytest.raises(GuestFileNotFound):
        async for _ in session.get_stream("/no/such/file"):
            pass
    assert (await session.exec(["true"])).ok


def make_tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


async def one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_tar_round_trip(session: AgentConnection, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"alpha")
    (src / "sub" / "deeper" / "b.bin").write_bytes(os.urandom(protocol.WINDOW + 5))
    (src / "sub" / "link").symlink_to("deeper/b.bin")
    archive = bytearray()
    async for chunk in session.get_tar(str(src)):
        archive.extend(chunk)
    dest = tmp_path / "dest"
    await session.put_tar(str(dest), one(bytes(archive)))
    for rel in ("a.txt", "sub/deeper/b.bin"):
        assert (dest / rel).read_bytes() == (src / rel).read_bytes()
    assert os.readlink(dest / "sub" / "link") == "deeper/b.bin"


def hostile_member(case: str, outside: Path) -> tarfile.TarInfo:
    info = tarfile.TarInfo({"dotdot": "../escaped", "absolute": "/tmp/absolute-escape",
                            "inner-dotdot": "ok/../../escaped", "through-a-link": "l/escaped",
                            "device": "dev", "link-outside": "out",
                            "absolute-link": "abs"}[case])  # fmt: skip
    if case == "device":
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    elif case == "link-outside":
        info.type, info.linkname = tarfile.SYMTYPE, "../../etc/passwd"
    elif case == "absolute-link":
        info.type, info.linkname = tarfile.SYMTYPE, str(outside)
    return info


@pytest.mark.parametrize(
    "case",
    ["dotdot", "absolute", "inner-dotdot", "through-a-link", "device", "link-outside",
     "absolute-link"],
)  # fmt: skip
async def test_tar_members_that_escape_are_refused(
    session: AgentConnection, tmp_path: Path, case: str
) -> None:
    """Nothing lands outside the folder, not even through a link already inside it (made by
    an earlier command, say); no device node, no link pointing out."""
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "box" / "dest"
    dest.mkdir(parents=True)
    (dest / "l").symlink_to(outside)
    with pytest.raises(GuestUnsafePath):
        await session.put_tar(str(dest), one(make_tar([(hostile_member(case, outside), b"x")])))
    assert not (tmp_path / "box" / "escaped").exists() and not list(outside.iterdir())
    assert not Path("/tmp/absolute-escape").exists()
    assert not (dest / "dev").exists() and not (dest / "out").exists()
    assert not (dest / "abs").exists()
    assert (await session.exec(["true"])).ok
