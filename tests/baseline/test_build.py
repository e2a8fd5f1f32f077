"""A real build of the tiny baseline, then the store: cache, reproducibility, drift, resolve.

Marked ``build``: the first run on a machine downloads the kernel and runs mmdebstrap (~1 min);
later runs reuse ``.cache/test-home``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from cleanroom.agent import native
from cleanroom.baseline import store
from cleanroom.baseline.builder import build, native_agent_version
from cleanroom.baseline.confine import Workspace
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.baseline.rootfs import scratch_parent
from cleanroom.baseline.spec import load_spec, spec_digest
from cleanroom.core.baseline_model import AGENT_FILE, Baseline
from cleanroom.errors import BaselineNotFound, BuildError, DriftError

from .conftest import TINY_SPEC, clone_baseline, needs_root_tools

pytestmark = pytest.mark.build


def test_the_tiny_baseline_is_complete(tiny: Baseline) -> None:
    assert tiny.name == "tiny"
    assert tiny.path == store.baselines_dir() / tiny.digest.removeprefix("sha256:")
    assert {c.name for c in tiny.components} == {"vmlinux", "initrd.cpio", "rootfs.erofs", "agent"}
    assert tiny.kernel.read_bytes()[:4] == b"\x7fELF"
    assert tiny.entrypoint == ("python3", "/opt/tiny/entry.py")
    assert tiny.limits.timeout_s == 30 and tiny.limits.memory_mib == 256
    assert tiny.agent_version == native_agent_version()
    assert tiny.spec_digest == spec_digest(load_spec(TINY_SPEC))
    built = store.metadata(tiny)["built"]
    assert set(built["mtime_ns"]) == {"vmlinux", "initrd.cpio", "rootfs.erofs", "agent"}


def test_a_second_build_comes_from_the_cache_and_force_rebuilds_the_same(tiny: Baseline) -> None:
    steps: list[str] = []
    again = build(TINY_SPEC, progress=lambda step, detail: steps.append(step))
    assert again == tiny
    assert steps == ["cache"]

    steps.clear()
    rebuilt = build(TINY_SPEC, progress=lambda step, detail: steps.append(step), force=True)
    assert rebuilt.digest == tiny.digest  # byte-identical components
    assert {"kernel", "rootfs", "files", "erofs", "initramfs", "digest"} <= set(steps)
    assert "compile" not in steps  # a command baseline on the native agent compiles no Python
    assert store.verify(rebuilt) == []


def test_a_builder_change_rebuilds_to_the_same_digest(
    tiny: Baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cleanroom.baseline import builder

    monkeypatch.setattr(builder, "builder_fingerprint", lambda: "another-builder")
    steps: list[str] = []
    rebuilt = build(TINY_SPEC, progress=lambda step, detail: steps.append(step))
    assert "rootfs" in steps  # not served from the cache...
    assert rebuilt.digest == tiny.digest  # ...and the same bytes keep the same digest
    monkeypatch.undo()
    assert build(TINY_SPEC, force=True).digest == tiny.digest


def test_a_failed_build_leaves_no_scratch(tiny: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    from cleanroom.baseline import builder

    seen: list[Path] = []

    def broken(
        spec: object, ws: Workspace, out: Path, progress: object, locked: object, image: object
    ) -> None:
        (ws.tree / "half-done").write_text("x")
        (out.parent / "partial").write_text("x")
        seen.extend([ws.folder, out.parent])
        raise BuildError("rootfs: simulated failure")

    monkeypatch.setattr(builder, "build_rootfs", broken)
    with pytest.raises(BuildError, match="simulated"):
        build(TINY_SPEC, force=True)
    assert seen and not any(p.exists() for p in seen)
    assert store.resolve(tiny.digest) == tiny  # the stored baseline is untouched


def test_the_image_holds_the_files_the_agent_and_no_host_state(tiny: Baseline) -> None:
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as tmp:
        subprocess.run(
            ["fsck.erofs", f"--extract={tmp}", str(tiny.rootfs)], check=True, capture_output=True
        )
        root = Path(tmp)
        entry = root / "opt" / "tiny" / "entry.py"
        assert entry.read_bytes() == TINY_SPEC.parent.joinpath("files", "entry.py").read_bytes()
        assert entry.stat().st_mode & 0o777 == 0o644
        agent = root / "opt" / "cleanroom" / "agent"  # the native agent: a command baseline
        assert {p.name for p in agent.iterdir()} == {native.BINARY}
        assert (agent / native.BINARY).read_bytes() == (tiny.path / AGENT_FILE).read_bytes()
        assert not (root / "opt" / "cleanroom" / "entry.json").exists()  # a command baseline
        assert (root / "etc" / "hostname").read_text() == "cleanroom\n"
        assert (root / "etc" / "machine-id").read_bytes() == b""
        assert (root / "etc" / "resolv.conf").read_bytes() == b""
        assert (root / "etc" / "environment").exists()
        assert (root / "run" / "cleanroom").is_dir()
        assert (root / "tmp").stat().st_mode & 0o7777 == 0o1777
        assert (root / "root").is_dir()
        assert (root / "usr" / "lib" / "python3.11" / "json" / "__init__.py").is_file()
        assert not list((root / "var" / "lib" / "apt" / "lists").glob("*_Packages"))


def test_verify_is_clean_and_a_flipped_byte_is_named(
    tiny: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.verify(tiny) == []
    store.quick_check(tiny)
    store.require_intact(tiny)

    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    clone_baseline(tiny, tmp_path / "home", copy=("rootfs.erofs",))
    copy = store.resolve(tiny.digest)
    assert copy.path.is_relative_to(tmp_path)
    assert store.verify(copy) == []
    store.quick_check(copy)

    with copy.rootfs.open("r+b") as f:
        f.seek(4096 * 7 + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    assert store.verify(copy) == ["rootfs.erofs"]
    with pytest.raises(DriftError, match=r"rootfs\.erofs") as caught:
        store.require_intact(copy)
    assert caught.value.drifted == ["rootfs.erofs"]
    with pytest.raises(DriftError, match=r"rootfs\.erofs"):
        store.quick_check(copy)  # same size, new mtime: re-hashed

    os.truncate(copy.rootfs, 4096)
    with pytest.raises(DriftError, match=r"rootfs\.erofs"):
        store.quick_check(copy)
    copy.rootfs.unlink()
    assert store.verify(copy) == ["rootfs.erofs"]
    assert store.verify(tiny) == []  # the original was never touched


def test_a_run_rehashes_only_what_changed_since_this_process_hashed_it(
    tiny: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(store, "SETTLED_S", 0.0)  # the copy was just written
    clone_baseline(tiny, tmp_path / "home", copy=("rootfs.erofs",))
    copy = store.resolve(tiny.digest)
    hashed: list[str] = []
    real_hash = store.sha256_file

    def counted(path: Path) -> str:
        hashed.append(path.name)
        return real_hash(path)

    monkeypatch.setattr(store, "sha256_file", counted)

    assert store.verify(copy, reuse=True) == [] and "rootfs.erofs" in hashed
    hashed.clear()
    assert store.verify(copy, reuse=True) == [] and hashed == []  # unchanged: not hashed again
    assert store.verify(copy) == [] and "rootfs.erofs" in hashed  # without reuse: always

    before = copy.rootfs.stat()
    with copy.rootfs.open("r+b") as f:  # same size, and the old mtime put back
        f.seek(4096 * 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(copy.rootfs, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert copy.rootfs.stat().st_mtime_ns == before.st_mtime_ns
    assert store.verify(copy, reuse=True) == ["rootfs.erofs"]  # its ctime moved: re-hashed
    with pytest.raises(DriftError, match=r"rootfs\.erofs"):
        store.require_intact(copy, reuse=True)  # and a drifted file is never trusted again


def test_edited_metadata_is_drift(
    tiny: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    folder = clone_baseline(tiny, tmp_path / "home")
    meta = folder / "baseline.json"
    meta.write_text(meta.read_text().replace('"timeout_s": 30.0', '"timeout_s": 3000.0'))
    loaded = store.resolve(tiny.digest)
    assert store.verify(loaded) == ["baseline.json"]
    with pytest.raises(DriftError, match=r"baseline\.json"):
        store.quick_check(loaded)


def test_resolve_by_digest_prefix_and_spec(
    tiny: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hexd = tiny.digest.removeprefix("sha256:")
    assert store.resolve(tiny.digest) == tiny
    assert store.resolve(hexd) == tiny
    assert store.resolve(hexd[:6]) == tiny
    assert store.resolve("sha256:" + hexd[:10]) == tiny
    assert store.resolve(str(TINY_SPEC)) == tiny
    assert resolve_or_build(str(TINY_SPEC)) == tiny
    assert resolve_or_build(str(TINY_SPEC.parent)) == tiny  # --baseline DIR
    assert tiny in store.list_baselines()

    with pytest.raises(BaselineNotFound, match=r"at least 6 hex digits"):
        store.resolve(hexd[:5])
    absent = "0" * 64 if not hexd.startswith("0") else "f" * 64
    with pytest.raises(BaselineNotFound):
        store.resolve("sha256:" + absent)
    with pytest.raises(BaselineNotFound):
        store.resolve(absent[:8])
    with pytest.raises(BaselineNotFound):
        store.resolve("not-a-digest")

    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "empty"))
    assert store.list_baselines() == []
    with pytest.raises(BaselineNotFound, match="not been built"):
        store.resolve(str(TINY_SPEC))
    with pytest.raises(BaselineNotFound):
        store.resolve(hexd[:12])


def test_an_ambiguous_prefix_is_refused(
    tiny: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    clone_baseline(tiny, tmp_path / "home")
    twin = tmp_path / "home" / "baselines" / (tiny.path.name[:8] + "0" * 56)
    twin.mkdir()
    with pytest.raises(BaselineNotFound, match="ambiguous"):
        store.resolve(tiny.path.name[:8])


def test_a_function_baseline_carries_its_workers_config(tmp_path: Path) -> None:
    spec = TINY_SPEC.parents[1] / "warm" / "baseline.toml"
    warm = build(spec)
    assert warm.function is not None and warm.entrypoint == ()
    assert warm.function.to_json() == load_spec(spec).warm_config()
    assert warm.identity()["function"] == warm.function.to_json()
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as tmp:
        subprocess.run(
            ["fsck.erofs", f"--extract={tmp}", str(warm.rootfs)], check=True, capture_output=True
        )
        entry = Path(tmp) / "opt" / "cleanroom" / "entry.json"
        assert json.loads(entry.read_text()) == warm.function.to_json()
        assert list(Path(tmp).glob("opt/warm/__pycache__/entry.cpython-3*.pyc"))


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ('function = "entry:runn"', "AttributeError: module 'entry' has no attribute 'runn'"),
        (
            'preimport = ["json", "not_installed_here"]',
            "ModuleNotFoundError: No module named 'not_installed_here'",
        ),
    ],
)
def test_a_function_entry_that_cannot_import_fails_the_build(
    tmp_path: Path, edit: str, said: str
) -> None:
    """A typo in ``function`` or a missing ``preimport`` used to build fine and then end every
    episode ``episode_error: entrypoint failed (exit code 1)``; now the build fails, showing
    the guest's traceback, and nothing is stored."""
    needs_root_tools()
    folder = tmp_path / "warm"
    shutil.copytree(TINY_SPEC.parents[1] / "warm", folder)
    spec = folder / "baseline.toml"
    key = edit.split(" =")[0]
    lines = [edit if line.startswith(key + " =") else line for line in spec.read_text().split("\n")]
    spec.write_text("\n".join(lines))
    before = sorted(store.baselines_dir().iterdir())
    with pytest.raises(BuildError, match="entrypoint: function 'entry:") as info:
        build(spec)
    assert said in str(info.value) and "Traceback" in str(info.value)
    assert sorted(store.baselines_dir().iterdir()) == before
