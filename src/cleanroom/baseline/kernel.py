"""The guest kernel: Debian's cloud kernel, as an ELF ``vmlinux`` plus the few modules we load.

``fetch_kernel(package)`` downloads the package with ``apt-get download`` (following a meta
package such as ``linux-image-cloud-amd64`` to the real image it depends on), unpacks it with
``dpkg-deb -x``, extracts the ELF ``vmlinux`` from the bzImage's LZ4 payload (it boots directly
as PVH under QEMU's microvm) and keeps only the modules the initramfs needs, in load order.

Cache (``cache_dir()/kernel/``)::

    debs/<name>_<version>_amd64.deb   the downloaded packages
    by-package/<package>              the kernel version a package resolved to
    <version>/vmlinux                 the extracted ELF kernel
    <version>/modules/<name>.ko       the needed modules (dependency closure of MODULES)
    <version>/modules/order           their load order, one name per line

A second build finds ``by-package/<package>`` and ``<version>/`` and downloads nothing.
Module dependencies come from each ``.ko``'s ``.modinfo`` section (``depends=``), read with a
tiny ELF parser, so the host needs no kmod. Soft dependencies are ignored (the cloud kernel has
``crc32c`` built in).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cleanroom.baseline.proc import Progress, quiet, run
from cleanroom.errors import BuildError
from cleanroom.host.paths import cache_dir

MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "virtio_net", "erofs", "overlay")
"""What the initramfs may load (their dependencies are added)."""
NIC_MODULES = ("virtio_net",)
"""Loaded only in a VM with a NIC (one whose episode has an egress allowlist)."""

LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
ELF_MAGIC = b"\x7fELF"
KERNEL_CACHE_VERSION = "1"


@dataclass(frozen=True)
class Kernel:
    """An extracted guest kernel and its initramfs modules."""

    version: str  # e.g. "6.1.0-56-cloud-amd64"
    vmlinux: Path
    module_dir: Path  # holds <name>.ko for every name in ``order``
    order: tuple[str, ...]  # load order (dependencies first)

    def module(self, name: str) -> Path:
        return self.module_dir / f"{name}.ko"


def kernel_cache() -> Path:
    return cache_dir() / "kernel"


# -- modules --------------------------------------------------------------------------------------


def read_modinfo(ko: Path) -> dict[str, list[str]]:
    """The ``key=value`` strings of a module's ``.modinfo`` ELF section (keys may repeat)."""
    data = ko.read_bytes()
    if data[:4] != ELF_MAGIC or data[4] != 2 or data[5] != 1:
        raise BuildError(f"kernel: {ko.name} is not a 64-bit little-endian ELF module")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(index: int) -> tuple[int, int, int]:  # (name offset, file offset, size)
        base = shoff + index * shentsize
        (name,) = struct.unpack_from("<I", data, base)
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name, offset, size

    _, strtab, _ = section(shstrndx)
    info: dict[str, list[str]] = {}
    for index in range(shnum):
        name_off, offset, size = section(index)
        end = data.index(b"\0", strtab + name_off)
        if data[strtab + name_off : end] != b".modinfo":
            continue
        for item in data[offset : offset + size].split(b"\0"):
            key, sep, value = item.decode("utf-8", "replace").partition("=")
            if sep:
                info.setdefault(key, []).append(value)
        return info
    raise BuildError(f"kernel: {ko.name} has no .modinfo section")


def module_depends(ko: Path) -> list[str]:
    """The hard dependencies (``depends=``) of a module, as module names."""
    return [d for v in read_modinfo(ko).get("depends", []) for d in v.split(",") if d]


def index_modules(modules_root: Path) -> dict[str, Path]:
    """Module name (``-`` normalised to ``_``) -> ``.ko`` path, for every module under a tree."""
    return {p.name.removesuffix(".ko").replace("-", "_"): p for p in modules_root.rglob("*.ko")}


