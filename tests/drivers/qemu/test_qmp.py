"""The QMP client against a scripted QMP server (no QEMU): greeting, commands, errors, events,
a passed file descriptor, bounded waits, and scripts written before any answer is read."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.drivers import qmp as qmp_mod
from cleanroom.drivers.qmp import QmpClient
from cleanroom.errors import DriverError


class FakeQmp(threading.Thread):
    """Answers like QEMU's monitor; records every command and every fd it was handed."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.commands: list[dict[str, Any]] = []
        self.fd_contents: list[bytes] = []

    def run(self) -> None:
        conn, _ = self.listener.accept()
        conn.sendall(b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\n')
        buffer = b""
        while True:
            data, fds, _, _ = socket.recv_fds(conn, 65536, 4)
            if not data:
                return
            for fd in fds:
                self.fd_contents.append(os.read(fd, 100))
                os.close(fd)
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                conn.sendall(self.answer(json.loads(line)))

    def answer(self, request: dict[str, Any]) -> bytes:
        self.commands.append(request)
        name, ident = request["execute"], request.get("id")
        if name == "slow":
            return b""  # never answered
        if name == "refuse":
            reply: dict[str, Any] = {"error": {"class": "GenericError", "desc": "no way"}}
        elif name == "migrate-incoming":
            event = {"event": "MIGRATION", "data": {"status": "completed"}, "timestamp": {}}
            answer = {"return": {}, "id": ident}
            return f"{json.dumps(event)}\n{json.dumps(answer)}\n".encode()
        else:
            reply = {"return": {"status": "running"} if name == "query-status" else {}}
        reply["id"] = ident
        return json.dumps(reply).encode() + b"\n"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[FakeQmp, Path]]:
    path = tmp_path / "qmp.sock"
    fake = FakeQmp(path)
    fake.start()
    yield fake, path
    fake.listener.close()


async def test_greeting_commands_errors_and_events(server: tuple[FakeQmp, Path]) -> None:
    fake, path = server
    async with await QmpClient.connect(path, timeout_s=5) as qmp:
        assert qmp.greeting["version"]["qemu"]["major"] == 7
        assert await qmp.execute("query-status") == {"status": "running"}
        with pytest.raises(DriverError, match="refuse refused: no way"):
            await qmp.execute("refuse")
        await qmp.execute("migrate-incoming", {"uri": "fd:3"})
        event = await qmp.wait_event("MIGRATION", 1.0, lambda d: d["status"] == "completed")
        assert event["data"]["status"] == "completed"
        with pytest.raises(DriverError, match="no QMP event RESUME"):
            await qmp.wait_event("RESUME", 0.05)
        with pytest.raises(DriverError, match="no answer within"):
            await qmp.execute("slow", timeout_s=0.05)
    assert [c["execute"] for c in fake.commands][:2] == ["qmp_capabilities", "query-status"]
    assert fake.commands[3]["arguments"] == {"uri": "fd:3"}


async def test_send_fd_passes_a_descriptor(server: tuple[FakeQmp, Path], tmp_path: Path) -> None:
    fake, path = server
    payload = tmp_path / "state"
    payload.write_bytes(b"device state")
    async with await QmpClient.connect(path, timeout_s=5) as qmp:
        with payload.open("rb") as f:
            await qmp.send_fd("template-state", f.fileno())
    assert fake.fd_contents == [b"device state"]
    assert fake.commands[-1]["arguments"] == {"fdname": "template-state"}


async def test_connect_gives_up_on_a_missing_socket(tmp_path: Path) -> None:
    with pytest.raises(DriverError, match="not ready within"):
        await QmpClient.connect(tmp_path / "absent.sock", timeout_s=0.05)


async def test_a_closed_channel_fails_pending_and_later_commands(tmp_path: Path) -> None:
    path = tmp_path / "qmp.sock"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'{"QMP": {"version": {}, "capabilities": []}}\n')
        line = await reader.readline()
        writer.write(json.dumps({"return": {}, "id": json.loads(line)["id"]}).encode() + b"\n")
        await reader.readline()
        writer.close()  # QEMU went away mid-command

    server = await asyncio.start_unix_server(serve, str(path))
    async with server:
        qmp = await QmpClient.connect(path, timeout_s=5)
        with pytest.raises(DriverError, match="channel"):
            await qmp.execute("stop", timeout_s=2)
        with pytest.raises(DriverError, match="channel ended"):
            await qmp.execute("cont", timeout_s=2)
        await qmp.aclose()
        await qmp.aclose()  # idempotent


async def test_a_script_is_written_at_once_and_answered_in_order(
    server: tuple[FakeQmp, Path],
) -> None:
    fake, path = server
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    sock.sendall(qmp_mod.script(("query-status", None), ("migrate-incoming", {"uri": "fd:3"})))
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    await qmp_mod.read_answers(reader, ("query-status", "migrate-incoming"))  # event skipped
    writer.close()
    assert [c["execute"] for c in fake.commands] == [
        "qmp_capabilities",
        "query-status",
        "migrate-incoming",
    ]
    assert fake.commands[2]["arguments"] == {"uri": "fd:3"}


async def test_a_refused_script_command_is_named(server: tuple[FakeQmp, Path]) -> None:
    _, path = server
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    sock.sendall(qmp_mod.script(("query-status", None), ("refuse", None)))
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    with pytest.raises(DriverError, match="QMP refuse refused: no way"):
        await qmp_mod.read_answers(reader, ("query-status", "refuse"))
    writer.close()


async def test_a_monitor_closing_before_every_answer_is_an_error() -> None:
    ours, qemus = socket.socketpair()
    qemus.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\n{"return": {}}\n')
    qemus.close()  # answered qmp_capabilities, then QEMU went away
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    with pytest.raises(DriverError, match="closed"):
        await qmp_mod.read_answers(reader, ("migrate-incoming",))
    writer.close()
