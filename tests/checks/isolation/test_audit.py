"""The isolation audit counts only processes that are ours (issue 15 §6). Before, any process
whose command line carried an env's marker or a canary token was a leftover and was SIGKILLed
by the (root) controller: another local user could fail ``cleanroom check isolation`` and have
root kill their process. Now a process of another uid, outside our cgroups, is neither counted
nor signalled; one of ours still is both."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from cleanroom.checks.isolation.audit import audit, ours
from cleanroom.drivers.base import new_env_id
from cleanroom.drivers.fake import FakeDriver
from cleanroom.host import hostproc

from ...drivers.spoof import spoofer
from ...waiting import until


async def test_another_users_process_with_a_marker_and_a_token_is_neither_counted_nor_killed(
    tmp_path: Path,
) -> None:
    """A ``nobody`` process named like an env of the check and carrying its canary token, next
    to a root process with the same token: only the root one is a leftover and killed."""
    env_id, token = new_env_id(), f"canary-{new_env_id()}"
    other = spoofer(env_id, token)  # as nobody
    # argv[0] set by Popen itself: no shell whose own command line names the token before exec
    mine = subprocess.Popen([f"sleep {token}", "120"], executable="sleep")
    # Popen returns once exec is past its point of no return, but the kernel fills in the new
    # command line a moment later (seen empty under load): wait for it as an audit would
    cmdline = Path(f"/proc/{mine.pid}/cmdline")
    await until(lambda: token.encode() in cmdline.read_bytes(), "sleep's command line", 10)
    try:
        assert not ours(other.pid) and ours(mine.pid)
        leftovers = await audit(FakeDriver(run_root=tmp_path / "run"), [env_id], [token])
        processes = [x.what for x in leftovers if x.kind == "process"]
        assert len(processes) == 1 and processes[0].startswith(f"pid {mine.pid}:"), leftovers
        assert mine.wait(timeout=5) == -9  # ours: killed
        time.sleep(0.05)
        assert other.poll() is None and hostproc.pid_alive(other.pid)  # theirs: untouched
    finally:
        for proc in (other, mine):
            proc.kill()
            proc.wait()
