"""``examples/agent-repair``: rollouts as sessions, each judged by a verifier in its own env."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def rollouts(*args: str) -> dict[str, str]:
    """Run the example with ``args``; its printed row per session, by episode id."""
    proc = subprocess.run(
        [sys.executable, "examples/agent-repair/rollout.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {line.split()[0]: line for line in proc.stdout.splitlines() if "reward" in line}


@pytest.mark.vm
def test_two_rollouts_each_judged_in_a_fresh_env() -> None:
    """Protects (real VMs): the example runs as docs/sessions.md says: each rollout's agent reads,
    tests, patches and retests in its session; the verifier's hidden tests tell a right fix
    (reward 1) from a wrong one that passes the public tests (reward < 1); both complete."""
    rows = rollouts("--n", "2", "--parallel", "2")
    assert set(rows) == {"repair-0", "repair-1"}, rows
    assert "average-unsorted" in rows["repair-0"] and "reward 1.000" not in rows["repair-0"]
    assert "index-formula" in rows["repair-1"] and "reward 1.000" in rows["repair-1"]
    assert all("completed" in row for row in rows.values())
    assert all("public 1->0" in row for row in rows.values())  # failing before, passing after


@pytest.mark.vm
def test_a_rollout_branched_four_ways_after_its_first_test_run() -> None:
    """Protects (real VMs, a live fork): ``--branch 4`` runs one rollout that reads the file and
    runs the public tests once, then forks its session 4 ways; each branch's agent writes a
    fix of its own (all four of them), retests and is judged by a verifier, so two branches
    earn 1 and two less; each branch is an episode of the parent's run whose record names the
    parent and the step it branched at (read back with ``cleanroom inspect``); the parent's
    reward is the best branch's."""
    rows = rollouts("--n", "0", "--branch", "4")
    assert set(rows) == {"tree-0", "tree-0.b1", "tree-0.b2", "tree-0.b3", "tree-0.b4"}, rows
    fixes = ["average-unsorted", "index-formula", "sort-and-average", "sort-in-place"]
    for i, fix in enumerate(fixes, 1):
        row = rows[f"tree-0.b{i}"]
        assert fix in row and "public 1->0" in row and "completed" in row, row
    rewards = sorted(float(row.split("reward ")[1].split()[0]) for row in rows.values())
    assert rewards[-3:] == [1.0, 1.0, 1.0] and rewards[0] < 1.0 and rewards[1] < 1.0, rewards
    assert "4 branches" in rows["tree-0"] and "completed" in rows["tree-0"]
    run_id = rows["tree-0.b3"].split("--run-id ")[1].rstrip(")")
    assert all(f"--run-id {run_id})" in row for row in rows.values())  # one run: parent + branches
    inspect = subprocess.run(
        [sys.executable, "-m", "cleanroom", "inspect", "tree-0.b3", "--run-id", run_id],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert inspect.returncode == 0, inspect.stderr[-2000:]
    branch = json.loads(inspect.stdout)["provenance"]["branch"]
    assert branch["parent_episode"] == "tree-0" and branch["step"] == 2, branch
