"""The bulk disk on real QEMU clones (``agent/bulk.py``, ``native/bulk.c``): files of any size
cross it both ways byte for byte (the empty file, one byte, two pieces), into folders made on
the way and over a longer file; a missing file or a folder is a typed error and the env goes
on; the host's disk file is emptied after every transfer and goes with the env; and a clone's
disk holds nothing of another env's transfers (each VM has a file of its own, read as zeros).
The host's half against hostile answers: tests/agent/test_bulk.py."""

from __future__ import annotations

import os

import pytest

from cleanroom.agent import bulk
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Env
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import GuestFileNotFound, GuestOperationError

from ...vmkit import assert_gone, request

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

RAW_DISK = (
    'for d in /sys/block/vd*; do [ "$(cat $d/serial)" = cr-bulk ] && n=${d##*/}; done; '
    "head -c 65536 /dev/$n | od -v -An -tx1 | sort -u"
)


def emptied(driver: QemuDriver, env: Env) -> bool:
    st = bulk.file_in(driver.run_dir(env.info.env_id)).stat()
    return st.st_size == bulk.SIZE and st.st_blocks == 0


async def sh(env: Env, script: str) -> str:
    result = await env.exec(["/bin/sh", "-c", script])
    assert result.exit_code == 0, result.stderr
    return result.stdout.decode()


async def test_files_cross_the_bulk_disk_both_ways(tiny_baseline: Baseline) -> None:
    driver = QemuDriver(start="snapshot")
    first = await driver.create(request(tiny_baseline))
    second = None
    try:
        assert "bulk" in first.hello["features"] and first.info.start_kind == "snapshot"
        for size in (0, 1, 5000, bulk.SIZE + 12345):
            data = os.urandom(size)
            await first.put("/tmp/new/folder/f.bin", data, 0o640)
            assert emptied(driver, first)
            assert await sh(first, "wc -c < /tmp/new/folder/f.bin") == f"{size}\n"
            assert await first.get("/tmp/new/folder/f.bin") == data
            assert emptied(driver, first)
        assert await sh(first, "stat -c %a /tmp/new/folder/f.bin") == "640\n"
        await first.put("/tmp/new/folder/f.bin", b"short")  # over the longer file: truncated
        assert await first.get("/tmp/new/folder/f.bin") == b"short"

        with pytest.raises(GuestFileNotFound):
            await first.get("/tmp/none")
        with pytest.raises(GuestOperationError):
            await first.get("/tmp/new")  # a folder
        assert emptied(driver, first)
        assert (await first.exec(["true"])).exit_code == 0

        second = await driver.create(request(tiny_baseline))  # after the first's transfers
        assert await sh(second, RAW_DISK) == " " + " ".join(["00"] * 16) + "\n"
        assert await second.get("/etc/hostname")  # and its own disk works
    finally:
        for env in (first, second):
            if env is not None:
                await driver.destroy(env.info.env_id)
                assert_gone(driver, env.info.env_id)
        await driver.release_spares()
