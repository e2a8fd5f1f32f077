"""Template files on disk (no VM): sealed read-only with their sha256, found again by key,
and a modified file is refused by name."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers import snapshot
from cleanroom.errors import DriftError


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def built(key: str = "k" * 32) -> snapshot.Template:
    work = snapshot.build_dir(key)
    (work / snapshot.RAM_FILE).write_bytes(b"\0" * 4096 + b"guest ram" + b"\0" * 4096)
    (work / snapshot.STATE_FILE).write_bytes(b"device state")
    return snapshot.seal(work, key, 1, {"baseline": "sha256:x"})


def test_sealed_template_is_read_only_and_listed_by_sha256(home: Path) -> None:
    template = built()
    assert template.path == home / "templates" / template.key
    meta = json.loads((template.path / snapshot.META_FILE).read_text())
    assert set(meta["files"]) == {"ram", "state"}
    assert meta["files"]["state"]["size"] == len(b"device state")
    assert meta["digest"] == template.digest and template.digest.startswith("sha256:")
    for name in ("ram", "state", snapshot.META_FILE):
        assert stat.S_IMODE((template.path / name).stat().st_mode) == 0o444, name
    assert snapshot.load(template.key) == template
    assert snapshot.load("0" * 32) is None
    assert not list((home / "templates").glob(".build-*"))  # the scratch folder became the key


@pytest.mark.parametrize("name", ["ram", "state"])
def test_a_modified_file_is_refused_by_name(name: str) -> None:
    template = built()
    path = template.path / name
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the hash can tell
    path.write_bytes(bytes(data))
    with pytest.raises(DriftError) as caught:
        snapshot.load(template.key)
    assert caught.value.drifted == [name]
    snapshot.discard(template.key)
    assert snapshot.load(template.key) is None  # gone: the driver rebuilds it


def test_a_touched_but_intact_file_is_rehashed_and_accepted() -> None:
    template = built()
    os.utime(template.path / "ram")  # mtime/ctime moved: re-hash, content still matches
    assert snapshot.load(template.key) == template


def test_edited_metadata_is_refused() -> None:
    template = built()
    meta_path = template.path / snapshot.META_FILE
    meta = json.loads(meta_path.read_text())
    meta["memory_mib"] = 2
    meta_path.chmod(0o644)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DriftError) as caught:
        snapshot.load(template.key)
    assert caught.value.drifted == [snapshot.META_FILE]


def test_key_covers_baseline_qemu_accelerator_and_machine() -> None:
    baseline = cast(Baseline, SimpleNamespace(digest="sha256:aa"))
    other = cast(Baseline, SimpleNamespace(digest="sha256:bb"))
    base = snapshot.template_key(baseline, "7.2", "tcg", ["-m", "256"])
    assert base == snapshot.template_key(baseline, "7.2", "tcg", ["-m", "256"])
    assert base != snapshot.template_key(other, "7.2", "tcg", ["-m", "256"])
    assert base != snapshot.template_key(baseline, "7.2", "kvm", ["-m", "256"])
    assert base != snapshot.template_key(baseline, "8.0", "tcg", ["-m", "256"])
    assert base != snapshot.template_key(baseline, "7.2", "tcg", ["-m", "512"])


def test_agent_version_gate_and_qemu_option_escaping() -> None:
    assert snapshot.agent_supports_snapshots({"agent_version": "0.2.0"})
    assert snapshot.agent_supports_snapshots({"agent_version": "1.0"})
    assert not snapshot.agent_supports_snapshots({"agent_version": "0.1.0"})
    assert not snapshot.agent_supports_snapshots({})
    args = snapshot.memory_args(Path("/a,b/ram"), 256, shared=False)
    assert args == ["-object", "memory-backend-file,id=mem,size=256M,mem-path=/a,,b/ram,share=off"]


def test_only_the_newest_templates_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot, "KEEP", 2)
    keys = [f"{i:032d}" for i in range(4)]
    for i, key in enumerate(keys):
        template = built(key)
        os.utime(template.path / snapshot.META_FILE, (1000 + i, 1000 + i))
    assert [snapshot.load(k) is not None for k in keys] == [False, False, True, True]
    assert snapshot.prune(keep=0, spare=keys[3]) == [keys[2]]


def test_leftovers_of_dead_builders_are_removed(home: Path) -> None:
    root = home / "templates"
    dead = 2**22 + 12345  # above the default pid_max: never a live process
    for name in (f".build-{'k' * 32}-{dead}", f".trash-{'j' * 32}-{dead}-1"):
        (root / name).mkdir(parents=True)
    alive = root / f".trash-{'j' * 32}-{os.getpid()}-2"
    alive.mkdir()
    work = snapshot.build_dir("k" * 32)
    assert sorted(p.name for p in root.iterdir()) == sorted([alive.name, work.name])
