"""A process of another user dressed as an env's QEMU (issue 15 §6): the spoofing case."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time

import pytest

from cleanroom.host import hostproc


def spoofer(env_id: str, *extra: str, user: str = "nobody") -> subprocess.Popen[bytes]:
    """``sleep`` named like the env's QEMU (marker, ``qemu-system``, ``extra``), as ``user``."""
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs setpriv (util-linux) and a root controller to start it as another user")
    name = " ".join(["qemu-system-x86_64", "-name", hostproc.marker(env_id), *extra])
    argv = ["bash", "-c", f'exec -a "{name}" sleep 120']
    who = pwd.getpwnam(user)
    if user != "root":
        ids = [f"--reuid={who.pw_uid}", f"--regid={who.pw_gid}", "--clear-groups"]
        argv = ["setpriv", *ids, *argv]
    proc = subprocess.Popen(argv, start_new_session=True)
    for _ in range(1000):  # until the exec -a happened (up to 10 s on a loaded machine)
        # setpriv itself, still root, carries the name in its argv: wait for the drop too
        if (
            proc.pid in hostproc.pids_with_marker(env_id)
            and hostproc.uid_of(proc.pid) == who.pw_uid
        ):
            return proc
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("the spoofing process did not start")
