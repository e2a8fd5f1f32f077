"""A short libFuzzer run over the native agent's frame reader (``make fuzz-native`` runs
1,000,000 inputs). Protects: no input a host or anything on the port can send makes the C
reader crash, leak or hit undefined behaviour (ASan, UBSan). Skips without clang/libFuzzer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz_native.py"


def test_the_frame_reader_survives_a_short_fuzzing_run() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "200000", "--max-time", "45"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if proc.returncode == 77:
        pytest.skip(proc.stderr.strip().splitlines()[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Done" in proc.stderr
