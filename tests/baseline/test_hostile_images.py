"""The build boundary against the hostile-image corpus (``hostile_images.py``): each image is
built by the real builder, and afterwards every canary of the ring outside the build, and a
canary beside the build in the scratch folder, are exactly as before (content, type, mode,
owner); a case that must be refused is refused with a typed error naming what is wrong; a case
that builds wrote its attack into its own tree, where ``check`` finds it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from cleanroom.baseline.builder import build
from cleanroom.baseline.rootfs import scratch_parent
from cleanroom.errors import BuildError
from tests.baseline.conftest import needs_root_tools
from tests.baseline.hostile_images import CASES, Case
from tests.baseline.testimages import save

pytestmark = pytest.mark.build
SCRUBBED_ROOTS = ("/tmp", "/var/tmp", "/run")  # emptied in a built tree (treefiles.SCRUBBED)


def _ring_parent() -> Path:
    """Where canary rings go: not under a folder the build empties in the tree (there the
    attack's landing place inside the tree would vanish): the checkout's .cache, unless the
    checkout itself is under /tmp (a CI clone), then the home's."""
    for parent in (
        Path(__file__).resolve().parents[2] / ".cache",
        Path.home().resolve() / ".cache" / "cleanroom-test-rings",
        Path("/var/lib/cleanroom-test-rings"),
    ):
        if not any(parent.is_relative_to(root) for root in SCRUBBED_ROOTS):
            parent.mkdir(parents=True, exist_ok=True)
            return parent
    raise AssertionError("no folder for canary rings outside /tmp, /var/tmp and /run")


Snapshot = dict[str, tuple[int, int, int, int, bytes]]


def make_ring(ring: Path) -> None:
    """Canary files and folders an attacker would aim at."""
    ring.mkdir()
    for name in ("environment", "hostname", "passwd", "canary-0", "canary-1"):
        (ring / name).write_text(f"host {name}\n")
    (ring / "lists").mkdir()
    (ring / "lists" / "keep").write_text("host list\n")
    (ring / "payload").mkdir()
    (ring / "payload" / "keep").write_text("host payload\n")


def snapshot(folder: Path) -> Snapshot:
    found: Snapshot = {}
    for path in [folder, *folder.rglob("*")]:
        st = os.lstat(path)
        data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        found[str(path)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, data)
    return found


def write_spec(case: Case, folder: Path, ref: str) -> Path:
    text = f'name = "hostile-{case.name}"\n[base]\nimage = "{ref}"\n'
    text += "[limits]\ntimeout_s = 60\nmemory_mib = 256\n"
    if case.function:
        (folder / "app").mkdir()
        (folder / "app" / "entry.py").write_text("def run(manifest):\n    return {}\n")
        text += '[entrypoint]\nfunction = "entry:run"\n[[files]]\nsrc = "app"\ndest = "/srv/app"\n'
    if case.files_dest:
        (folder / "payload").mkdir()
        (folder / "payload" / "entry.py").write_text("print('payload')\n")
        text += f'[[files]]\nsrc = "payload"\ndest = "{case.files_dest}"\n'
    path = folder / "baseline.toml"
    path.write_text(text)
    return path


def extract(rootfs: Path, into: Path) -> Path:
    subprocess.run(
        ["fsck.erofs", f"--extract={into}", str(rootfs)], check=True, capture_output=True
    )
    return into


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_hostile_image_touches_nothing_outside_its_tree(case: Case, tmp_path: Path) -> None:
    needs_root_tools()
    ring = Path(tempfile.mkdtemp(dir=_ring_parent())) / "ring"  # not under /tmp: the scrub empties
    make_ring(ring)  # the guest's /tmp, where the attack would land in the tree
    before = snapshot(ring)
    scratch = scratch_parent()
    beside = Path(tempfile.mkdtemp(prefix="cleanroom-canary-", dir=scratch))  # beside the build
    (beside / "canary").write_text("canary\n")
    layers = case.layers(ring, tmp_path)
    ref = save(layers, {"Cmd": ["/bin/true"], **case.config}, tmp_path, "oci-archive")
    spec = write_spec(case, tmp_path, ref)
    if case.expect == "refused":
        with pytest.raises(BuildError, match=case.match):
            build(spec, force=True)
    else:
        baseline = build(spec, force=True)
        if case.check is not None:
            with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
                case.check(extract(baseline.rootfs, Path(tmp)), ring)
    assert snapshot(ring) == before
    assert (beside / "canary").read_text() == "canary\n"  # the scratch folder and its neighbours
    shutil.rmtree(ring.parent)
    shutil.rmtree(beside)