def split_for_nic(kernel: Kernel) -> tuple[list[str], list[str]]:
    """``kernel.order`` as (what every VM loads, what only a VM with a NIC adds: ``NIC_MODULES``
    and the dependencies nothing else needs), each still in load order."""
    if not set(NIC_MODULES) & set(kernel.order):
        return list(kernel.order), []
    index = {name: kernel.module(name) for name in kernel.order}
    always = set(load_order([m for m in MODULES if m not in NIC_MODULES and m in index], index))
    return (
        [n for n in kernel.order if n in always],
        [n for n in kernel.order if n not in always],
    )


def load_order(wanted: tuple[str, ...] | list[str], index: dict[str, Path]) -> list[str]:
    """``wanted`` plus all their dependencies, each after everything it depends on (stable)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in order:
            return
        if name in visiting:
            raise BuildError(f"kernel: module dependency cycle through {name}")
        if name not in index:
            raise BuildError(f"kernel: module {name} not found in the kernel package")
        visiting.add(name)
        for dep in module_depends(index[name]):
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in wanted:
        visit(name)
    return order


# -- vmlinux --------------------------------------------------------------------------------------


def check_elf(path: Path) -> None:
    """Raise BuildError unless ``path`` is a complete x86-64 ELF executable."""
    with path.open("rb") as f:
        head = f.read(64)
    size = path.stat().st_size
    if len(head) < 64 or head[:4] != ELF_MAGIC or head[4] != 2 or head[5] != 1:
        raise BuildError(f"kernel: {path.name} is not a 64-bit little-endian ELF")
    (machine,) = struct.unpack_from("<H", head, 0x12)
    if machine != 62:
        raise BuildError(f"kernel: {path.name} is not x86-64 (e_machine={machine})")
    (phoff,) = struct.unpack_from("<Q", head, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
    with path.open("rb") as f:
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        (offset,) = struct.unpack_from("<Q", table, i * phentsize + 0x08)
        (filesz,) = struct.unpack_from("<Q", table, i * phentsize + 0x20)
        if offset + filesz > size:
            raise BuildError(f"kernel: {path.name} is truncated")


def extract_vmlinux(bzimage: Path, out: Path) -> None:
    """Write the ELF kernel inside a bzImage's LZ4 (legacy frame) payload to ``out``."""
    data = bzimage.read_bytes()
    start = data.find(LZ4_LEGACY_MAGIC)
    while start != -1:
        # lz4 exits 1 on the bzImage's trailing bytes after the payload; the ELF check decides.
        proc = run(["lz4", "-dc"], "kernel", input_bytes=data[start:], ok_codes=(0, 1))
        if proc.stdout[:4] == ELF_MAGIC:
            out.write_bytes(proc.stdout)
            check_elf(out)
            return
        start = data.find(LZ4_LEGACY_MAGIC, start + 1)
    raise BuildError(f"kernel: no LZ4 payload holding an ELF kernel in {bzimage.name}")


# -- download -------------------------------------------------------------------------------------


def _download(package: str, into: Path, progress: Progress) -> Path:
    """``apt-get download`` one package into ``into`` (apt-get update once if it fails)."""
    progress("kernel", f"downloading {package}")
    scratch = Path(tempfile.mkdtemp(prefix="dl-", dir=into))
    os.chmod(scratch, 0o777)  # let apt's _apt user write here (avoids the unsandboxed path)
    try:
        try:
            run(["apt-get", "download", package], "kernel", cwd=scratch)
        except BuildError:
            progress("kernel", "apt-get update")
            run(["apt-get", "update"], "kernel")
            run(["apt-get", "download", package], "kernel", cwd=scratch)
        debs = sorted(scratch.glob("*.deb"))
        if len(debs) != 1:
            raise BuildError(f"kernel: apt-get download {package} gave {len(debs)} .deb files")
        target = into / debs[0].name
        os.replace(debs[0], target)
        return target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _real_image(deb: Path, debs: Path, progress: Progress) -> Path:
    """Follow a meta package to the linux-image package that holds the kernel."""
    listing = run(["dpkg-deb", "-c", deb], "kernel").stdout.decode()
    if re.search(r"\./boot/vmlinuz-", listing):
        return deb
    depends = run(["dpkg-deb", "-f", deb, "Depends"], "kernel").stdout.decode()
    for dep in depends.split(","):
        match = re.match(r"\s*(linux-image-[^\s(|]+)\s*(?:\(\s*=\s*([^)\s]+)\s*\))?", dep)
        if match:
            name, version = match.groups()
            return _download(f"{name}={version}" if version else name, debs, progress)
    raise BuildError(f"kernel: {deb.name} holds no kernel and depends on no linux-image package")


