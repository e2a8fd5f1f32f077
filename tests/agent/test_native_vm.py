"""A baseline with no Python at all, run by the native agent in real QEMU VMs.

The image is one layer made here: static busybox and its applet links, a tiny shell entrypoint, the
folders the init mounts on. No ``/usr/bin/python3`` (the removed Python agent could not start in
it). Protects: the native agent boots as PID 1 from the initramfs, runs command episodes end to end
through the real controller (reward, artifact, logs, non-zero exit, timeout), answers EXEC/PUT/GET
through the driver, and a clone restored from a snapshot template (RESEED) answers as its own env.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests import vmkit
from tests.agent.test_mux import make_tar
from tests.baseline.conftest import needs_root_tools
from tests.baseline.ociutil import Entry, layer_bytes, layout, tar_folder
from tests.conftest import with_network
from tests.stored import evidence_bytes
from tests.vmkit import Harness, assert_nothing_left, manifest

from cleanroom.agent import native
from cleanroom.baseline.builder import build
from cleanroom.baseline.initramfs import BUSYBOX
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import AGENT_FILE, Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import EnvRequest, Owner
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import GuestUnsafePath
from cleanroom.host.digests import sha256_file
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

pytestmark = [pytest.mark.vm, pytest.mark.build]

APPLETS = ("sh", "cat", "echo", "printf", "sleep", "mkdir", "ls", "true", "head", "grep", "sed")
APPLETS += ("wget",)
ENTRY = b"""#!/bin/sh
# the manifest is compact JSON (as the native agent writes it)
m=$(cat /run/cleanroom/manifest.json)
case "$m" in
  *'"mode":"fail"'*) echo "failing on purpose" >&2; exit 3 ;;
  *'"mode":"sleep"'*) sleep 60 ;;
  *'"mode":"egress"'*)
    o=/run/cleanroom/out; mkdir -p $o
    for k in allowed denied; do
      u=$(echo "$m" | sed -n 's/.*"'$k'":"\\([^"]*\\)".*/\\1/p')
      wget -q -O $o/$k.txt "$u" 2>$o/$k.err; echo "exit $?" >> $o/$k.err
    done
    cat /etc/resolv.conf > $o/resolv.conf; echo "$http_proxy" > $o/proxy
    printf '{"reward": 1}' > /run/cleanroom/result.json; exit 0 ;;
