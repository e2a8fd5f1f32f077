"""A ``CLEANROOM_HOME`` of 200 characters works for every kind of env (real VMs, TCG here).

Protects issue 21 §1: an AF_UNIX path must fit in 108 bytes, so a socket under a long home
(QEMU's ``qmp.sock``, the gvisor agent's ``ctl.sock``) made every episode ``infra_error``.
Sockets are now socket pairs passed by fd (QEMU's agent channel and QMP monitor) or live in the
short runtime folder (gvisor, fake). One home for the module; its template is built once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers import sockets
from cleanroom.drivers.base import Env, EnvRequest, Owner, new_snapshot_id
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.host import paths
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

from .. import vmkit
from ..conftest import with_network
from ..vmkit import assert_gone

pytestmark = pytest.mark.vm

LIMITS = ResolvedLimits(timeout_s=60, memory_mib=256, vcpus=1)
HOME_CHARS = 200


@pytest.fixture(scope="module")
def long_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh home whose path is exactly 200 characters, for the whole module."""
    base = tmp_path_factory.mktemp("long")
    home = base / ("h" * (HOME_CHARS - len(str(base)) - 1))
    assert len(str(home)) == HOME_CHARS
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLEANROOM_HOME", str(home))
        yield home


def request(baseline: Baseline, env_id: str | None = None) -> EnvRequest:
    shape = vmkit.request(baseline, LIMITS, "long-home")
    return EnvRequest(env_id or shape.env_id, baseline, LIMITS, Owner("long-home"), 300)


async def check(driver: QemuDriver | GvisorDriver, env: Env) -> None:
    """The env answers, is destroyed and confirmed absent."""
    try:
        assert (await env.exec(["true"], timeout_s=60)).exit_code == 0
    finally:
        report = await env.aclose()
    assert report.confirmed_absent, report
    assert_gone(driver, env.env_id)


async def test_cold_clone_spare_and_fork_under_a_200_character_home(
    long_home: Path, tiny_baseline: Baseline
) -> None:
    assert paths.home() == long_home and str(paths.run_dir()).startswith(str(long_home))
    cold = QemuDriver(start="cold")
    await check(cold, await cold.create(request(tiny_baseline)))

    driver = QemuDriver(start="snapshot")
    driver.keep_spares(1)
    first_id = driver.next_env_id(tiny_baseline, LIMITS)
    clone = await driver.create(request(tiny_baseline, first_id))  # the template (QMP) first
    assert clone.info.start_kind == "snapshot", clone.info.start_note
    await check(driver, clone)

    await driver.spares.settled()
    spare_id = driver.next_env_id(tiny_baseline, LIMITS)
    spare = await driver.create(request(tiny_baseline, spare_id))
    assert spare.info.spare_s is not None, driver.spares.last_error
    await check(driver, spare)
    assert all(r.confirmed_absent for r in await driver.release_spares())

    sid = new_snapshot_id()
    parent = await driver.fork_parent(request(tiny_baseline), sid)
    try:
        snap = await driver.fork_save(parent, sid)  # QMP over its socket pair
        child = await driver.fork_clone(request(tiny_baseline), snap)
    finally:
        await parent.aclose()
    assert child.info.start_kind == "fork"
    await check(driver, child)
    assert await driver.delete_snapshot(sid)
    assert driver.list_owned() == []


async def test_an_egress_vm_gets_out_under_a_200_character_home(
    long_home: Path, tiny_baseline: Baseline, tmp_path: Path
) -> None:
    hits: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append(await reader.read(100))
        writer.write(b"echo:" + hits[-1])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    baseline = with_network(tiny_baseline, [f"allowed.test:{port}"], tmp_path)
    probe = {"kind": "connect", "target": f"allowed.test:{port}", "send": "hi"}
    manifest = Manifest.model_validate(
        {
            "episode_id": "egress",
            "seed": 1,
            "policy": {"id": "p"},
            "task": {"mode": "egress", "probes": [probe]},
        }
    )
    options = RunOptions(parallel=1, egress_hosts={"allowed.test": "127.0.0.1"})
    driver = QemuDriver()
    try:
        with Ledger(tmp_path / "ledger.db") as ledger:
            ctl = Controller(driver, ledger, LocalStore(tmp_path / "store"), options=options)
            result = await ctl.run([manifest], baseline, run_id="long-egress")
            vmkit.assert_nothing_left(driver, ledger, "long-egress")
    finally:
        server.close()
    record = result.episodes[0].record
    assert record is not None, result.episodes[0].error
    assert record["info"]["results"] == ["HTTP/1.1 200 Connection established | echo:hi"]
    assert hits == [b"hi"]


async def test_a_gvisor_sandbox_under_a_200_character_home(
    long_home: Path, tiny_baseline: Baseline, gvisor_usable: None
) -> None:
    driver = GvisorDriver()
    assert str(driver.run_root).startswith(str(long_home))
    env = await driver.create(request(tiny_baseline))
    socket_dir = sockets.env_dir(env.env_id)
    assert len(str(socket_dir / "ctl.sock")) < 100 and socket_dir.is_dir()
    assert os.stat(socket_dir.parent).st_mode & 0o777 == 0o700
    await check(driver, env)
    assert not socket_dir.exists()
