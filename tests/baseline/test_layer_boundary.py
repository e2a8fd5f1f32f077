"""The layer applier and the build sandbox hold the boundary whatever a layer holds.

A property test applies random layers (files, folders, symlinks to absolute and climbing
targets, hard links, whiteouts, opaque folders, long names) to a tree inside a sandbox folder
ringed with canary files: the canaries, their folder and the folders above are never changed,
and nothing appears outside the tree; a refusal is an ``ImageError``. Then the limits
(``ImageLimits``: bytes, entries, path length, free space) and the sandbox itself: a confined
step cannot write a host file, does not see the host's processes, runs as no host user, and is
killed at its timeout with everything it started.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cleanroom.baseline import confine
from cleanroom.baseline.confine import Bind
from cleanroom.baseline.layers import Budget, ImageLimits, apply_layer
from cleanroom.baseline.rootfs import SHM_MAX_TREE, scratch_parent
from cleanroom.errors import BuildError, ImageError
from cleanroom.host.paths import cache_dir
from tests.baseline.ociutil import Entry, layer_bytes

NAMES = st.sampled_from(["a", "b", "c", "etc", "..", ".", "ring", "x" * 200])
TARGETS = st.sampled_from(["/", "/a", "..", "../..", "../../ring", "a/../..", "/../../ring"])


def paths() -> st.SearchStrategy[str]:
    return st.lists(NAMES, min_size=1, max_size=4).map("/".join)


def entries(ring: str) -> st.SearchStrategy[Entry]:
    targets = st.one_of(TARGETS, st.just(ring), st.just(ring + "/canary"))
    return st.one_of(
        st.builds(lambda p: Entry(p, data=b"payload"), paths()),
        st.builds(lambda p: Entry(p, "dir", mode=0o755), paths()),
        st.builds(lambda p, t: Entry(p, "symlink", link=t), paths(), targets),
        st.builds(lambda p, t: Entry(p, "hardlink", link=t), paths(), paths()),
        st.builds(lambda p, n: Entry(f"{p}/.wh.{n}"), paths(), NAMES),
        st.builds(lambda p: Entry(f"{p}/.wh..wh..opq"), paths()),
        st.builds(lambda p: Entry(p.rsplit("/", 1)[0] + "/.wh.", data=b""), paths()),
    )


def snapshot(folder: Path, skip: Path) -> dict[str, tuple[int, int, bytes]]:
    found = {}
    for path in [folder, *folder.rglob("*")]:
        if path == skip or skip in path.parents:
            continue
        st_ = os.lstat(path)
        data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        found[str(path)] = (st_.st_mode, st_.st_mtime_ns, data)
    return found


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_layers_never_touch_the_ring(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    sandbox = tmp_path_factory.mktemp("sandbox")
    blobs = tmp_path_factory.mktemp("blobs")
    ring = sandbox / "ring"
    ring.mkdir()
    (ring / "canary").write_text("canary\n")
    (sandbox / "canary").write_text("beside the tree\n")
    tree = sandbox / "deep" / "tree"
    tree.mkdir(parents=True)
    (tree / "a").mkdir()
    layers = data.draw(st.lists(st.lists(entries(str(ring)), max_size=12), min_size=1, max_size=3))
    before = snapshot(sandbox, tree)
    for i, layer in enumerate(layers):
        blob = blobs / f"layer{i}.tar"
        blob.write_bytes(layer_bytes(layer))
        with contextlib.suppress(ImageError):  # a refusal is fine; a change outside is not
            apply_layer(tree, blob, f"layer{i}")
        blob.unlink()
    assert snapshot(sandbox, tree) == before
    assert tree.is_dir() and not tree.is_symlink()


def test_each_limit_is_an_image_error_naming_the_layer_and_the_limit(tmp_path: Path) -> None:
    big = layer_bytes([Entry("a", data=b"x" * 5000)])
    many = layer_bytes([Entry(f"f{i}", data=b"") for i in range(20)])
    cases = [
        (big, Budget(ImageLimits(layer_bytes=4096), free=1 << 40), "over 4096 bytes"),
        (big, Budget(ImageLimits(image_bytes=4096), free=1 << 40), "image over 4096 bytes"),
        (big, Budget(ImageLimits(), free=4096), "scratch's free space"),
        (many, Budget(ImageLimits(entries=10), free=1 << 40), "more than 10 entries"),
    ]
    for i, (layer, budget, said) in enumerate(cases):
        blob = tmp_path / f"l{i}.tar"
        blob.write_bytes(layer)
        tree = tmp_path / f"tree{i}"
        tree.mkdir()
        with pytest.raises(ImageError, match=f"image layer sha-{i}: .*{said}"):
            apply_layer(tree, blob, f"sha-{i}", budget)


def test_the_budget_spans_the_layers_of_one_image(tmp_path: Path) -> None:
    budget = Budget(ImageLimits(image_bytes=8000), free=1 << 40)
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(3):
        blob = tmp_path / f"l{i}.tar"
        blob.write_bytes(layer_bytes([Entry(f"f{i}", data=b"x" * 3000)]))
        if i < 2:
            apply_layer(tree, blob, f"l{i}", budget)
        else:
            with pytest.raises(ImageError, match="image over 8000 bytes"):
                apply_layer(tree, blob, f"l{i}", budget)


def test_a_large_tree_is_unpacked_on_disk_not_in_ram() -> None:
    assert scratch_parent(SHM_MAX_TREE + 1) == cache_dir()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the build sandbox needs root")


@needs_root
def test_a_confined_step_cannot_write_the_host_nor_see_it(tmp_path: Path) -> None:
    host_file = tmp_path / "host-file"
    host_file.write_text("host\n")
    host_file.chmod(0o666)  # even world-writable: not shown, so not reachable
    with confine.workspace(tmp_path / "scratch") as ws:
        script = (
            f"echo x > {host_file}; echo x > /etc/cleanroom-probe; ls /proc/1 >/dev/null; "
            "cat /etc/shadow >/dev/null; echo tree > /tree/mine; id -u"
        )
        proc = confine.run_builder(
            ws, ["/bin/sh", "-c", script], "probe", ok_codes=tuple(range(256))
        )
        assert proc.stdout.decode().split() == ["0"]  # namespace root: on the host, ids.base
        assert (ws.tree / "mine").read_text() == "tree\n"
        assert os.stat(ws.tree / "mine").st_uid == ws.ids.base
    assert host_file.read_text() == "host\n"
    assert not Path("/etc/cleanroom-probe").exists()
    err = proc.stderr.decode()
    assert "Permission denied" in err and "No such file" in err  # shadow; the host's /proc


@needs_root
def test_image_code_runs_with_the_tree_as_its_root(tmp_path: Path) -> None:
    import shutil

    from cleanroom.baseline.initramfs import BUSYBOX

    with confine.workspace(tmp_path / "scratch") as ws:
        (ws.tree / "bin").mkdir()
        shutil.copy(BUSYBOX, ws.tree / "bin" / "busybox")
        proc = confine.run_in_tree(ws, ["/bin/busybox", "ls", "/"], "probe")
        assert proc.stdout.decode().split() == ["bin"]


@needs_root
def test_a_step_past_its_timeout_is_killed_with_all_it_started(tmp_path: Path) -> None:
    with confine.workspace(tmp_path / "scratch") as ws:
        started = time.monotonic()
        script = "sleep 300 & sleep 300 & echo started > /tree/started; wait"
        with pytest.raises(BuildError, match="timed out after 2 s"):
            confine.run_builder(ws, ["/bin/sh", "-c", script], "probe", timeout_s=2)
        assert time.monotonic() - started < 30
        assert (ws.tree / "started").exists()
        deadline = time.monotonic() + 10
        while _sandbox_processes(ws.ids.base) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _sandbox_processes(ws.ids.base)


def _sandbox_processes(uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@needs_root
def test_a_step_sees_only_the_binds_it_names(tmp_path: Path) -> None:
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "f").write_text("in\n")
    with confine.workspace(tmp_path / "scratch") as ws:
        proc = confine.run_builder(
            ws,
            ["/bin/sh", "-c", "cat /in/f; echo x > /in/g"],
            "probe",
            binds=[Bind(shown, "/in")],
            ok_codes=(0, 1, 2),
        )
    assert proc.stdout.decode() == "in\n"
    assert not (shown / "g").exists()  # read-only
