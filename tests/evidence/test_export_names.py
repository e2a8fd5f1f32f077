"""A secret in an artifact's folder name: ``export.redact_output`` moves the file, whole.

The redacted name may need folders that do not exist yet at any depth below the artifact root
(the secret spelled a folder with more folders under it); the file must arrive there with its
content redacted, and nothing spelling the secret may stay in the staging.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cleanroom.agent.connection import Artifact, EpisodeOutput, ExecResult
from cleanroom.evidence.export import redact_output
from cleanroom.evidence.secrets import Redactor

SECRET = "tok_FolderNameSecret9"


def test_a_secret_folder_with_folders_below_it_is_renamed_whole(tmp_path: Path) -> None:
    """Protects: an artifact at ``a/<secret>/b/c/file`` moves to ``a/[REDACTED:TOK]/b/c/file``
    (every missing folder made), its content redacted, its size and digest those of the moved
    file, and no path in the staging still spells the secret."""
    root = tmp_path / "artifacts"
    name = f"a/{SECRET}/b/c/file.txt"
    src = root / name
    src.parent.mkdir(parents=True)
    src.write_bytes(f"value={SECRET}\n".encode())
    output = EpisodeOutput(exit=ExecResult(0, None, b"", b"", 0.0, False))
    output.artifacts = [Artifact(name, src.stat().st_size, "", src)]
    redact_output(output, {}, Redactor({"TOK": SECRET}))
    [moved] = output.artifacts
    assert moved.name == "a/[REDACTED:TOK]/b/c/file.txt"
    assert moved.path == root / moved.name
    data = moved.path.read_bytes()
    assert data == b"value=[REDACTED:TOK]\n"
    assert (moved.size, moved.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert not [p for p in tmp_path.rglob("*") if SECRET in str(p)]
