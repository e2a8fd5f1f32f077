"""Container images as baselines: OCI layer semantics and image sources, without a VM.

Images are built here from plain data (``ociutil``) and, where skopeo is installed, converted by
the real skopeo into the other archive formats, so the parsers meet what real tools write.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cleanroom.baseline import oci
from cleanroom.baseline.layers import apply_layer
from cleanroom.errors import BuildError

from .conftest import free_port
from .ociutil import Entry, layer_bytes, layout, tar_folder

BASE = [
    Entry("etc", "dir", mode=0o755),
    Entry("etc/keep", data=b"keep\n"),
    Entry("etc/gone", data=b"deleted later\n"),
    Entry("opt", "dir", mode=0o755),
    Entry("opt/app", "dir", mode=0o755),
    Entry("opt/app/old", data=b"hidden by the opaque dir\n"),
    Entry("bin", "dir", mode=0o755),
    Entry("bin/tool", data=b"#!/bin/sh\n", mode=0o4755, uid=12, gid=34),
    Entry("bin/alias", "hardlink", link="bin/tool"),
    Entry("lib", "symlink", link="usr/lib"),
    Entry("usr/lib", "dir", mode=0o755),
    Entry("dev/null", "chardev"),
    Entry("etc/cap", data=b"x", xattrs={"user.cleanroom": "yes"}),
]
TOP = [
    Entry("etc/.wh.gone"),
    Entry("opt/app/.wh..wh..opq"),
    Entry("opt/app/new", data=b"from the top layer\n"),
    Entry("lib/libx.so", data=b"through the merged-usr symlink\n"),
]


def _apply(tmp_path: Path, *layers: list[Entry]) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    for i, entries in enumerate(layers):
        blob = tmp_path / f"layer{i}.tar"
        blob.write_bytes(layer_bytes(entries, gzip=i % 2 == 1))
        apply_layer(tree, blob, f"layer{i}")
    return tree


def test_whiteouts_opaque_dirs_links_and_metadata(tmp_path: Path) -> None:
    """A later layer's whiteout deletes, an opaque dir hides the lower layer's entries (not its
    own), hard links share an inode, symlinked parents resolve inside the tree, setuid, owners
    and xattrs are kept, device nodes are skipped."""
    tree = _apply(tmp_path, BASE, TOP)
    assert (tree / "etc/keep").read_bytes() == b"keep\n"
    assert not (tree / "etc/gone").exists()
    assert sorted(p.name for p in (tree / "opt/app").iterdir()) == ["new"]
    tool = (tree / "bin/tool").stat()
    assert tool.st_mode & 0o7777 == 0o4755 and (tool.st_uid, tool.st_gid) == (12, 34)
    assert (tree / "bin/alias").stat().st_ino == tool.st_ino
    assert (tree / "usr/lib/libx.so").read_bytes() == b"through the merged-usr symlink\n"
    assert (tree / "lib").is_symlink()
    assert not (tree / "dev/null").exists()
    assert os.getxattr(tree / "etc/cap", "user.cleanroom") == b"yes"
    assert not list(tree.rglob(".wh.*"))


@pytest.mark.parametrize(
    "evil",
    [
        [Entry("../escape", data=b"x")],
        [Entry("a/../../escape", data=b"x")],
        [Entry("x" * 300, data=b"x")],
    ],
    ids=["dotdot", "nested-dotdot", "long-component"],
)
def test_escaping_member_is_refused_by_name(tmp_path: Path, evil: list[Entry]) -> None:
    with pytest.raises(BuildError, match="layer0"):
        _apply(tmp_path, evil)
    assert not (tmp_path / "escape").exists()


def test_symlinks_never_lead_out_of_the_tree(tmp_path: Path) -> None:
    """An absolute or climbing symlink is followed as the guest would see it: inside the tree."""
    outside = tmp_path / "outside"
    outside.mkdir()
    layers = [
        Entry("up", "symlink", link="../../../../" + str(outside).lstrip("/")),
        Entry("abs", "symlink", link=str(outside)),
        Entry("up/a", data=b"a"),
        Entry("abs/b", data=b"b"),
        Entry("hl", "hardlink", link="../../etc/passwd"),
    ]
    with pytest.raises(BuildError, match="escapes"):
        _apply(tmp_path, layers)
    assert list(outside.iterdir()) == []
    tree = tmp_path / "tree"
    assert (tree / str(outside).lstrip("/") / "a").read_bytes() == b"a"


def test_corrupt_layer_is_refused(tmp_path: Path) -> None:
    blob = tmp_path / "bad.tar"
    blob.write_bytes(b"\x1f\x8b" + b"not gzip at all" * 100)
    with pytest.raises(BuildError, match="bad-layer"):
        apply_layer(tmp_path, blob, "bad-layer")


def _image(tmp_path: Path) -> Path:
    config = {"Env": ["PATH=/bin", "GREETING=hi"], "WorkingDir": "/opt/app", "Cmd": ["/bin/tool"]}
    return layout(tmp_path / "layout", [layer_bytes(BASE), layer_bytes(TOP, gzip=True)], config)


def test_oci_layout_and_archive_give_the_same_identity(tmp_path: Path) -> None:
    folder = _image(tmp_path)
    a = oci.fetch(f"oci:{folder}:latest", tmp_path / "w1")
    b = oci.fetch(f"oci-archive:{tar_folder(folder, tmp_path / 'img.tar')}", tmp_path / "w2")
    assert a.config_digest == b.config_digest and a.manifest_digest == b.manifest_digest
    assert [d for d, _ in a.layers] == [d for d, _ in b.layers] and len(a.layers) == 2
    assert a.config.env == ("PATH=/bin", "GREETING=hi")
    assert a.config.working_dir == "/opt/app" and a.config.command() == ("/bin/tool",)
    tree = tmp_path / "tree"
    oci.unpack(list(b.layers), tree)
    assert (tree / "opt/app/new").is_file() and not (tree / "etc/gone").exists()


def test_tampered_layer_is_refused_by_digest(tmp_path: Path) -> None:
    folder = _image(tmp_path)
    image = oci.fetch(f"oci:{folder}", tmp_path / "w")
    digest, blob = image.layers[0]
    blob.write_bytes(blob.read_bytes().replace(b"keep\n", b"evil\n"))
    with pytest.raises(BuildError, match=f"{digest}.*tampered"):
        oci.fetch(f"oci:{folder}", tmp_path / "w")


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("oci-archive:/nonexistent.tar", "no such archive"),
        ("oci:/nonexistent", "no OCI layout"),
        ("docker-archive:/nonexistent.tar", "no such archive"),
        ("ftp://x", "an image is one of"),
    ],
)
def test_unreadable_references_fail_clearly(tmp_path: Path, ref: str, message: str) -> None:
    with pytest.raises((BuildError, ValueError), match=message):
        oci.fetch(ref, tmp_path)


def test_hostile_index_is_a_build_error(tmp_path: Path) -> None:
    folder = _image(tmp_path)
    (folder / "index.json").write_text("[" * 100_000)
    with pytest.raises(BuildError, match=r"index\.json"):
        oci.fetch(f"oci:{folder}", tmp_path / "w")


needs_skopeo = pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo not installed")


@needs_skopeo
def test_docker_archive_written_by_skopeo(tmp_path: Path) -> None:
    """skopeo's docker-archive (``docker save`` format) of the same image unpacks the same."""
    folder = _image(tmp_path)
    archive = tmp_path / "docker.tar"
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{folder}:latest", f"docker-archive:{archive}:img:1"],
        check=True,
    )
    image = oci.fetch(f"docker-archive:{archive}", tmp_path / "w")
    assert image.config.env == ("PATH=/bin", "GREETING=hi")
    assert len(image.layers) == 2
    tree = tmp_path / "tree"
    oci.unpack(list(image.layers), tree)
    assert sorted(p.name for p in (tree / "opt/app").iterdir()) == ["new"]
    again = oci.fetch(f"docker-archive:{archive}", tmp_path / "w2")
    assert again.identity() == image.identity() | {"ref": again.ref}
    assert json.dumps(image.identity())


@needs_skopeo
def test_pull_from_a_registry_on_loopback(tmp_path: Path, registry: str) -> None:
    """``docker://`` pulls with skopeo from a real registry; the layers arrive checked."""
    folder = _image(tmp_path)
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            f"oci:{folder}:latest",
            f"docker://{registry}/tests/img:1",
        ],
        check=True,
    )
    image = oci.fetch(f"docker://{registry}/tests/img:1", tmp_path / "w")
    assert image.config.working_dir == "/opt/app" and len(image.layers) == 2
    tree = tmp_path / "tree"
    oci.unpack(list(image.layers), tree)
    assert (tree / "etc/keep").read_bytes() == b"keep\n" and not (tree / "etc/gone").exists()


@needs_skopeo
def test_unreachable_registry_is_named(tmp_path: Path) -> None:
    ref = f"docker://127.0.0.1:{free_port()}/nothing/here:1"
    with pytest.raises(BuildError, match=r"registry 127\.0\.0\.1:\d+"):
        oci.fetch(ref, tmp_path)
    assert not (tmp_path / "pulled" / "index.json").exists()
