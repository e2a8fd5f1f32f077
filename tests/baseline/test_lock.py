"""Locks: every build records what went in; ``--locked`` rebuilds exactly that or says what is
gone; ``baseline diff`` says what changed between two baselines."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cleanroom.baseline import lock
from cleanroom.baseline.builder import build
from cleanroom.baseline.compare import compare
from cleanroom.errors import BuildError

from .conftest import TINY_SPEC, needs_root_tools

STATUS = """Package: bash
Status: install ok installed
Architecture: amd64
Version: 5.2.15-2+b7

Package: gone
Status: deinstall ok config-files
Version: 1.0

Package: libc6
Status: install ok installed
Architecture: i386
Version: 2.36-9
Description: a
 continuation: line
"""


def test_dpkg_status_lists_installed_packages_only() -> None:
    assert lock.dpkg_packages(STATUS) == {"bash": "5.2.15-2+b7", "libc6:i386": "2.36-9"}


def test_pip_report_and_requirements_pin_hashes() -> None:
    report = {
        "install": [
            {
                "metadata": {"name": "Six", "version": "1.16.0"},
                "download_info": {"url": "u", "archive_info": {"hashes": {"sha256": "ab" * 32}}},
            }
        ]
    }
    items = lock.pip_items(report)
    assert items == [{"name": "six", "version": "1.16.0", "sha256": "ab" * 32, "url": "u"}]
    assert lock.pip_requirements(items) == f"six==1.16.0 --hash=sha256:{'ab' * 32}\n"
    with pytest.raises(BuildError, match="six has no sha256"):
        lock.pip_requirements([{**items[0], "sha256": ""}])


def test_missing_locked_versions_are_named() -> None:
    with pytest.raises(BuildError, match=r"bash \(locked 5\.1, got 5\.2\)"):
        lock.check_packages({"bash": "5.1", "zsh": "1"}, {"bash": "5.2", "zsh": "1"})
    assert lock.diff({"pip": [{"name": "a", "version": "1"}]}, {"pip": []}) == ["pip a: 1 -> -"]


def test_no_lock_says_how_to_make_one(tmp_path: Path) -> None:
    spec = tmp_path / "baseline.toml"
    spec.write_text("")
    with pytest.raises(BuildError, match="cleanroom baseline lock"):
        lock.read(spec)


@pytest.mark.build
def test_build_writes_a_lock_and_locked_rebuild_gives_the_same_digest(tmp_path: Path) -> None:
    """The lock names the Debian packages, the exact wheel (sha256) and the kernel; a
    ``--locked`` rebuild is byte-identical; a lock naming a wheel that does not exist fails by
    name; ``diff`` against the tiny baseline names the wheel and its files."""
    needs_root_tools()
    folder = tmp_path / "spec"
    shutil.copytree(TINY_SPEC.parent, folder)
    (folder / "baseline.lock").unlink(missing_ok=True)  # tiny's own, from an earlier build
    spec = folder / "baseline.toml"
    text = spec.read_text().replace('name = "tiny"', 'name = "tiny-six"')
    spec.write_text(text.replace("[pip]\npackages = []", '[pip]\npackages = ["six==1.16.0"]'))
    first = build(spec)
    written = json.loads((folder / "baseline.lock").read_text())
    assert first.lock == written
    assert written["debian"]["packages"]["python3-minimal"]
    assert [(w["name"], w["version"]) for w in written["pip"]] == [("six", "1.16.0")]
    assert len(written["pip"][0]["sha256"]) == 64
    assert written["kernel"]["version"] == first.kernel_version
    assert json.loads((first.path / "baseline.json").read_text())["lock"] == written

    again = build(spec, locked=True)
    assert again.digest == first.digest

    bad = {**written, "pip": [{**written["pip"][0], "version": "0.0.1", "sha256": "0" * 64}]}
    lock.write(spec, bad)
    with pytest.raises(BuildError, match="six"):
        build(spec, locked=True)

    tiny = build(TINY_SPEC)
    lines = compare(tiny, first)
    assert "pip six: - -> 1.16.0" in lines
    assert any(
        line.startswith("file + /usr/local/lib/python3.11/dist-packages/six.py") for line in lines
    )
    assert compare(first, first) == []


@pytest.mark.build
def test_cli_build_image_and_diff(tmp_path: Path) -> None:
    """``baseline build --image REF`` needs no spec; ``baseline diff`` prints the changes."""
    needs_root_tools()
    from cleanroom.baseline.rootfs import debootstrap_tarball
    from cleanroom.baseline.spec import BaseSection

    from .ociutil import layout, tar_folder

    debian = debootstrap_tarball(BaseSection()).read_bytes()
    folder = layout(tmp_path / "img", [debian], {"Cmd": ["/bin/true"]})
    archive = tar_folder(folder, tmp_path / "img.tar")
    cli = [sys.executable, "-m", "cleanroom", "baseline"]
    done = subprocess.run(
        [*cli, "build", "--image", f"oci-archive:{archive}"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    digest = done.stdout.strip().splitlines()[-1]
    assert digest.startswith("sha256:")
    tiny = build(TINY_SPEC)
    diff = subprocess.run([*cli, "diff", tiny.digest, digest], capture_output=True, text=True)
    assert diff.returncode == 0, diff.stderr
    assert "entrypoint:" in diff.stdout and "image: null" in diff.stdout
    none = subprocess.run([*cli, "build"], capture_output=True, text=True)
    assert none.returncode == 2 and "--image" in none.stderr


def test_spec_pins_are_checked_by_name() -> None:
    assert lock.spec_pins(["tzdata=2025b-0+deb12u1", "curl", "a+b=1:2.0~rc1"]) == {
        "tzdata": "2025b-0+deb12u1",
        "a+b": "1:2.0~rc1",
    }
    lock.check_pinned({"tzdata": "1"}, {"tzdata": "1", "bash": "5"})
    named = r"tzdata=1 \(the tree has 2\), zz=3 \(the tree has none\)"
    with pytest.raises(BuildError, match=named):
        lock.check_pinned({"tzdata": "1", "zz": "3"}, {"tzdata": "2"})


def _two_versions(package: str) -> tuple[str, str]:
    """Two versions of ``package`` the Debian mirrors offer (bookworm and its updates or
    security suite, which mmdebstrap adds for a stable release), per the host's apt lists."""
    if shutil.which("apt-cache") is None:
        pytest.skip("apt-cache not installed")
    out = subprocess.run(
        ["apt-cache", "madison", package], capture_output=True, text=True, check=True
    ).stdout
    versions = list(dict.fromkeys(line.split("|")[1].strip() for line in out.splitlines()))
    if len(versions) < 2:
        pytest.skip(f"the host's apt lists offer one version of {package}: {versions}")
    return versions[0], versions[1]


