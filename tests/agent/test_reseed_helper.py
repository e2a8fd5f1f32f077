"""The native reseed helper (``agent/reseed.c``), compiled as a baseline build compiles it and
driven over a socket pair as a clone's control port: it answers a RESEED with HELLO, and
leaves every other frame - and every RESEED it cannot read - to the agent, byte for byte.
No frame here carries ``time_ns``: as root the helper would set the host's clock."""

from __future__ import annotations

import io
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import pytest

from cleanroom.agent import guest, reseed_helper
from cleanroom.agent.protocol import PREFIX, Frame, Kind, encode, read_frame
from cleanroom.agent.reseed_helper import Prefixed, ReseedHelper
from cleanroom.baseline.rootfs import build_reseed_helper

PREFIX_JSON = '{"agent_version":"9.9","protocol":1,"pid":7'


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> str:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (scripts/setup.sh installs it)")
    dest = tmp_path_factory.mktemp("helper")
    build_reseed_helper(dest)
    return str(dest / "reseed")


class Port:
    """A clone's control port: the guest end (a file, as the agent opens it), the host end."""

    def __init__(self, tmp_path: Path) -> None:
        self.host, guest_end = socket.socketpair()
        self.guest = guest_end.makefile("rwb", buffering=0)
        guest_end.close()
        self.host_reader = cast(BinaryIO, self.host.makefile("rb", buffering=0))
        self.pool_path = tmp_path / "pool"
        self.pool = open(self.pool_path, "wb", buffering=0)  # noqa: SIM115 - closed by close()

    def start(self, helper: str) -> ReseedHelper:
        return ReseedHelper.start(self.guest, self.pool, PREFIX_JSON, helper)

    def close(self) -> None:
        for f in (self.guest, self.host_reader, self.pool, self.host):
            f.close()


@pytest.fixture
def port(tmp_path: Path) -> Iterator[Port]:
    p = Port(tmp_path)
    yield p
    p.close()


def test_a_reseed_is_answered_with_hello_and_handed_to_the_agent(helper: str, port: Port) -> None:
    running = port.start(helper)
    entropy = bytes(range(64))
    # as the host writes it, but no time_ns: a 19-digit integer under another name instead
    reseed = encode(Kind.RESEED, {"clone_id": "env-0a1b", "t": 1795968029892276500}, entropy)
    port.host.sendall(reseed)
    hello = read_frame(port.host_reader)
    assert hello.kind == Kind.HELLO
    h = hello.header
    assert (h["agent_version"], h["protocol"], h["pid"]) == ("9.9", 1, 7)  # the agent's prefix
    assert h["clone_id"] == "env-0a1b" and h["start"] == "snapshot"
    assert h["reseeder"] == "native"
    # a regular file takes the entropy but not the pool's ioctls: the HELLO says so
    assert h["reseeded"] is False and h["reseed_error"] == "OSError: errno 25"
    assert isinstance(h["boot_time_s"], float) and h["boot_time_s"] > 0
    assert isinstance(h["reseed_ms"], float) and "clock_error" not in h
    assert port.pool_path.read_bytes() == entropy
    assert running.outcome() == (b"H", reseed)
    assert running.proc.returncode == 0


@pytest.mark.parametrize(
    ("frame", "consumed"),
    [
        (encode(Kind.PING, {"t": 1}), PREFIX.size),  # not a RESEED: only its prefix is read
        (encode(Kind.RESEED, {"clone_id": "env-1"}, b"e" * 5000), PREFIX.size),  # too large
        (encode(Kind.RESEED, {"time_ns": 1}, b"e"), None),  # no clone id
        (encode(Kind.RESEED, {"clone_id": "../etc"}, b"e"), None),  # not an id
        (encode(Kind.RESEED, {"clone_id": "env-\u00e9"}, b"e"), None),  # an escape
        (encode(Kind.RESEED, {"clone_id": "env-1", "n": 1.5}, b"e"), None),  # a float
        (encode(Kind.RESEED, {"clone_id": "env-1", "n": [1]}, b"e"), None),  # a list
        (encode(Kind.RESEED, {"clone_id": "e", "n": 2**63}, b"e"), None),  # past int64
        (b"XX" + encode(Kind.RESEED, {"clone_id": "env-1"})[2:], PREFIX.size),  # bad magic
    ],
)
def test_anything_else_is_left_to_the_agent_byte_for_byte(
    helper: str, port: Port, frame: bytes, consumed: int | None
) -> None:
    running = port.start(helper)
    port.host.sendall(frame)
    status, data = running.outcome()
    assert status == b"P"
    assert data == frame[: consumed or len(frame)]
    port.host.settimeout(0.2)
    with pytest.raises(TimeoutError):
        port.host.recv(1)  # nothing was answered
    if frame.startswith(b"CR") and len(frame) < 4000:  # the agent reads the very same frame
        rebuilt = read_frame(Prefixed(data, port.guest))  # type: ignore[arg-type]
        original = read_frame(io.BytesIO(frame))
        assert (rebuilt.kind, rebuilt.header, rebuilt.body) == (
            original.kind,
            original.header,
            original.body,
        )


