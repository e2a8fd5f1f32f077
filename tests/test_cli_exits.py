"""The exit codes the CLI documents, end to end: 3 when an env outlives its cleanup window (for
``run`` and ``reap``), 130 on Ctrl-C with real VMs (issue 21 §2).

Protects cli.py's exit-3 branches (never checked before) and SIGINT on the qemu driver, spares
included (only the fake driver was tested). A leak is made the way a host makes one: a mount
inside the env's run folder, which no destroy can remove.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.host import hostproc, paths
from cleanroom.ledger import Ledger

from .conftest import make_fake_baseline
from .test_cli import cli, ep, write


def _start(home: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "CLEANROOM_HOME": str(home)}
    return subprocess.Popen(
        [sys.executable, "-m", "cleanroom", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ready_envs(home: Path, run_id: str, count: int, proc: subprocess.Popen[str]) -> list[str]:
    """The ids of ``count`` envs of the run once ready (fails after 120 s or if the CLI ends)."""
    end = time.monotonic() + 120
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        if (home / "ledger.db").exists():
            with Ledger(home / "ledger.db") as ledger:
                ready = [e.env_id for e in ledger.envs(run_id=run_id) if e.ready_at]
            if len(ready) >= count:
                return ready
        time.sleep(0.05)
    raise AssertionError(f"{count} envs of {run_id} never became ready")


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """tmpfs mounts made by a test, unmounted after it (skipped where mount is not allowed)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to pin a folder in place")
    made: list[Path] = []
    yield made
    for path in made:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def pin(folder: Path, mounts: list[Path]) -> None:
    """Make ``folder`` impossible to remove: a tmpfs mounted on a folder inside it."""
    stuck = folder / "stuck"
    stuck.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(stuck)], check=True)
    mounts.append(stuck)


def test_run_exits_3_when_an_env_is_still_there_after_the_cleanup_window(
    tmp_path: Path, mounts: list[Path]
) -> None:
    home = tmp_path
    baseline = make_fake_baseline(home)
    manifests = write(home / "m.jsonl", ep("a", mode="sleep", seconds=2))
    proc = _start(
        home, "run", str(manifests), "--baseline", baseline.digest, "--driver", "fake",
        "--run-id", "leak", "--cleanup-window", "1",
    )  # fmt: skip
    [env_id] = _ready_envs(home, "leak", 1, proc)
    pin(home / "run" / "fake" / env_id, mounts)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "ALERT" in err and "cleanroom reap" in err
    with Ledger(home / "ledger.db") as ledger:
        [env] = ledger.envs(run_id="leak")
    assert env.confirmed_absent_at is None

    reaped = cli(home, "reap", "--driver", "fake")  # the owner is gone now; still pinned
    assert reaped.returncode == 3, reaped.stdout + reaped.stderr
    assert env_id in reaped.stderr and "ALERT" in reaped.stderr
    subprocess.run(["umount", str(mounts.pop())], check=True)
    reaped = cli(home, "reap", "--driver", "fake")
    assert reaped.returncode == 0 and f"reaped {env_id}" in reaped.stdout, reaped.stderr


@pytest.mark.vm
def test_ctrl_c_on_qemu_destroys_every_vm_and_spare_and_exits_130(
    tmp_path: Path, tiny_baseline: Baseline
) -> None:
    home = paths.home()  # the test home: the tiny baseline is built there
    run_id = f"sigint-{os.getpid()}"
    manifests = write(
        tmp_path / "m.jsonl", *[ep(f"s{i}", mode="sleep", seconds=300) for i in range(3)]
    )
    proc = _start(
        home, "run", str(manifests), "--baseline", tiny_baseline.digest, "--driver", "qemu",
        "--run-id", run_id, "--parallel", "2", "--spares", "1", "--store", str(tmp_path / "store"),
    )  # fmt: skip
    ready = _ready_envs(home, run_id, 2, proc)
    end = time.monotonic() + 120
    while not [o for o in _owned_by(proc.pid) if o["labels"].get("spare") == "true"]:
        assert time.monotonic() < end, "no spare VM started"
        time.sleep(0.05)
    every = {o["env_id"] for o in _owned_by(proc.pid)} | set(ready)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    with Ledger(home / "ledger.db") as ledger:
        envs = ledger.envs(run_id=run_id)
        outcomes = sorted(r.outcome for r in ledger.episodes(run_id) if r.outcome)
    assert outcomes == ["cancelled", "cancelled"] and set(ready) <= {e.env_id for e in envs}
    assert all(e.confirmed_absent_at for e in envs)
    assert not [e for e in every if hostproc.pids_with_marker(e)]  # spares included
    assert _owned_by(proc.pid) == []  # no run folder left


def _owned_by(pid: int) -> list[dict[str, Any]]:
    """The owner records of the qemu run folders of a controller process."""
    owners = []
    for path in (paths.run_dir() / "qemu").glob("env-*/owner.json"):
        with contextlib.suppress(OSError, ValueError):
            owner = json.loads(path.read_text())
            if owner.get("pid") == pid:
                owners.append(owner)
    return owners
