"""A served sandbox's resource use through the real SDK's ``get_metrics`` (fake driver: the
env's processes are host processes in its cgroup)."""

from __future__ import annotations

import datetime as dt

import pytest
from e2b import Sandbox
from e2b.exceptions import NotFoundException

from .kit import new_key


def test_get_metrics_measures_the_envs_processes(key: str) -> None:
    """Protects: each call takes a sample of the env's own processes (CPU used since the last
    sample, RSS, its run folder on disk) and keeps it; ``start`` filters; another key's
    sandbox is not found."""
    sbx = Sandbox.create("fake")
    try:
        first = sbx.get_metrics()
        assert len(first) == 1
        m = first[0]
        assert m.cpu_count == 1 and m.mem_total == 256 * 1024 * 1024
        assert m.mem_used > 1024 * 1024  # the agent's RSS at least
        assert 0 <= m.disk_used <= m.disk_total and m.disk_total > 0
        burn = "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done"
        sbx.commands.run(burn)  # CPU time, whatever the host's load
        both = sbx.get_metrics()
        assert len(both) == 2 and both[0].timestamp == m.timestamp
        assert both[1].cpu_used_pct > 0.0
        later = sbx.get_metrics(start=both[1].timestamp + dt.timedelta(seconds=1))
        assert all(x.timestamp > both[1].timestamp for x in later)
        with pytest.raises(NotFoundException):
            Sandbox.get_metrics(sbx.sandbox_id, api_key=new_key())
    finally:
        sbx.kill()
