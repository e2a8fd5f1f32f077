"""``examples/agent-repair``: rollouts as sessions, each judged by a verifier in its own env."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vm
def test_two_rollouts_each_judged_in_a_fresh_env() -> None:
    """Protects (real VMs): the example runs as the README says: each rollout's agent reads,
    tests, patches and retests in its session; the verifier's hidden tests tell a right fix
    (reward 1) from a wrong one that passes the public tests (reward < 1); both complete."""
    proc = subprocess.run(
        [sys.executable, "examples/agent-repair/rollout.py", "--n", "2", "--parallel", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if "reward" in line}
    assert set(rows) == {"repair-0", "repair-1"}, proc.stdout
    assert "average-unsorted" in rows["repair-0"] and "reward 1.000" not in rows["repair-0"]
    assert "index-formula" in rows["repair-1"] and "reward 1.000" in rows["repair-1"]
    assert all("completed" in row for row in rows.values())
    assert all("public 1->0" in row for row in rows.values())  # failing before, passing after
