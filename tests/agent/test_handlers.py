"""The agent's command path on the host: real processes, their output relayed as frames by one
poll loop (``relay.py``), deadlines enforced on the whole process group."""

from __future__ import annotations

import io
import os
import time
from typing import Any

import pytest

from cleanroom.agent import guest, relay
from cleanroom.agent.protocol import Frame, Kind, read_frame


def run(argv: list[str], timeout_s: float | None = 10) -> tuple[list[Frame], float]:
    """Run ``argv`` through ``Agent.run_process``; its frames and the seconds it took."""
    stream = io.BytesIO()
    started = time.monotonic()
    guest.Agent(stream).run_process({"argv": argv, "timeout_s": timeout_s})
    elapsed = time.monotonic() - started
    stream.seek(0)
    frames = []
    while stream.tell() < len(stream.getvalue()):
        frames.append(read_frame(stream))
    return frames, elapsed


def output(frames: list[Frame], kind: int) -> bytes:
    return b"".join(f.body for f in frames if f.kind == kind)


def exit_header(frames: list[Frame]) -> dict[str, Any]:
    assert frames[-1].kind == Kind.EXIT, frames
    return frames[-1].header


def test_both_streams_are_relayed_in_order_then_the_exit_code() -> None:
    script = "for i in 1 2 3; do echo out$i; echo err$i >&2; done; exit 3"
    frames, _ = run(["sh", "-c", script])
    assert output(frames, Kind.STDOUT) == b"out1\nout2\nout3\n"
    assert output(frames, Kind.STDERR) == b"err1\nerr2\nerr3\n"
    assert exit_header(frames)["code"] == 3 and exit_header(frames)["timed_out"] is False
    assert [f.kind for f in frames].count(Kind.EXIT) == 1


def test_large_output_arrives_whole_in_bounded_frames() -> None:
    frames, _ = run(["sh", "-c", "head -c 1000000 /dev/zero"])
    chunks = [f.body for f in frames if f.kind == Kind.STDOUT]
    assert sum(map(len, chunks)) == 1_000_000 and max(map(len, chunks)) <= relay.CHUNK


def test_a_process_that_closes_its_output_still_meets_its_deadline() -> None:
    frames, elapsed = run(["sh", "-c", "exec >&- 2>&-; sleep 30"], timeout_s=0.5)
    header = exit_header(frames)
    assert header["timed_out"] is True and header["signal"] == 9
    assert elapsed < 5


def test_at_the_deadline_the_whole_group_is_killed_and_earlier_output_kept() -> None:
    frames, elapsed = run(["sh", "-c", "echo started; sleep 30 & sleep 30"], timeout_s=0.5)
    assert exit_header(frames)["timed_out"] is True and elapsed < 5
    assert output(frames, Kind.STDOUT) == b"started\n"


def test_a_grandchild_holding_the_pipe_does_not_hold_the_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay, "DRAIN_S", 0.3)
    script = "setsid sleep 30 & echo done"  # leaves the group, keeps stdout open
    frames, elapsed = run(["sh", "-c", script])
    assert exit_header(frames)["code"] == 0 and output(frames, Kind.STDOUT) == b"done\n"
    assert elapsed < 10  # waits for the pipes at most the drain time, not for the sleep


def test_a_missing_program_is_exit_127_with_the_reason() -> None:
    frames, _ = run(["/nonexistent/program"])
    assert exit_header(frames)["code"] == 127
    assert b"cannot start" in output(frames, Kind.STDERR)


def test_relay_until_closed_stops_at_its_deadline_and_drain_closes_every_pipe() -> None:
    read_end, write_end = os.pipe()
    sent: list[tuple[int, bytes]] = []
    pipes = relay.Relay(lambda kind, header, data: sent.append((kind, data)), {read_end: 6})
    os.write(write_end, b"partial")
    assert pipes.until_closed(time.monotonic() + 0.2) is False  # the writer is still open
    assert sent == [(6, b"partial")] and read_end in pipes.pipes
    pipes.drain(0.1)
    assert pipes.pipes == {}
    with pytest.raises(OSError):
        os.fstat(read_end)  # closed by the relay
    os.close(write_end)
