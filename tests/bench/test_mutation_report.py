"""bench/mutation_report.py's ``--rerun``: a rerun's result replaces a carried mutant's, per mutant.

Protects the honesty of the committed mutation score: a carried survivor the rerun kills must leave
the survivor list and count killed, one it does not kill must stay survived, and a rerun mutant
the carried report neither lists nor left unrun is refused (it would be counted twice).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "bench" / "mutation_report.py"
KEY = "cleanroom.toy.x_f__mutmut_"


def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_report", TOOL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def carried_report(path: Path, unrun: int) -> Path:
    """An earlier report: src/cleanroom/toy.py with 1 killed, 2 survivors (1 and 2), ``unrun``."""
    survivors = "".join(
        f"{KEY}{n}\n    return 1\n -> return {n + 1}\n    reason: untriaged\n" for n in (1, 2)
    )
    row = f"{'src/cleanroom/toy.py':42}      1        2      0        0       0 {unrun:7}     33%"
    path.write_text(f"{row}\n\nsurviving mutants (2):\n\n{survivors}")
    return path


def rerun_dir(root: Path, codes: dict[str, int | None]) -> Path:
    """A mutants/ folder that ran toy.py's mutants with these exit codes (0 survived, 1 killed)."""
    source = root / "src" / "cleanroom" / "toy.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "".join(f"def x_f__mutmut_{n}():\n    return {n + 1}\n\n" for n in (1, 2, 3))
        + "def x_f__mutmut_orig():\n    return 1\n"
    )
    meta = {"exit_code_by_key": {KEY + n: code for n, code in codes.items()}}
    source.with_name("toy.py.meta").write_text(json.dumps(meta))
    return root


def test_a_rerun_kill_replaces_a_carried_survivor_and_an_unrun_mutant_gets_its_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Survivor 1 killed by the rerun: killed 2 and out of the list; survivor 2 not rerun: kept;
    mutant 3 (unrun before) survives: it leaves 'unrun' and joins the list with its lines."""
    report = carried_report(tmp_path / "old.txt", unrun=1)
    mutants = rerun_dir(tmp_path / "mutants", {"1": 1, "2": None, "3": 0})
    assert tool().cli(["--carry", str(report), "--rerun", str(mutants)]) == 0
    out = capsys.readouterr().out
    toy = next(line for line in out.splitlines() if line.startswith("src/cleanroom/toy.py"))
    assert toy.split()[2:9] == ["2", "2", "0", "0", "0", "0", "50%"]
    assert f"{KEY}1\n" not in out
    assert f"{KEY}2\n    return 1\n -> return 3\n" in out
    assert f"{KEY}3\n    return 1\n -> return 4\n" in out
    assert "rerun mutants (replaces carried results per mutant): 2 mutants of" in out


def test_a_rerun_mutant_neither_carried_survivor_nor_unrun_is_refused(tmp_path: Path) -> None:
    """With nothing left unrun, mutant 3 was killed in the carried run: counting it again is
    refused, not added to the totals."""
    report = carried_report(tmp_path / "old.txt", unrun=0)
    mutants = rerun_dir(tmp_path / "mutants", {"3": 1})
    with pytest.raises(SystemExit, match="x_f__mutmut_3 is neither"):
        tool().cli(["--carry", str(report), "--rerun", str(mutants)])


def test_a_rerun_mutant_that_changes_another_line_does_not_replace_the_carried_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mutant 2 renumbered since the carried run (its rerun changes another line): its kill is
    not the carried survivor's, which stays survived."""
    report = carried_report(tmp_path / "old.txt", unrun=0)
    report.write_text(report.read_text().replace("-> return 3", "-> return 9"))
    mutants = rerun_dir(tmp_path / "mutants", {"2": 1})
    assert tool().cli(["--carry", str(report), "--rerun", str(mutants)]) == 0
    out, err = capsys.readouterr()
    assert f"{KEY}2\n    return 1\n -> return 9\n" in out
    assert "x_f__mutmut_2 changes another line now" in err
