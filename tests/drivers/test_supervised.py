"""``hostproc.supervised``: the chain every VM (and gVisor sandbox) runs under."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cleanroom.host import hostproc


def test_the_chain_starts_only_while_its_parent_is_the_one_that_forked_it(tmp_path: Path) -> None:
    """Protects the window between the fork and ``setpriv``'s parent-death signal: a chain whose
    parent is no longer the process that forked it (it died meanwhile: the child was reparented)
    must start nothing, or it would outlive its controller until its hard deadline. Its own
    parent given: the command runs."""
    ran, refused = tmp_path / "ran", tmp_path / "refused"
    ok = subprocess.run(hostproc.supervised(["touch", str(ran)], 30), timeout=30)
    assert ok.returncode == 0 and ran.exists()
    gone = subprocess.run(hostproc.supervised(["touch", str(refused)], 30, parent=1), timeout=30)
    assert gone.returncode != 0 and not refused.exists()


def _jailed_sleeper() -> tuple[subprocess.Popen[bytes], int]:
    """A jailed chain (as a jailed QEMU runs) whose command drops to uid 65534 itself, as
    QEMU's ``-runas`` does (the credential change clears its parent-death signal); the chain's
    process and the sleeper's pid once it runs as 65534."""
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    argv += ["sleep", "300"]  # found among this chain's descendants
    proc = subprocess.Popen(hostproc.supervised(argv, 120, jailed=True), start_new_session=True)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for pid in hostproc.descendants(proc.pid):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes() if hostproc.pid_alive(pid) else b""
            if cmd.startswith(b"sleep\0") and hostproc.uid_of(pid) == 65534:
                return proc, pid
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the jailed sleeper never ran as uid 65534")


def _gone_within(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while hostproc.pid_alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(os.geteuid() != 0, reason="a jail needs root")
@pytest.mark.parametrize("victim", ["timeout", "chain"])
def test_a_jailed_child_dies_whichever_supervisor_is_killed(victim: str) -> None:
    """Protects issue 36's leak: Ray's worker exit SIGKILLed a spare's supervisor and the
    jailed QEMU (its parent-death signal cleared by ``-runas``) lived on under init past its
    deadline. Here the uid-changed child must die at once when ``timeout`` (the deadline
    keeper) or the chain's first process (what a parent killing its children hits) is
    SIGKILLed, long before its 120 s deadline."""
    proc, sleeper = _jailed_sleeper()
    try:
        if victim == "timeout":
            [keeper] = [
                p
                for p in hostproc.descendants(proc.pid)
                if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"timeout\0")
            ]
            os.kill(keeper, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        assert _gone_within(sleeper, 10), f"the jailed child outlived its {victim}"
    finally:
        hostproc.kill_pids([sleeper], signal.SIGKILL)
        proc.kill()
        proc.wait(10)
