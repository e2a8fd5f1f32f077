"""Every Python example in the README and on the docs site runs as written (issues 14 §3, 34).

The README and every page under ``docs/`` are read. A block opens with ```` ```python runnable ````
(runs in every suite run: no VM) or ```` ```python runnable vm ```` (boots real VMs: marked
``vm``, skipped without QEMU). Each runs as its own ``python -c`` from the repository root, so
relative paths like ``examples/cartpole`` mean what they mean to a reader, in a home of its own
that shares the test home's baselines, download cache and templates. A Python block with
neither marker fails the suite: an example nobody runs is an example that rots. A block that
appears verbatim in two places (the README's tour repeats a page's example) runs once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHARED = ("baselines", "cache", "templates")


def pages() -> list[Path]:
    """The README, then every Markdown page of the docs site, in a fixed order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def blocks() -> list[tuple[str, str, str]]:
    """(place, tags, code) of each ```python block of the README and the docs (place: file:line)."""
    found = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            place = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            found.append((place, m.group(1).strip(), m.group(2)))
    return found


def test_every_python_block_is_marked_runnable() -> None:
    unmarked = [place for place, tags, _ in blocks() if not tags.startswith("runnable")]
    assert unmarked == [], f"{unmarked}: mark them ```python runnable [vm]"
    assert len([place for place, _, _ in blocks() if place.startswith("README.md")]) >= 3
    assert len(blocks()) >= 8


def _home(tmp_path: Path) -> Path:
    """A fresh home over the test home's built baselines, downloads and templates."""
    home = tmp_path / "home"
    home.mkdir()
    test_home = Path(os.environ["CLEANROOM_HOME"])
    for name in SHARED:
        (test_home / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(test_home / name)
    if (test_home / "accel-probe.json").is_file():
        shutil.copy(test_home / "accel-probe.json", home)
    return home


def _run(code: str, tmp_path: Path) -> None:
    env = {**os.environ, "CLEANROOM_HOME": str(_home(tmp_path)), "CI": "true"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _params(vm: bool) -> list[object]:
    """One test per distinct block (a block repeated verbatim elsewhere runs once)."""
    seen: dict[str, str] = {}
    for place, tags, code in blocks():
        if tags.startswith("runnable") and ("vm" in tags.split()) == vm:
            seen.setdefault(code, place)
    return [pytest.param(code, id=place) for code, place in seen.items()]


@pytest.mark.parametrize("code", _params(vm=False))
def test_a_readme_block_runs(code: str, tmp_path: Path) -> None:
    _run(code, tmp_path)


@pytest.mark.vm
@pytest.mark.parametrize("code", _params(vm=True))
def test_a_readme_block_runs_on_real_vms(code: str, tmp_path: Path) -> None:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (run `make setup`)")
    _run(code, tmp_path)
