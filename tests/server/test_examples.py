"""examples/e2b/quickstart.py, E2B's own quick start, run unchanged against ``cleanroom serve``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .kit import Server, new_key, outcome, stored_fake_baseline

ROOT = Path(__file__).resolve().parents[2]


def test_the_e2b_quickstart_runs_unchanged(tmp_path: Path) -> None:
    """Protects: E2B's documented quick start (``Sandbox.create()`` with the default
    template, a command, the ``with`` block's kill) prints its line against a server whose
    ``base`` template is mapped to a baseline; its sandbox ended ``completed``."""
    baseline = stored_fake_baseline(tmp_path)
    srv = Server(["--driver", "fake", "--template", f"base={baseline.digest}"], tmp_path / "log")
    try:
        env = {**os.environ, **srv.sdk_env(new_key())}
        script = ROOT / "examples" / "e2b" / "quickstart.py"
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == "Hello from E2B!\n\n"
    finally:
        assert srv.stop() == 0
    runs = sorted(
        Path(os.environ["CLEANROOM_HOME"], "store", "runs").glob("serve-*"),
        key=lambda p: p.stat().st_mtime,
    )
    assert outcome(runs[-1].name.removeprefix("serve-"), timeout_s=5) == "completed"
