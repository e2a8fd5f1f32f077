"""A session seen by the command line like any episode: ``ps`` while it is open, then
``status``, ``report --json`` and ``inspect`` (the fake driver, the home's ledger and store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..test_cli import cli

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
home = os.environ["CLEANROOM_HOME"]
from tests.conftest import make_fake_baseline  # it points CLEANROOM_HOME at the test home
os.environ["CLEANROOM_HOME"] = home
import cleanroom as cr
with cr.Session(make_fake_baseline(Path(sys.argv[1]) / "b"), driver="fake", run_id="seen",
                task={"repo": "r"}) as sb:
    sb.commands.run("echo hello")
    print(sb.episode.env_id, flush=True)
    sys.stdin.readline()
    sb.finish(reward=0.5, info={"tries": 1})
print("closed", flush=True)
"""


def test_status_ps_report_and_inspect_show_a_session(tmp_path: Path) -> None:
    """Protects: a session is an episode of a run for every observer: ``ps`` lists its env
    with its run and episode while it is open (not "(not in ledger)"), ``status`` and
    ``report --json`` show its outcome and reward, ``inspect`` prints its record (with the
    transcript among its logs)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    env = {**os.environ, "CLEANROOM_HOME": str(home)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), str(REPO)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        env_id = holder.stdout.readline().strip()
        assert env_id.startswith("env-"), env_id
        ps = cli(home, "ps", "--driver", "fake")
        assert ps.returncode == 0, ps.stderr
        [line] = [row for row in ps.stdout.splitlines() if env_id in row]
        assert "seen" in line and "session" in line and "not in ledger" not in line
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "closed"
    finally:
        holder.wait(timeout=60)
    status = cli(home, "status", "seen")
    assert status.returncode == 0, status.stderr
    assert "completed" in status.stdout and "session" in status.stdout
    report = cli(home, "report", "seen", "--json", str(tmp_path / "r.json"))
    assert report.returncode == 0, report.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert "session" in json.dumps(data) and "completed" in json.dumps(data)
    inspect = cli(home, "inspect", "session", "--run-id", "seen")
    assert inspect.returncode == 0, inspect.stderr
    record = json.loads(inspect.stdout)
    assert record["outcome"] == "completed" and record["reward"] == 0.5
    assert "transcript.jsonl" in {log["name"] for log in record["logs"]}
