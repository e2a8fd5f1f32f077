"""E2B's JS SDK (npm ``e2b``, run by node), unmodified, against ``cleanroom serve``.

The SDK is installed once with npm from ``tests/server/js/package.json`` (pinned) into
``.cache/e2b-js`` (not committed); node and npm come with ``make setup``'s apt packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from cleanroom.drivers.fake import FakeDriver

from .kit import Server, new_key, outcome, stored_fake_baseline

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "js"
INSTALL = ROOT / ".cache" / "e2b-js"


def _installed() -> Path:
    """The fixture with its node_modules (npm install once, again when package.json changed)."""
    assert shutil.which("node") and shutil.which("npm"), "node and npm are needed (make setup)"
    INSTALL.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "smoke.mjs"):
        shutil.copy(FIXTURE / name, INSTALL / name)
    stamp = INSTALL / ".installed"
    wanted = (FIXTURE / "package.json").read_text()
    if not stamp.exists() or stamp.read_text() != wanted:
        done = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund"],
            cwd=INSTALL,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"npm install failed: {done.stderr}"
        stamp.write_text(wanted)
    return INSTALL


def test_the_js_sdk_creates_runs_moves_files_and_kills(tmp_path: Path) -> None:
    """Protects: the JS SDK's create, commands.run (stdout, stderr, a non-zero exit as
    ``CommandExitError``), files.write / read / list, Sandbox.list and kill work against the
    server; the sandbox's session ended ``completed`` with its env confirmed absent."""
    where = _installed()
    baseline = stored_fake_baseline(tmp_path)
    srv = Server(["--driver", "fake", "--template", f"fake={baseline.digest}"], tmp_path / "log")
    try:
        env = {**os.environ, **srv.sdk_env(new_key("js"))}
        done = subprocess.run(
            ["node", "smoke.mjs", str(tmp_path)],
            cwd=where,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    finally:
        assert srv.stop() == 0
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["stdout"] == "from-js\n" and got["stderr"] == "to-err\n"
    assert got["exitCode"] == 5
    assert got["read"] == "written by js" and "js.txt" in got["names"]
    assert got["listed"] == [got["id"]]
    assert outcome(got["id"], FakeDriver(), timeout_s=5) == "completed"
