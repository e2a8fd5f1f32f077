"""The guest agent's snapshot protocol without a VM: SNAPSHOT_PREPARE, a closed channel that is
waited out, RESEED, and what RESEED does to the kernel pool, ``random`` and the clock."""

from __future__ import annotations

import io
import random
import struct
from typing import Any

import pytest

from cleanroom.agent import guest
from cleanroom.agent.protocol import Frame, Kind, encode, read_frame


class Script:
    """A control port that replays ``items``: bytes to read, or ``None`` for one EOF."""

    def __init__(self, *items: bytes | None) -> None:
        self.items = list(items)
        self.sent = io.BytesIO()

    def read(self, n: int) -> bytes:
        if not self.items:
            return b""
        item = self.items[0]
        if item is None:
            self.items.pop(0)
            return b""
        chunk, rest = item[:n], item[n:]
        if rest:
            self.items[0] = rest
        else:
            self.items.pop(0)
        return chunk

    def write(self, data: memoryview) -> int:
        return self.sent.write(data)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a script has no descriptor")  # so no reseed helper

    def frames(self) -> list[Frame]:
        stream = io.BytesIO(self.sent.getvalue())
        out = []
        while stream.tell() < len(self.sent.getvalue()):
            out.append(read_frame(stream))
        return out


@pytest.fixture
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest, "RECONNECT_POLL_S", 0.0)


def test_after_prepare_a_closed_channel_is_waited_out_until_reseed(
    monkeypatch: pytest.MonkeyPatch, no_sleep: None
) -> None:
    seen: list[tuple[Any, bytes, dict[str, Any]]] = []
    monkeypatch.setattr(guest, "prepare_snapshot", lambda: "pool")

    def fake_reseed(pool: Any, entropy: bytes, header: dict[str, Any]) -> dict[str, Any]:
        seen.append((pool, entropy, header))
        return {"start": "snapshot", "clone_id": header["clone_id"]}

    monkeypatch.setattr(guest, "reseed", fake_reseed)
    port = Script(
        encode(Kind.SNAPSHOT_PREPARE),
        None,  # the template's host is gone: a clone waits for its own
        None,
        encode(Kind.RESEED, {"clone_id": "env-1", "time_ns": 5}, b"e" * 64),
        encode(Kind.PING, {"t": 1}),
        None,  # a clone's host closing the channel ends the agent again
    )
    guest.Agent(port).serve()
    kinds = [f.kind for f in port.frames()]
    assert kinds == [Kind.HELLO, Kind.OK, Kind.HELLO, Kind.PONG]
    assert port.frames()[1].header["reseeder"] == "python"  # no helper outside a baseline
    assert port.frames()[2].header["clone_id"] == "env-1"
    assert port.frames()[2].header["agent_version"] == guest.AGENT_VERSION
    assert seen == [("pool", b"e" * 64, {"clone_id": "env-1", "time_ns": 5})]


def test_prepare_right_after_a_request_waits_for_its_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host sends SNAPSHOT_PREPARE as soon as an EXEC's DONE arrives, which can be before
    the agent's request handler cleared ``busy``: the agent must wait for it, not refuse."""
    import threading
    import time

    monkeypatch.setattr(guest, "prepare_snapshot", lambda: "pool")
    port = Script(encode(Kind.SNAPSHOT_PREPARE), encode(Kind.SHUTDOWN))
    agent = guest.Agent(port)
    agent.busy.set()  # a request that has sent DONE; its handler is about to clear busy
    agent.idle.clear()

    def finish_request() -> None:
        time.sleep(0.2)
        agent.busy.clear()
        agent.idle.set()

    threading.Thread(target=finish_request).start()
    agent.serve()
    frames = port.frames()
    assert [f.kind for f in frames] == [Kind.HELLO, Kind.OK], frames
    assert frames[1].header["prepared"] is True and agent.snapshotted


def test_without_prepare_a_closed_channel_ends_the_agent() -> None:
    port = Script(None, encode(Kind.PING, {"t": 1}))
    guest.Agent(port).serve()
    assert [f.kind for f in port.frames()] == [Kind.HELLO]  # the PING was never read


