"""What a RUN cut short leaves for the record (``lifecycle.run.staged_output``).

A guest that breaks the protocol mid-stream still ends ``episode_error`` with its evidence: the
logs and the artifact files that arrived, each with its true size and digest, and nothing the
guest could have planted as a link. Its exit is unknown: never a made-up duration or timeout.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cleanroom.agent.connection import ExecResult
from cleanroom.lifecycle.run import staged_output


def _staging(tmp_path: Path) -> Path:
    staging = tmp_path / "staging"
    (staging / "logs").mkdir(parents=True)
    (staging / "artifacts" / "sub").mkdir(parents=True)
    (staging / "logs" / "stdout.log").write_bytes(b"out\n")
    (staging / "artifacts" / "a.txt").write_bytes(b"alpha")
    (staging / "artifacts" / "sub" / "b.bin").write_bytes(b"\x00" * 1000)
    return staging


def test_kept_artifacts_carry_their_true_size_and_digest(tmp_path: Path) -> None:
    """Protects: each kept artifact is recorded with its name, size and sha256 as stored."""
    staging = _staging(tmp_path)
    out = staged_output(staging)
    assert [(a.name, a.size, a.sha256) for a in out.artifacts] == [
        ("a.txt", 5, hashlib.sha256(b"alpha").hexdigest()),
        ("sub/b.bin", 1000, hashlib.sha256(b"\x00" * 1000).hexdigest()),
    ]
    assert out.stdout_path == staging / "logs" / "stdout.log"
    assert out.stderr_path is None  # never written: nothing to keep


def test_links_the_guest_planted_are_not_kept(tmp_path: Path) -> None:
    """Protects: a link in the staging (to a host file) is neither followed nor kept, as an
    artifact or as a log, so no host file can leave as the guest's evidence."""
    staging = _staging(tmp_path)
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"host only")
    os.symlink(secret, staging / "artifacts" / "link.txt")
    os.symlink(secret, staging / "logs" / "stderr.log")
    os.symlink(tmp_path, staging / "artifacts" / "dirlink")
    out = staged_output(staging)
    assert [a.name for a in out.artifacts] == ["a.txt", "sub/b.bin"]
    assert out.stderr_path is None


def test_exit_of_a_cut_short_run_is_unknown(tmp_path: Path) -> None:
    """Protects: the exit of a RUN cut short claims nothing: no exit code or signal, no
    output bytes, no duration, and not a timeout (the outcome comes from how it was cut)."""
    out = staged_output(tmp_path / "missing")
    assert out.exit == ExecResult(None, None, b"", b"", 0.0, False)
    assert out.artifacts == [] and out.stdout_path is None and out.result_raw is None
