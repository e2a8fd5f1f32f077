"""``hostproc.supervised``: the chain every VM (and gVisor sandbox) runs under."""

from __future__ import annotations

import subprocess
from pathlib import Path

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