def _unpack(image: Path, root: Path, progress: Progress) -> str:
    """Extract vmlinux and the needed modules of ``image`` into ``root/<version>``."""
    progress("kernel", f"extracting {image.name}")
    with tempfile.TemporaryDirectory(prefix="unpack-", dir=root) as tmp:
        tree = Path(tmp) / "deb"
        run(["dpkg-deb", "-x", image, tree], "kernel")
        versions = sorted(p.name for p in (tree / "lib" / "modules").iterdir())
        if len(versions) != 1:
            raise BuildError(f"kernel: expected one modules folder in {image.name}: {versions}")
        version = versions[0]
        out = Path(tmp) / version
        (out / "modules").mkdir(parents=True)
        extract_vmlinux(tree / "boot" / f"vmlinuz-{version}", out / "vmlinux")
        index = index_modules(tree / "lib" / "modules" / version)
        order = load_order(MODULES, index)
        for name in order:
            shutil.copyfile(index[name], out / "modules" / f"{name}.ko")
        (out / "modules" / "order").write_text("".join(f"{n}\n" for n in order))
        (out / "cache-version").write_text(KERNEL_CACHE_VERSION)
        final = root / version
        if final.exists() and _cached(root, version) is None:  # stale: move aside, then drop
            stale = Path(tmp) / "stale"
            os.replace(final, stale)
        if not final.exists():
            try:
                os.replace(out, final)
            except OSError:  # a concurrent fetch installed it first
                if _cached(root, version) is None:
                    raise
    return version


def _cached(root: Path, version: str) -> Kernel | None:
    folder = root / version
    try:
        if (folder / "cache-version").read_text() != KERNEL_CACHE_VERSION:
            return None
        order = tuple((folder / "modules" / "order").read_text().split())
    except OSError:
        return None
    kernel = Kernel(version, folder / "vmlinux", folder / "modules", order)
    if not kernel.vmlinux.is_file() or set(MODULES) - set(order):
        return None
    if not all(kernel.module(name).is_file() for name in order):
        return None
    return kernel


def fetch_kernel(package: str, progress: Progress = quiet, refresh: bool = False) -> Kernel:
    """The guest kernel of a Debian package, from the cache or downloaded and extracted.

    ``refresh=True`` asks apt again which version the package resolves to (a newer point release
    gives a new kernel version and so a new baseline digest).
    """
    root = kernel_cache()
    debs, by_package = root / "debs", root / "by-package"
    for folder in (debs, by_package):
        folder.mkdir(parents=True, exist_ok=True)
    marker = by_package / package
    if not refresh and marker.is_file():
        kernel = _cached(root, marker.read_text().strip())
        if kernel is not None:
            progress("kernel", f"cached {kernel.version}")
            return kernel
    image = _real_image(_download(package, debs, progress), debs, progress)
    version = _unpack(image, root, progress)
    tmp = by_package / f".{package}.tmp"
    tmp.write_text(version + "\n")
    os.replace(tmp, marker)
    kernel = _cached(root, version)
    if kernel is None:
        raise BuildError(f"kernel: extracted {version} but the cache entry is incomplete")
    progress("kernel", f"extracted {version}")
    return kernel