def test_no_helper_or_a_helper_that_refuses_its_arguments_is_an_oserror(
    tmp_path: Path, helper: str, port: Port
) -> None:
    with pytest.raises(FileNotFoundError):
        ReseedHelper.start(port.guest, port.pool, PREFIX_JSON, str(tmp_path / "no"))
    with pytest.raises(OSError, match=r"did not get ready \(exit code 2\)"):
        ReseedHelper.start(port.guest, port.pool, "not json", helper)


def test_the_agent_hands_the_port_to_the_helper_and_takes_it_back(
    helper: str, port: Port, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole agent over the socket pair: SNAPSHOT_PREPARE starts the helper, which answers
    the RESEED; the agent then serves the port again (PING) and knows the clone's entropy."""
    monkeypatch.setattr(reseed_helper, "HELPER", helper)
    monkeypatch.setattr(guest, "prepare_snapshot", lambda: port.pool)
    agent = guest.Agent(port.guest)
    serving = threading.Thread(target=agent.serve, daemon=True)
    serving.start()
    frames: list[Frame] = [read_frame(port.host_reader)]  # HELLO at boot
    port.host.sendall(encode(Kind.SNAPSHOT_PREPARE))
    frames.append(read_frame(port.host_reader))
    assert frames[-1].kind == Kind.OK and frames[-1].header["reseeder"] == "native"
    port.host.sendall(encode(Kind.RESEED, {"clone_id": "env-7"}, b"s" * 64))
    port.host.sendall(encode(Kind.PING, {"t": 3}))
    frames += [read_frame(port.host_reader), read_frame(port.host_reader)]
    port.host.sendall(encode(Kind.SHUTDOWN))
    serving.join(10)
    assert not serving.is_alive()
    hello, pong = frames[2:]
    assert hello.kind == Kind.HELLO and hello.header["reseeder"] == "native"
    assert hello.header["clone_id"] == "env-7"
    assert hello.header["agent_version"] == guest.AGENT_VERSION
    assert pong.kind == Kind.PONG and pong.header == {"t": 3}
    assert agent.entropy == b"s" * 64 and not agent.snapshotted


def test_a_frame_the_helper_leaves_is_served_by_the_agent_which_then_reseeds_itself(
    helper: str, port: Port, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reseed_helper, "HELPER", helper)
    monkeypatch.setattr(guest, "prepare_snapshot", lambda: port.pool)
    seen: list[dict[str, Any]] = []

    def python_reseed(pool: Any, entropy: bytes, header: dict[str, Any]) -> dict[str, Any]:
        seen.append(header)
        return {"reseeder": "python", "clone_id": header["clone_id"]}

    monkeypatch.setattr(guest, "reseed", python_reseed)
    serving = threading.Thread(target=guest.Agent(port.guest).serve, daemon=True)
    serving.start()
    read_frame(port.host_reader)
    port.host.sendall(encode(Kind.SNAPSHOT_PREPARE))
    read_frame(port.host_reader)
    port.host.sendall(encode(Kind.PING, {"t": 4}))
    port.host.sendall(encode(Kind.RESEED, {"clone_id": "env-8"}, b"s" * 64))
    pong, hello = read_frame(port.host_reader), read_frame(port.host_reader)
    port.host.sendall(encode(Kind.SHUTDOWN))
    serving.join(10)
    assert pong.kind == Kind.PONG and pong.header == {"t": 4}
    assert hello.kind == Kind.HELLO and hello.header["reseeder"] == "python"
    assert seen == [{"clone_id": "env-8"}]