esac
echo "episode says hi"
echo "a warning" >&2
mkdir -p /run/cleanroom/out
echo "made in a busybox guest" > /run/cleanroom/out/hello.txt
python=absent; [ -e /usr/bin/python3 ] && python=present
printf '{"reward": 2, "info": {"python": "%s"}}' "$python" > /run/cleanroom/result.json
"""


def busybox_spec(tmp_path: Path) -> Path:
    """An image of static busybox only, as an OCI archive, and its ``baseline.toml``."""
    if not BUSYBOX.is_file():
        pytest.skip(f"{BUSYBOX} not found (install busybox-static)")
    entries = [Entry(d, "dir", mode=0o755) for d in ("bin", "dev", "etc", "opt", "opt/img")]
    entries += [Entry(d, "dir", mode=0o755) for d in ("proc", "root", "run", "sys", "tmp", "var")]
    entries.append(Entry("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755))
    entries += [Entry(f"bin/{a}", "symlink", link="busybox") for a in APPLETS]
    entries.append(Entry("opt/img/entry.sh", data=ENTRY, mode=0o755))
    config = {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh", "/opt/img/entry.sh"]}
    folder = layout(tmp_path / "layout", [layer_bytes(entries)], config)
    tar_folder(folder, tmp_path / "image.tar")
    spec = tmp_path / "baseline.toml"
    spec.write_text(
        'name = "busybox-native"\n[base]\nimage = "oci-archive:image.tar"\n'
        '[agent]\nkind = "native"\n[limits]\ntimeout_s = 30\nmemory_mib = 256\n'
    )
    return spec


@pytest.fixture(scope="module")
def native_spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return busybox_spec(tmp_path_factory.mktemp("busybox"))


@pytest.fixture(scope="module")
def busybox_baseline(native_spec: Path) -> Baseline:
    needs_root_tools()
    return build(native_spec)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    yield from vmkit.harness(tmp_path, QemuDriver(start="cold"))


def test_the_native_baseline_is_reproducible(busybox_baseline: Baseline, native_spec: Path) -> None:
    """Same sources, same compiler: the same digest (the agent's bytes are in rootfs.erofs)."""
    assert busybox_baseline.agent_version == native.agent_version() == "0.7.1"
    assert build(native_spec, force=True).digest == busybox_baseline.digest


def test_the_agent_binary_is_a_component_of_its_own(
    busybox_baseline: Baseline, tmp_path: Path
) -> None:
    """Its sha256 is in the digest and baseline.json: the bytes a fresh compile gives."""
    fresh = tmp_path / native.BINARY
    subprocess.run(native.gcc_argv(fresh), cwd=native.NATIVE_DIR, check=True)
    component = busybox_baseline.components_by_name(AGENT_FILE)
    assert component is not None and component.sha256 == sha256_file(fresh)
    assert busybox_baseline.agent_sha256 == component.sha256
    assert (busybox_baseline.path / AGENT_FILE).read_bytes() == fresh.read_bytes()


async def test_command_episodes_end_to_end_without_python(
    busybox_baseline: Baseline, harness: Harness
) -> None:
    """Reward from result.json, an artifact, both logs, a non-zero exit, a timeout."""
    ctl, ledger, store, driver = harness
    batch = [
        manifest("ok", 1),
        manifest("fail", 2, mode="fail"),
        manifest("sleep", 3, mode="sleep", limits={"timeout_s": 2}),
    ]
    result = await ctl.run(batch, busybox_baseline, run_id="native-episodes")
    outcomes = {e.episode_id: e.outcome for e in result.episodes}
    assert outcomes == {
        "ok": Outcome.COMPLETED,
        "fail": Outcome.EPISODE_ERROR,
        "sleep": Outcome.TIMEOUT,
    }, [e.error for e in result.episodes]
    record = store.get_record("native-episodes", "ok")
    assert record is not None and record["reward"] == 2.0
    assert record["info"] == {"python": "absent"}
    assert record["provenance"]["agent_version"] == native.agent_version()
    assert record["provenance"]["agent_sha256"] == busybox_baseline.agent_sha256
    assert [a["name"] for a in record["artifacts"]] == ["hello.txt"]
    assert (
        evidence_bytes(store, "native-episodes", "ok", "logs", "stdout.log") == b"episode says hi\n"
    )
    assert evidence_bytes(store, "native-episodes", "ok", "logs", "stderr.log") == b"a warning\n"
    failed = store.get_record("native-episodes", "fail")
    assert failed is not None and failed["exit"]["code"] == 3
    assert_nothing_left(driver, ledger, "native-episodes")


async def test_exec_put_get_on_a_booted_and_a_snapshot_clone(busybox_baseline: Baseline) -> None:
    """The driver's EXEC/PUT/GET on the native agent; then a clone of the template (RESEED:
    its own clone id, its own entropy) serves them too."""
    driver = QemuDriver(start="snapshot")
    limits = vmkit.request(busybox_baseline).limits
    envs = []
    try:
        for _ in range(2):  # the first builds the template (booted), the second is a clone
            envs.append(await driver.create(vmkit.request(busybox_baseline, limits)))
        clone = envs[1]
        assert clone.info.start_kind == "snapshot", clone.info.start_note
        assert clone.hello["clone_id"] == clone.env_id and clone.hello["reseeded"] is True
        assert clone.hello["fast_reseed"] is True  # answered on RESEED's own path (fastseed.c)
        for env in envs:
            await env.put("/tmp/in.bin", bytes(range(256)) * 10)
            assert await env.get("/tmp/in.bin") == bytes(range(256)) * 10
            out = (await env.exec(["head", "-c", "16", "/dev/urandom"], timeout_s=30)).check()
            assert len(out.stdout) == 16
            late = await env.exec(["sleep", "30"], timeout_s=0.5)
            assert late.timed_out
        a = (await envs[0].exec(["head", "-c", "16", "/dev/urandom"], timeout_s=30)).stdout
        b = (await envs[1].exec(["head", "-c", "16", "/dev/urandom"], timeout_s=30)).stdout
        assert a != b
        boot_id = ["cat", "/proc/sys/kernel/random/boot_id"]  # never read before the snapshot
        ids = {(await env.exec(boot_id, timeout_s=30)).check().stdout for env in envs}
        assert len(ids) == 2
    finally:
        for env in envs:
            await env.aclose()


async def test_a_spare_clone_of_a_native_baseline_is_handed_out_ready(
    busybox_baseline: Baseline,
) -> None:
    """A spare (started ahead, paused) resumes under the id it was handed out as."""
    driver = QemuDriver(start="snapshot")
    driver.keep_spares(1)
    limits = vmkit.request(busybox_baseline).limits

    def request_for(env_id: str) -> EnvRequest:
        return EnvRequest(env_id, busybox_baseline, limits, Owner("vm-tests"), hard_deadline_s=300)

    first = await driver.create(request_for(driver.next_env_id(busybox_baseline, limits)))
    await first.aclose()  # the template is built, then a spare of this shape starts
    await driver.spares.settled()
    env_id = driver.next_env_id(busybox_baseline, limits)
    env = await driver.create(request_for(env_id))
    try:
        assert env.info.spare_s is not None, driver.spares.last_error
        assert env.hello["clone_id"] == env_id and env.hello["agent"] == "native"
        assert (await env.exec(["true"], timeout_s=30)).exit_code == 0
    finally:
        assert (await env.aclose()).confirmed_absent
        await driver.release_spares()


async def test_gvisor_runs_the_native_agent_as_pid_1(
    busybox_baseline: Baseline, tmp_path: Path, gvisor_usable: None
) -> None:
    """Under gVisor the sandbox's PID 1 is the native binary on the bind-mounted unix socket
    (the bundle used to start python3, which this image lacks): an episode and an EXEC."""
    driver = GvisorDriver(run_root=tmp_path / "run")
    ledger, store = Ledger(tmp_path / "ledger.db"), LocalStore(tmp_path / "store")
    try:
        ctl = Controller(driver, ledger, store, options=RunOptions(cleanup_window_s=30))
        result = await ctl.run([manifest("gv", 1)], busybox_baseline, run_id="native-gvisor")
        assert [e.outcome for e in result.episodes] == [Outcome.COMPLETED], result.episodes[0].error
        record = store.get_record("native-gvisor", "gv")
        assert record is not None and record["reward"] == 2.0
        assert record["provenance"]["isolation"] == "userspace-kernel"
        assert record["info"] == {"python": "absent"}
        assert_nothing_left(driver, ledger, "native-gvisor")
    finally:
        ledger.close()
    env = await driver.create(vmkit.request(busybox_baseline))
    try:
        assert env.hello["agent"] == "native" and env.hello["pid"] != 1  # the serving child
        assert (await env.exec(["cat", "/proc/1/cmdline"], timeout_s=30)).check().stdout == (
            b"/opt/cleanroom/agent/agent\0"
        )
    finally:
        assert (await env.aclose()).confirmed_absent


async def test_an_egress_allowlist_is_enforced_on_the_native_agents_nic(
    busybox_baseline: Baseline, tmp_path: Path
) -> None:
    """The agent sets up eth0, the route, resolv.conf and the proxy variables (guestnet.py's
    work): busybox wget reaches the allowed server through the host's proxy and not the other."""
    hits: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append((await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")[0])
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 9\r\n\r\nallowed!\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    baseline = with_network(busybox_baseline, [f"allowed.test:{port}"], tmp_path)
    task = {
        "mode": "egress",
        "allowed": f"http://allowed.test:{port}/path",
        "denied": f"http://denied.test:{port}/path",
    }
    options = RunOptions(
        cleanup_window_s=30,
        egress_hosts={"allowed.test": "127.0.0.1", "denied.test": "127.0.0.1"},
    )
    driver = QemuDriver()
    ledger, store = Ledger(tmp_path / "ledger.db"), LocalStore(tmp_path / "store")
    try:
        ctl = Controller(driver, ledger, store, options=options)
        result = await ctl.run([manifest("net", 1, **task)], baseline, run_id="native-net")
        assert_nothing_left(driver, ledger, "native-net")
    finally:
        server.close()
        ledger.close()
    assert [e.outcome for e in result.episodes] == [Outcome.COMPLETED], result.episodes[0].error

    def artifact(name: str) -> bytes | None:
        return store.get_bytes("native-net", "net", f"attempts/1/artifacts/{name}")

    assert artifact("allowed.txt") == b"allowed!\n", artifact("allowed.err")
    assert hits == ["GET /path HTTP/1.1"] or hits == ["GET /path HTTP/1.0"], hits
    assert artifact("denied.txt") in (b"", None) and b"exit 0" not in artifact("denied.err")
    assert artifact("proxy") == b"http://10.0.2.100:3128\n"
    assert b"options use-vc" in artifact("resolv.conf")


async def test_a_native_env_multiplexes_and_moves_folders_as_tar(
    busybox_baseline: Baseline,
) -> None:
    """On a real VM with nothing but busybox: HELLO lists what mux.c serves; a spawned
    ``cat`` echoes its stdin while another command runs; a stream goes up and back; a folder
    goes up as tar and comes back (tar.c: before it, ``Unsupported`` both ways); a member
    out of the folder is ``GuestUnsafePath``; the env stays usable."""
    driver = QemuDriver(start="cold")
    env = await driver.create(vmkit.request(busybox_baseline))
    try:
        features = ["mux", "stdin", "spawn", "pty", "user", "stream", "tar", "fs", "port", "bulk"]
        assert env.hello["features"] == features

        async def chunks() -> AsyncIterator[bytes]:
            yield b"x" * 300_000

        cat = await env.spawn(["cat"], timeout_s=60)
        other = await env.exec(["echo", "meanwhile"], timeout_s=30)
        await cat.write_stdin(b"through cat\n")
        await cat.close_stdin()
        assert (await cat.wait()).check().stdout == b"through cat\n"
        assert other.check().stdout == b"meanwhile\n"
        assert await env.put_stream("/tmp/f", chunks()) == 300_000
        assert await env.get("/tmp/f") == b"x" * 300_000

        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in (("d/a", b"alpha"), ("d/" + "n" * 120, b"x" * 300_000)):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o750
                tar.addfile(info, io.BytesIO(data))

        async def archive(data: bytes) -> AsyncIterator[bytes]:
            yield data

        assert await env.put_tar("/tmp/up", archive(buffer.getvalue())) == len(buffer.getvalue())
        ls = await env.exec(["sh", "-c", "cat /tmp/up/d/a; stat -c %a /tmp/up/d/a"], timeout_s=30)
        assert ls.check().stdout == b"alpha750\n"
        back = bytearray()
        async for piece in env.get_tar("/tmp/up"):
            back.extend(piece)
        with tarfile.open(fileobj=io.BytesIO(bytes(back))) as tar:
            got = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
        assert got == {"d/a": b"alpha", "d/" + "n" * 120: b"x" * 300_000}
        evil = make_tar([(tarfile.TarInfo("../escaped"), b"x")])
        with pytest.raises(GuestUnsafePath):
            await env.put_tar("/tmp/box/dest", archive(evil))
        assert (
            await env.exec(["sh", "-c", "test -e /tmp/box/escaped"], timeout_s=30)
        ).exit_code == 1
        assert (await env.exec(["echo", "still here"], timeout_s=30)).check().stdout == (
            b"still here\n"
        )
    finally:
        assert (await env.aclose()).confirmed_absent
