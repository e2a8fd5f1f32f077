"""The console of a qemu env (issue 15 §8): kept in a fixed ring, read at a capped rate, its
bytes counted. A guest flooding its serial console is read no faster than the cap (so it costs
the controller a few wakeups a second: ``bench/hostile.py`` measures the CPU), its tail is the
latest output, its count lands in provenance, and it is still destroyed and confirmed absent
while it waits on a full pipe."""

from __future__ import annotations

import asyncio
import time

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.host import hostproc

from ..vmkit import request

FLOOD = "(yes flood-line > /dev/console) </dev/null >/dev/null 2>&1 &"


def test_the_ring_keeps_the_last_bytes_and_counts_all() -> None:
    """Writes of any size (smaller, across the end, larger than the ring) keep exactly the
    last ``size`` bytes in order, and ``total`` counts every byte."""
    ring, written = hostproc.Ring(8), b""
    for piece in (b"abc", b"defgh", b"ij", b"", b"0123456789xyz", b"k"):
        ring.write(piece)
        written += piece
        assert ring.tail() == written[-8:]
        assert ring.total == len(written)
    assert len(ring.buf) == 8  # fixed: never grows


@pytest.mark.vm
async def test_a_flooding_console_is_read_at_the_capped_rate(
    tiny_baseline: Baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a 16 KiB/s cap after a 64 KiB burst, a guest printing as fast as it can is read no
    faster than the cap (before: as fast as it wrote, MiB/s), the tail holds its latest lines,
    provenance counts the bytes, and destroy confirms it absent."""
    monkeypatch.setattr(hostproc, "CONSOLE_RATE", 16 * 1024)
    monkeypatch.setattr(hostproc, "CONSOLE_BURST", 64 * 1024)
    driver = QemuDriver(start="auto")
    env = await driver.create(request(tiny_baseline))
    try:
        live = driver._live[env.env_id]
        (await env.exec(["sh", "-c", FLOOD])).check()
        started, before = time.monotonic(), live.console_bytes
        await asyncio.sleep(2.0)
        read = live.console_bytes - before
        elapsed = time.monotonic() - started
        bound = 64 * 1024 + 16 * 1024 * elapsed + 4096
        assert 0 < read <= bound, (read, bound)
        assert env.info.start_facts()["console_bytes"] == live.console_bytes
        assert b"flood-line\r\nflood-line" in live.console_tail()[-64:]
    finally:
        report = await env.aclose()
    assert report.confirmed_absent
