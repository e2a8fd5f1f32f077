"""Guest kernel: .modinfo parsing, module load order, vmlinux extraction (fake and real)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from cleanroom.baseline.kernel import (
    MODULES,
    Kernel,
    check_elf,
    extract_vmlinux,
    index_modules,
    load_order,
    module_depends,
    read_modinfo,
    split_for_nic,
)
from cleanroom.errors import BuildError

MakeModule = Callable[[str, list[str]], Path]


def fake_elf() -> bytes:
    """A 64-bit x86-64 ELF executable header with no program headers, plus some body."""
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, 64, 0, 0, 64, 56, 0, 64, 0, 0)
    return header + b"kernel body " * 1000


def test_modinfo_of_a_fake_module(make_module: MakeModule) -> None:
    ko = make_module("erofs", ["libcrc32c"])
    info = read_modinfo(ko)
    assert info["name"] == ["erofs"] and info["license"] == ["GPL"]
    assert module_depends(ko) == ["libcrc32c"]
    assert module_depends(make_module("overlay", [])) == []


def test_load_order_puts_dependencies_first(make_module: MakeModule, tmp_path: Path) -> None:
    make_module("virtio_ring", [])
    make_module("virtio", ["virtio_ring"])
    make_module("virtio_blk", ["virtio", "virtio_ring"])
    make_module("virtio-mmio", ["virtio", "virtio_ring"])  # file names may use '-'
    make_module("libcrc32c", [])
    make_module("erofs", ["libcrc32c"])
    index = index_modules(tmp_path / "modules")
    assert set(index) == {
        "virtio_ring",
        "virtio",
        "virtio_blk",
        "virtio_mmio",
        "libcrc32c",
        "erofs",
    }
    order = load_order(["virtio_mmio", "virtio_blk", "erofs"], index)
    assert order == ["virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "libcrc32c", "erofs"]


def test_load_order_refuses_missing_modules_and_cycles(
    make_module: MakeModule, tmp_path: Path
) -> None:
    make_module("a", ["b"])
    make_module("b", ["a"])
    make_module("c", ["nowhere"])
    index = index_modules(tmp_path / "modules")
    with pytest.raises(BuildError, match="cycle"):
        load_order(["a"], index)
    with pytest.raises(BuildError, match="nowhere not found"):
        load_order(["c"], index)


def test_modinfo_refuses_a_non_elf(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.ko"
    bogus.write_bytes(b"not an elf at all" * 10)
    with pytest.raises(BuildError, match="not a 64-bit"):
        read_modinfo(bogus)


@pytest.mark.skipif(shutil.which("lz4") is None, reason="lz4 is not installed")
def test_extract_vmlinux_from_an_lz4_payload_with_trailing_bytes(tmp_path: Path) -> None:
    payload = subprocess.run(
        ["lz4", "-l", "-c"], input=fake_elf(), capture_output=True, check=True
    ).stdout
    assert payload.startswith(b"\x02\x21\x4c\x18")
    bzimage = tmp_path / "vmlinuz"
    bzimage.write_bytes(b"MZ setup code \x02\x21 " * 50 + payload + b"\xff" * 333 + b"trailer")
    out = tmp_path / "vmlinux"
    extract_vmlinux(bzimage, out)
    assert out.read_bytes() == fake_elf()

    not_elf = subprocess.run(
        ["lz4", "-l", "-c"], input=b"hello" * 100, capture_output=True, check=True
    ).stdout
    bzimage.write_bytes(b"junk" + not_elf)
    with pytest.raises(BuildError, match="no LZ4 payload"):
        extract_vmlinux(bzimage, tmp_path / "other")


def test_check_elf_refuses_truncated_and_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "vmlinux"
    path.write_bytes(fake_elf())
    check_elf(path)
    header = bytearray(fake_elf())
    header[0x12] = 183  # aarch64
    path.write_bytes(bytes(header))
    with pytest.raises(BuildError, match="not x86-64"):
        check_elf(path)
    path.write_bytes(b"\x7fELF")
    with pytest.raises(BuildError):
        check_elf(path)


# -- the real Debian cloud kernel (downloaded once, cached under the test home) -----------------
# marked ``build`` like every other test that downloads: ``-m "not build"`` stays offline


@pytest.mark.build
def test_real_kernel_modules_and_order(kernel: Kernel) -> None:
    assert kernel.version.endswith("-cloud-amd64")
    check_elf(kernel.vmlinux)
    assert module_depends(kernel.module("erofs")) == ["libcrc32c"]
    assert sorted(module_depends(kernel.module("virtio_blk"))) == ["virtio", "virtio_ring"]
    assert read_modinfo(kernel.module("overlay"))["vermagic"][0].startswith(kernel.version)
    order = list(kernel.order)
    assert set(MODULES) <= set(order)
    for name in order:
        for dep in module_depends(kernel.module(name)):
            assert order.index(dep) < order.index(name), (dep, name)
    assert (kernel.module_dir / "order").read_text().split() == order
    again = load_order(list(MODULES), index_modules(kernel.module_dir))
    assert again == order
    always, nic = split_for_nic(kernel)
    assert sorted(nic) == ["failover", "net_failover", "virtio_net"]  # only a NIC needs them
    assert sorted(always + nic) == sorted(order)
    assert {"virtio_mmio", "virtio_blk", "virtio_console", "erofs", "overlay"} <= set(always)
    for part in (always, nic):
        assert part == [n for n in order if n in part]  # each still in load order


@pytest.mark.build
def test_a_second_fetch_is_served_from_the_cache(kernel: Kernel) -> None:
    from cleanroom.baseline.kernel import fetch_kernel

    steps: list[str] = []
    again = fetch_kernel("linux-image-cloud-amd64", lambda step, detail: steps.append(detail))
    assert again == kernel
    assert steps == [f"cached {kernel.version}"]