def test_reseed_feeds_and_credits_the_pool_and_sets_the_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fcntl
    import time

    ioctls: list[tuple[int, bytes | None]] = []
    clock: list[tuple[int, int]] = []
    seeds: list[bytes] = []
    monkeypatch.setattr(fcntl, "ioctl", lambda fd, op, arg=None: ioctls.append((op, arg)))
    monkeypatch.setattr(time, "clock_settime_ns", lambda which, ns: clock.append((which, ns)))
    monkeypatch.setattr(random, "seed", lambda value: seeds.append(value))
    pool = io.BytesIO()
    entropy = bytes(range(64))
    facts = guest.reseed(pool, entropy, {"clone_id": "env-2", "time_ns": 1234})
    assert pool.getvalue() == entropy
    assert ioctls == [
        (guest.RNDADDENTROPY, struct.pack("ii", 512, 64) + entropy),
        (guest.RNDRESEEDCRNG, None),
    ]
    assert clock == [(time.CLOCK_REALTIME, 1234)]
    assert seeds == []  # Python's own state: the agent's adopt_reseed, after the helper too
    assert facts["clone_id"] == "env-2" and facts["reseeded"] is True
    assert facts["reseeder"] == "python"
    assert "boot_id" not in facts  # never read by the agent: the clone's first reader makes it


def test_adopting_a_reseed_reseeds_random_and_makes_the_agent_a_clone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seeds: list[bytes] = []
    monkeypatch.setattr(random, "seed", lambda value: seeds.append(value))
    agent = guest.Agent(Script())
    agent.snapshotted = True
    entropy = bytes(range(64))
    agent.adopt_reseed(entropy)
    assert len(seeds) == 1 and seeds[0].startswith(entropy) and len(seeds[0]) > len(entropy)
    assert agent.entropy == entropy and not agent.snapshotted


def test_prepare_rehearses_reseed_without_crediting_entropy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import fcntl
    import time

    ioctls: list[tuple[int, bytes | None]] = []
    clock: list[tuple[int, int]] = []
    monkeypatch.setattr(fcntl, "ioctl", lambda fd, op, arg=None: ioctls.append((op, arg)))
    monkeypatch.setattr(time, "clock_settime_ns", lambda which, ns: clock.append((which, ns)))
    execs: list[dict[str, Any]] = []
    monkeypatch.setattr(guest.Agent, "run_process", lambda self, header: execs.append(header))
    pool_path = tmp_path / "pool"
    guest.prepare_snapshot(str(pool_path)).close()
    assert [e["argv"] for e in execs] == [["true"]]  # a first EXEC rehearsed as well
    assert len(pool_path.read_bytes()) == 64  # fresh bytes mixed in, as a clone's would be
    (add, add_arg), reseed = ioctls
    assert add == guest.RNDADDENTROPY and add_arg is not None
    assert struct.unpack("ii", add_arg[:8]) == (0, 64)  # but no entropy credited for them
    assert reseed == (guest.RNDRESEEDCRNG, None)
    assert len(clock) == 1 and abs(clock[0][1] - time.time_ns()) < 10**10  # set to itself


def test_the_heartbeat_runs_no_timer_while_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    real_sleep = time.sleep
    beats: list[float] = []

    def sleep(seconds: float) -> None:
        if threading.current_thread().name == "heartbeat":
            beats.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(guest, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(time, "sleep", sleep)
    port = Script()
    agent = guest.Agent(port)
    threading.Thread(target=agent.heartbeat, name="heartbeat", daemon=True).start()
    real_sleep(0.1)
    assert beats == [] and port.frames() == []  # idle: blocked, no wake-ups
    agent.busy.set()
    real_sleep(0.1)
    agent.busy.clear()
    real_sleep(0.05)
    sent = port.frames()
    assert sent and all(f.kind == Kind.HEARTBEAT for f in sent)
    count = len(beats)
    real_sleep(0.1)
    assert len(beats) == count  # idle again: no more timers