@pytest.mark.build
def test_an_apt_pin_is_built_for_real_and_locked(tmp_path: Path) -> None:
    """A spec pinning ``tzdata=V`` is built by mmdebstrap with exactly V; the lock (beside the
    spec and in baseline.json) records V; pinning the other version gives another digest and
    ``diff`` names the change; a version the mirror lacks fails the build naming it."""
    needs_root_tools()
    built = {}
    for version in _two_versions("tzdata"):
        folder = tmp_path / version
        shutil.copytree(TINY_SPEC.parent, folder)
        (folder / "baseline.lock").unlink(missing_ok=True)
        spec = folder / "baseline.toml"
        text = spec.read_text().replace('name = "tiny"', 'name = "tiny-tzdata"')
        spec.write_text(text.replace("packages = []", f'packages = ["tzdata={version}"]', 1))
        built[version] = build(spec)
        written = json.loads((folder / "baseline.lock").read_text())
        assert written["debian"]["packages"]["tzdata"] == version
        assert built[version].lock == written
    (a, first), (b, second) = built.items()
    assert first.digest != second.digest
    assert f"deb tzdata: {a} -> {b}" in lock.diff(first.lock or {}, second.lock or {})

    folder = tmp_path / "missing"
    shutil.copytree(TINY_SPEC.parent, folder)
    spec = folder / "baseline.toml"
    text = spec.read_text().replace('name = "tiny"', 'name = "tiny-nope"')
    spec.write_text(text.replace("packages = []", 'packages = ["tzdata=0.0-nope"]', 1))
    with pytest.raises(BuildError, match="tzdata"):
        build(spec)
