"""A short libFuzzer run over the native agent's frame reader and its tar reader (``make
fuzz-native`` runs 1,000,000 inputs each). Protects: no input a host or anything on the port
can send makes the C readers crash, leak, hang or hit undefined behaviour (ASan, UBSan), and
the tar name checks accept no name or link that leaves the folder. Skips without clang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz_native.py"


def test_the_frame_and_tar_readers_survive_a_short_fuzzing_run() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "200000", "--max-time", "30"],
        capture_output=True,
        text=True,
        check=False,
        timeout=150,
    )
    if proc.returncode == 77:
        pytest.skip(proc.stderr.strip().splitlines()[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("Done") == 2 and "fuzz-native: fuzz_tar" in proc.stderr
