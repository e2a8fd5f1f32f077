"""``baseline export`` / ``baseline import``: one file, every hash re-checked, idempotent."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cleanroom.baseline import store
from cleanroom.baseline.cli import baseline_app
from cleanroom.baseline.transfer import export_baseline, import_baseline
from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import BaselineNotFound, DriftError, TransferError

from ..conftest import make_fake_baseline

runner = CliRunner()


@pytest.fixture
def exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Baseline, Path]:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))  # make_fake_baseline uses tmp/baselines
    baseline = make_fake_baseline(tmp_path)
    archive = tmp_path / "tiny.tar"
    export_baseline(baseline.digest, archive)
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "other-host"))
    return baseline, archive


def _rewrite(archive: Path, dest: Path, edit: dict[str, bytes]) -> Path:
    """Copy an archive, replacing the content of some members."""
    with tarfile.open(archive) as src, tarfile.open(dest, "w") as out:
        for member in src:
            data = src.extractfile(member).read()  # type: ignore[union-attr]
            data = edit.get(member.name, data)
            member.size = len(data)
            out.addfile(member, io.BytesIO(data))
    return dest


def test_export_is_deterministic(
    tmp_path: Path, exported: tuple[Baseline, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline, archive = exported
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["baseline.json", "entry.py"]
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))
    again = tmp_path / "again.tar"
    export_baseline(baseline.short, again)
    assert again.read_bytes() == archive.read_bytes()


def test_import_verifies_and_is_idempotent(exported: tuple[Baseline, Path]) -> None:
    baseline, archive = exported
    with pytest.raises(BaselineNotFound):
        store.load(baseline.digest)
    first = import_baseline(archive)
    assert first.baseline.digest == baseline.digest and not first.already_present
    assert store.verify(first.baseline) == []
    store.quick_check(first.baseline)  # import records the mtimes it installed
    second = import_baseline(archive)
    assert second.already_present and second.baseline.digest == baseline.digest
    assert [b.digest for b in store.list_baselines()] == [baseline.digest]


def test_a_changed_component_is_refused_by_name(
    tmp_path: Path, exported: tuple[Baseline, Path]
) -> None:
    _, archive = exported
    bad = _rewrite(archive, tmp_path / "bad.tar", {"entry.py": b"print('evil')\n"})
    with pytest.raises(TransferError, match=r"entry\.py does not match its sha256"):
        import_baseline(bad)
    assert store.list_baselines() == []


def test_a_changed_identity_is_refused(tmp_path: Path, exported: tuple[Baseline, Path]) -> None:
    _, archive = exported
    with tarfile.open(archive) as tar:
        meta = json.loads(tar.extractfile("baseline.json").read())  # type: ignore[union-attr]
    meta["entrypoint"] = ["sh", "-c", "evil"]
    bad = _rewrite(archive, tmp_path / "bad.tar", {"baseline.json": json.dumps(meta).encode()})
    with pytest.raises(TransferError, match=r"baseline\.json does not match its digest"):
        import_baseline(bad)


def test_foreign_entries_are_refused(tmp_path: Path, exported: tuple[Baseline, Path]) -> None:
    _, archive = exported
    bad = tmp_path / "bad.tar"
    with tarfile.open(archive) as src, tarfile.open(bad, "w") as out:
        for member in src:
            out.addfile(member, src.extractfile(member))
        link = tarfile.TarInfo("../escape")
        out.addfile(link, io.BytesIO(b""))
    with pytest.raises(TransferError, match="unexpected entry"):
        import_baseline(bad)
    with pytest.raises(TransferError, match="not a readable"):
        import_baseline(_write(tmp_path / "junk.tar", b"not a tar file" * 100))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_drifted_baseline_is_not_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))
    baseline = make_fake_baseline(tmp_path)
    (baseline.path / "entry.py").write_text("changed\n")
    with pytest.raises(DriftError, match=r"entry\.py"):
        export_baseline(baseline.digest, tmp_path / "x.tar")
    assert not (tmp_path / "x.tar").exists()


def test_cli_export_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))
    baseline = make_fake_baseline(tmp_path)
    archive = tmp_path / "b.tar"
    result = runner.invoke(baseline_app, ["export", baseline.short, str(archive)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == baseline.digest
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "h2"))
    result = runner.invoke(baseline_app, ["import", str(archive)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == baseline.digest
    result = runner.invoke(baseline_app, ["import", str(archive)])
    assert result.exit_code == 0 and "already present" in result.output
    bad = _rewrite(archive, tmp_path / "bad.tar", {"entry.py": b"x"})
    result = runner.invoke(baseline_app, ["import", str(bad)])
    assert result.exit_code == 2 and "entry.py" in result.output
