"""Fixtures of the baseline tests.

``tests/conftest.py`` points ``CLEANROOM_HOME`` at ``.cache/test-home`` for the session, so the
kernel download, the rootfs tarball and the tiny baseline are made once and reused by later runs.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cleanroom.baseline.kernel import Kernel, fetch_kernel
from cleanroom.core.baseline_model import Baseline

ROOT = Path(__file__).resolve().parents[2]
TINY_SPEC = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"


def needs_root_tools() -> None:
    """Skip unless the host can build baselines (root, mmdebstrap, mkfs.erofs, lz4)."""
    if os.geteuid() != 0:
        pytest.skip("building a baseline needs root (mmdebstrap, chroot)")
    for tool in ("mmdebstrap", "mkfs.erofs", "lz4", "apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (run `make setup`)")


@pytest.fixture(scope="session")
def kernel() -> Kernel:
    """The real guest kernel (downloaded once, then cached under the test home)."""
    needs_root_tools()
    return fetch_kernel("linux-image-cloud-amd64")


@pytest.fixture(scope="session")
def tiny() -> Baseline:
    """The tiny baseline, built (or found in the cache) once per session."""
    from cleanroom.baseline.builder import build

    needs_root_tools()
    return build(TINY_SPEC)


def fake_module(path: Path, name: str, depends: list[str]) -> Path:
    """Write a minimal ELF64 file whose ``.modinfo`` says ``name=`` and ``depends=``."""
    modinfo = f"license=GPL\0depends={','.join(depends)}\0name={name}\0".encode()
    shstrtab = b"\0.modinfo\0.shstrtab\0"
    data_off = 64
    strtab_off = data_off + len(modinfo)
    shoff = (strtab_off + len(shstrtab) + 7) // 8 * 8
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 1, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 3, 2)

    def section(name_off: int, kind: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name_off, kind, 0, 0, offset, size, 0, 0, 1, 0)

    body = header + modinfo + shstrtab
    body += bytes(shoff - len(body))
    body += bytes(64)  # the null section
    body += section(1, 1, data_off, len(modinfo))
    body += section(10, 3, strtab_off, len(shstrtab))
    path.write_bytes(body)
    return path


@pytest.fixture
def make_module(tmp_path: Path) -> Callable[[str, list[str]], Path]:
    """A factory of fake modules ``<name>.ko`` in ``tmp_path/modules``."""
    folder = tmp_path / "modules"
    folder.mkdir(exist_ok=True)

    def make(name: str, depends: list[str]) -> Path:
        return fake_module(folder / f"{name}.ko", name, depends)

    return make


def clone_baseline(baseline: Baseline, home: Path, copy: tuple[str, ...] = ()) -> Path:
    """Put ``baseline`` into the store under ``home``: hard links, except ``copy`` (real copies,
    safe to modify)."""
    folder = home / "baselines" / baseline.path.name
    folder.mkdir(parents=True)
    for item in baseline.path.iterdir():
        target = folder / item.name
        if item.name in copy or item.name == "baseline.json":
            shutil.copy2(item, target)
            target.chmod(stat.S_IMODE(item.stat().st_mode) | 0o200)
        else:
            try:
                os.link(item, target)
            except OSError:
                shutil.copy2(item, target)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A real registry (Debian's docker-registry) on 127.0.0.1, storage under tmp_path."""
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry not installed (scripts/setup.sh installs it)")
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp_path / 'registry'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("docker-registry did not start listening")
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
