"""``--baseline`` takes what a newcomer has at hand: a name from ``baseline ls``, a spec folder.

Fake-driver baselines (no build needed) in a store of their own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cleanroom.baseline import store
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.errors import BaselineNotFound
from tests.checks.test_repro import baseline_running
from tests.conftest import make_fake_baseline


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))
    return tmp_path


def test_a_name_from_baseline_ls_resolves_when_one_baseline_has_it(home: Path) -> None:
    """``--baseline fake`` used to be "neither a digest, a digest prefix nor a spec file"."""
    fake = make_fake_baseline(home)
    other = baseline_running(home, "print(1)\n")
    assert store.resolve("fake") == fake and store.resolve("random") == other
    assert resolve_or_build("fake") == fake
    with pytest.raises(BaselineNotFound, match=r"baseline name \(see `cleanroom baseline ls`\)"):
        store.resolve("nameless")


def test_a_name_two_baselines_share_is_refused_with_their_digests(home: Path) -> None:
    first = baseline_running(home, "print(1)\n")
    second = baseline_running(home / "b", "print(2)\n")
    shutil.move(second.path, home / "baselines" / second.path.name)
    with pytest.raises(BaselineNotFound, match="2 stored baselines are named 'random'") as info:
        store.resolve("random")
    assert first.short in str(info.value) and second.short in str(info.value)
    assert store.resolve(first.digest[7:19]) == first  # a prefix still picks one


def test_a_spec_folder_is_its_baseline_toml(home: Path) -> None:
    spec = Path(__file__).resolve().parents[1] / "baselines" / "tiny"
    with pytest.raises(BaselineNotFound, match="has not been built"):
        store.resolve(str(spec))  # read as tiny/baseline.toml (this store never built it)
    with pytest.raises(BaselineNotFound, match=r"holds no baseline\.toml"):
        store.resolve(str(home))
    with pytest.raises(BaselineNotFound, match=r"holds no baseline\.toml"):
        resolve_or_build(str(home))
