"""A spec's ``[[files]]`` are staged for the build sandbox whatever comes first (no VM, no build).

Found by running the README's Gym example: ``examples/gym`` lists one single file
(``gym.json``) and nothing else, and its build failed with ``FileNotFoundError`` on
``stage/files/0``, because only ``copytree`` (a folder source) made the ``files`` folder.
"""

from __future__ import annotations

from pathlib import Path

from cleanroom.baseline.rootfs import _stage_copy


def test_a_single_file_first_is_staged_into_a_folder_not_made_yet(tmp_path: Path) -> None:
    src = tmp_path / "gym.json"
    src.write_text('{"make": []}\n')
    dest = tmp_path / "stage" / "files" / "0"
    _stage_copy(src, dest)
    assert dest.read_text() == '{"make": []}\n'
    assert dest.stat().st_mode & 0o777 == 0o644


def test_a_folder_and_an_executable_file_are_staged_beside_it(tmp_path: Path) -> None:
    folder = tmp_path / "env"
    (folder / "__pycache__").mkdir(parents=True)
    (folder / "run.py").write_text("print(1)\n")
    (folder / "__pycache__" / "run.cpython-311.pyc").write_bytes(b"\0")
    tool = tmp_path / "tool.sh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    stage = tmp_path / "stage" / "files"
    _stage_copy(folder, stage / "0")
    _stage_copy(tool, stage / "1")
    assert (stage / "0" / "run.py").read_text() == "print(1)\n"
    assert not (stage / "0" / "__pycache__").exists()
    assert (stage / "1").stat().st_mode & 0o777 == 0o755
