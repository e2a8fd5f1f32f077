"""``cleanroom baseline ...`` through typer's test runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cleanroom.baseline.cli import baseline_app
from cleanroom.core.baseline_model import Baseline

from .conftest import TINY_SPEC, clone_baseline

runner = CliRunner()


def test_unknown_refs_and_bad_specs_are_one_line_errors(tmp_path: Path) -> None:
    result = runner.invoke(baseline_app, ["inspect", "abcdef123456"])
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output
    bad = tmp_path / "baseline.toml"
    bad.write_text('name = "x"\n')
    result = runner.invoke(baseline_app, ["build", str(bad)])
    assert result.exit_code == 2
    assert "entrypoint" in result.output and "Traceback" not in result.output


@pytest.mark.build
def test_build_ls_inspect_verify(
    tiny: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = runner.invoke(baseline_app, ["build", str(TINY_SPEC)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == tiny.digest

    result = runner.invoke(baseline_app, ["ls"])
    assert result.exit_code == 0 and tiny.short in result.stdout

    result = runner.invoke(baseline_app, ["inspect", tiny.short])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["digest"] == tiny.digest and data["name"] == "tiny"

    result = runner.invoke(baseline_app, ["verify", tiny.digest])
    assert result.exit_code == 0 and result.stdout.startswith("intact")

    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    folder = clone_baseline(tiny, tmp_path / "home", copy=("initrd.cpio",))
    with (folder / "initrd.cpio").open("r+b") as f:
        f.write(b"X")
    result = runner.invoke(baseline_app, ["verify", tiny.short])
    assert result.exit_code == 1
    assert result.stdout.split() == ["initrd.cpio"]
