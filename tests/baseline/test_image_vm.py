"""A container image as a baseline, end to end: layers, whiteouts and the image config in a VM.

The image is made here from the builder's own cached Debian tree (layer 1) and a second layer
that deletes a file (whiteout), hides a folder (opaque) and adds the entrypoint; the image config
sets ``Env``, ``WorkingDir`` and ``Cmd``. The spec has no ``[entrypoint]``: the image's is used.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.baseline.builder import build
from cleanroom.baseline.rootfs import debootstrap_tarball
from cleanroom.baseline.spec import BaseSection
from cleanroom.core.states import Outcome
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import BuildError
from tests import vmkit
from tests.baseline.conftest import free_port, needs_root_tools
from tests.baseline.ociutil import Entry, layer_bytes, layout, tar_folder
from tests.vmkit import Harness, assert_nothing_left, manifest

pytestmark = [pytest.mark.vm, pytest.mark.build]

ENTRY = b"""#!/bin/sh
issue=absent; [ -e /etc/issue ] && issue=present
docs=$(ls /usr/share/doc | tr '\\n' ' ')
f='{"reward": 1, "info": {"greeting": "%s", "cwd": "%s", "issue": "%s", "docs": "%s", '
printf "$f"'"user": "%s"}}' "$IMG_GREETING" "$(pwd)" "$issue" "$docs" "$(id -un) $HOME" \\
  > /run/cleanroom/result.json
"""


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    yield from vmkit.harness(tmp_path, QemuDriver())


def _image_spec(tmp_path: Path) -> Path:
    debian = debootstrap_tarball(BaseSection()).read_bytes()
    top = [
        Entry("etc/.wh.issue"),
        Entry("usr/share/doc/.wh..wh..opq"),
        Entry("usr/share/doc/only-this", "dir", mode=0o755),
        Entry("opt/img", "dir", mode=0o755),
        Entry("opt/img/entry.sh", data=ENTRY, mode=0o755),
    ]
    config = {
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "IMG_GREETING=hello from the image"],
        "WorkingDir": "/opt/img",
        "User": "nobody:nogroup",
        "Cmd": ["/bin/sh", "/opt/img/entry.sh"],
    }
    folder = layout(tmp_path / "layout", [debian, layer_bytes(top, gzip=True)], config)
    tar_folder(folder, tmp_path / "image.tar")
    spec = tmp_path / "baseline.toml"
    spec.write_text(
        'name = "image-test"\n[base]\nimage = "oci-archive:image.tar"\n'
        "[limits]\ntimeout_s = 30\nmemory_mib = 256\n"
    )
    return spec


async def test_image_baseline_runs_with_its_config_and_layers(
    tmp_path: Path, harness: Harness
) -> None:
    """Whiteouts and opaque dirs hold in the VM, the image's Env/WorkingDir/User/Cmd reach the
    entrypoint (User through the native agent), the image digests are in the baseline and the
    record, and a second build of the same archive gives the same digest."""
    needs_root_tools()
    spec = _image_spec(tmp_path)
    baseline = build(spec)
    assert baseline.image is not None and len(baseline.image["layers"]) == 2
    assert baseline.entrypoint == ("/bin/sh", "/opt/img/entry.sh")
    assert build(spec, force=True).digest == baseline.digest

    ctl, ledger, store, driver = harness
    result = await ctl.run([manifest("img-1", 1)], baseline, run_id="vm-image")
    episode = result.episodes[0]
    assert episode.outcome == Outcome.COMPLETED, episode.error
    record = store.get_record("vm-image", "img-1")
    assert record is not None
    info = record["info"]
    assert info["greeting"] == "hello from the image"
    assert info["cwd"] == "/opt/img"
    assert info["issue"] == "absent"
    assert info["docs"].split() == ["only-this"]
    assert info["user"] == "nobody /nonexistent"  # the image's User, run by the native agent
    assert record["provenance"]["baseline"] == baseline.digest
    assert record["provenance"]["image"]["layers"] == baseline.image["layers"]
    assert_nothing_left(driver, ledger, "vm-image")
    assert json.loads((baseline.path / "baseline.json").read_text())["image"] == baseline.image


DOCKERFILE = """FROM {registry}/tests/debian:1
RUN rm /etc/issue && mkdir -p /opt/img && echo built-by-buildah > /opt/img/marker
COPY entry.sh /opt/img/entry.sh
ENV IMG_GREETING="hello from the dockerfile"
WORKDIR /opt/img
CMD ["/bin/sh", "/opt/img/entry.sh"]
"""


async def test_dockerfile_from_a_loopback_registry(
    tmp_path: Path, harness: Harness, registry: str
) -> None:
    """A Dockerfile whose FROM is on a real registry on 127.0.0.1 is built by buildah (RUN,
    COPY, ENV, WORKDIR, CMD), becomes a baseline, and its episode sees what the build did."""
    needs_root_tools()
    if shutil.which("buildah") is None or shutil.which("skopeo") is None:
        pytest.skip("buildah/skopeo not installed (scripts/setup.sh installs them)")
    debian = debootstrap_tarball(BaseSection()).read_bytes()
    base = layout(tmp_path / "base", [debian], {"Env": ["PATH=/usr/bin:/bin"]})
    subprocess.run(
        [
            *("skopeo", "copy", "--quiet", "--dest-tls-verify=false"),
            *(f"oci:{base}:latest", f"docker://{registry}/tests/debian:1"),
        ],
        check=True,
    )
    env = tmp_path / "environment"
    env.mkdir()
    (env / "Dockerfile").write_text(DOCKERFILE.format(registry=registry))
    (env / "entry.sh").write_bytes(
        ENTRY.replace(b'"$IMG_GREETING"', b'"$IMG_GREETING $(cat marker)"')
    )
    spec = tmp_path / "baseline.toml"
    spec.write_text(
        'name = "dockerfile-test"\n[base]\ndockerfile = "environment/Dockerfile"\n'
        "[limits]\ntimeout_s = 30\nmemory_mib = 256\n"
    )
    baseline = build(spec)
    assert baseline.entrypoint == ("/bin/sh", "/opt/img/entry.sh")
    assert build(spec, force=True).digest == baseline.digest  # buildah --timestamp: same bytes

    ctl, ledger, store, driver = harness
    result = await ctl.run([manifest("df-1", 1)], baseline, run_id="vm-dockerfile")
    assert result.episodes[0].outcome == Outcome.COMPLETED, result.episodes[0].error
    record = store.get_record("vm-dockerfile", "df-1")
    assert record is not None
    info = record["info"]
    assert info["greeting"] == "hello from the dockerfile built-by-buildah"
    assert info["cwd"] == "/opt/img" and info["issue"] == "absent"
    assert info["user"] == "root /root"  # no USER: root, HOME as the agent sets it
    assert_nothing_left(driver, ledger, "vm-dockerfile")


def test_dockerfile_with_an_unresolvable_from_fails_clearly(tmp_path: Path) -> None:
    needs_root_tools()
    if shutil.which("buildah") is None:
        pytest.skip("buildah not installed (scripts/setup.sh installs it)")
    (tmp_path / "Dockerfile").write_text(f"FROM 127.0.0.1:{free_port()}/nothing/here:1\n")
    spec = tmp_path / "baseline.toml"
    spec.write_text('name = "df-bad"\n[base]\ndockerfile = "Dockerfile"\n')
    with pytest.raises(BuildError, match="could not be resolved"):
        build(spec)
