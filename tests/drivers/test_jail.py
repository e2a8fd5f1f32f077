"""The jailed QEMU (issue 15 §7), on real VMs: each QEMU runs as a uid of its own from the
reserved range, with no capability, ``NoNewPrivs`` and seccomp, chrooted into an empty per-env
folder, in cgroups whose memory and pids limits come from the manifest plus the VMM's share;
provenance says so; the deadman still works across the uid change (a SIGKILLed controller's
jailed QEMU is gone within about a second, where the old supervisor left it running: the
kernel clears a parent-death signal when the process changes uid); and the uid allocator
never hands out a uid that is locked, in use, or anyone's. Before this, QEMU ran as root with
seccomp only."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.drivers.qemu.jail import VMM_OVERHEAD_MIB, env_limits
from cleanroom.host import cgroups, hostproc, jail

from ..vmkit import request

ROOT = Path(__file__).resolve().parents[2]


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _qemu_pid(env_pid: int) -> int:
    """The QEMU process below the env's supervisor (``timeout``)."""
    for pid in [env_pid, *hostproc.descendants(env_pid)]:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().startswith("qemu-system"):
                return pid
    raise AssertionError(f"no QEMU below pid {env_pid}")


@pytest.fixture
def driver() -> Iterator[QemuDriver]:
    why = jail.unavailable()
    if why is not None:
        pytest.skip(f"no VMM jail on this host: {why}")
    yield QemuDriver(start="auto")


@pytest.mark.vm
async def test_each_qemu_runs_jailed_as_its_own_uid(
    driver: QemuDriver, tiny_baseline: Baseline
) -> None:
    """A cold boot and a clone (a template's build VM before it): QEMU's uid, gid and groups
    are one uid of the range, CapEff/CapPrm 0, NoNewPrivs 1, Seccomp 2, its root the empty
    per-env folder, the limits written where provenance says; the guest still runs commands;
    destroy leaves no chroot folder, cgroup or lock held."""
    cold = QemuDriver(start="cold")
    envs = [await cold.create(request(tiny_baseline)), await driver.create(request(tiny_baseline))]
    uids = []
    try:
        for env in envs:
            facts = env.info.start_facts()["jail"]
            qemu = _qemu_pid(env.info.pid or 0)
            status = _status(qemu)
            uid = facts["uid"]
            low, high = jail.configured_range() or (0, -1)
            assert low <= uid <= high and facts["gid"] == uid
            assert status["Uid"].split() == [str(uid)] * 4
            assert status["Gid"].split() == [str(uid)] * 4
            assert status["Groups"].split() == [str(uid)]
            assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
            assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
            chroot = Path(facts["chroot"])
            assert os.readlink(f"/proc/{qemu}/root") == str(chroot)
            assert chroot.parent == env.info.run_dir and list(chroot.iterdir()) == []
            assert chroot.stat().st_uid == 0 and chroot.stat().st_mode & 0o777 == 0o700
            limits = env_limits(request(tiny_baseline))
            assert facts["limits"] == {"memory_bytes": limits.memory_bytes, "pids": limits.pids}
            assert limits.memory_bytes == (256 + VMM_OVERHEAD_MIB) << 20
            for folder in facts["limit_cgroups"]:  # hybrid host: v1 memory and pids cgroups
                assert qemu in {int(p) for p in (Path(folder) / "cgroup.procs").read_text().split()}
                if "/memory/" in folder:
                    assert (Path(folder) / "memory.limit_in_bytes").read_text().strip() == str(
                        limits.memory_bytes
                    )
                if "/pids/" in folder:
                    assert (Path(folder) / "pids.max").read_text().strip() == str(limits.pids)
            if cgroups.detect() is not None and os.path.isdir("/sys/fs/cgroup/memory"):
                assert facts["enforced"]["memory"].startswith(("v1", "v2"))
            result = await env.exec(["sh", "-c", "echo jailed"])
            assert result.stdout == b"jailed\n"
            uids.append(uid)
        assert len(set(uids)) == len(uids)  # one uid per env
    finally:
        reports = [await env.aclose() for env in envs]
    assert all(r.confirmed_absent for r in reports)
    for env in envs:
        assert not (env.info.run_dir or Path("/nonexistent")).exists()
        for folder in env.info.start_facts()["jail"]["limit_cgroups"]:
            assert not Path(folder).exists()
    for uid in uids:  # the uid is free again: its lock can be taken
        fd = jail._try_lock(uid)
        assert fd is not None
        os.close(fd)


CHILD = """
import asyncio, json, sys, time
sys.path.insert(0, {root!r})
from cleanroom.baseline.store import resolve
from cleanroom.drivers.qemu import QemuDriver
from tests.vmkit import request
async def main():
    driver = QemuDriver(start="cold")
    env = await driver.create(request(resolve({digest!r})))
    qmp = await driver.ctx.live[env.env_id].open_qmp()
    await qmp.execute("stop")  # a paused guest cannot end its VM itself once the host is gone
    facts = {{"pid": env.info.pid, "uid": env.info.jail["uid"], "env_id": env.env_id}}
    print(json.dumps(facts), flush=True)
    time.sleep(600)
asyncio.run(main())
"""


@pytest.mark.vm
def test_a_sigkilled_controllers_jailed_qemu_dies_with_it(
    driver: QemuDriver, tiny_baseline: Baseline
) -> None:
    """A controller process holding a jailed VM is SIGKILLed: its QEMU (running as a jail
    uid) is gone within seconds (a few ms here), not left running: before, the parent-death
    signal was lost with QEMU's uid change and the jailed VM outlived its controller. The VM is
    paused first: a running guest's agent ends its VM when the host goes away (which would
    hide a lost deadman); a hostile one would not."""
    code = CHILD.format(root=str(ROOT), digest=tiny_baseline.digest)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    qemu, env_id = 0, ""
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, "the child controller did not start its VM"
        env = json.loads(line)
        qemu, env_id = _qemu_pid(env["pid"]), env["env_id"]
        assert _status(qemu)["Uid"].split()[0] == str(env["uid"])  # the precondition: jailed
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed = time.monotonic()
        while hostproc.pid_alive(qemu) and time.monotonic() - killed < 10:
            time.sleep(0.005)
        gone_s = time.monotonic() - killed
        assert not hostproc.pid_alive(qemu), "the jailed QEMU outlived its controller"
        print(f"jailed QEMU gone {gone_s * 1000:.0f} ms after its controller's SIGKILL")
    finally:
        child.kill()
        child.wait()
        if qemu and hostproc.pid_alive(qemu):
            os.kill(qemu, signal.SIGKILL)
        if env_id:  # what the dead controller left (run folder, cgroups) is reap's: here
            assert asyncio.run(QemuDriver(start="cold").destroy(env_id)).confirmed_absent


# -- the uid allocator (fast: a range of its own, a lock folder in tmp) -------------------------


@pytest.fixture
def small_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    if os.geteuid() != 0:
        pytest.skip("the jail needs a root controller")
    start = 2_100_070_000 + os.getpid() % 1000 * 8
    monkeypatch.setenv(jail.SWITCH_ENV, f"{start}-{start + 3}")
    monkeypatch.setattr(jail, "LOCK_DIR", tmp_path / "locks")
    return start, start + 3


def test_a_locked_uid_is_never_handed_out_twice(small_range: tuple[int, int]) -> None:
    """Four uids, four leases, all different; a fifth is a typed ConfigError naming the range;
    a closed lease's uid is free again (the lock is what holds it)."""
    from cleanroom.errors import ConfigError

    leases = [jail.allocate() for _ in range(4)]
    assert sorted(lease.uid for lease in leases) == list(range(small_range[0], small_range[1] + 1))
    with pytest.raises(ConfigError, match=f"{small_range[0]}-{small_range[1]}"):
        jail.allocate()
    leases[2].close()
    again = jail.allocate()
    assert again.uid == leases[2].uid
    for lease in [*leases, again]:
        lease.close()


def test_a_uid_someone_uses_or_owns_is_skipped(
    small_range: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A uid a process runs as (say a VMM that unlocked its inherited lock), one inside a
    subordinate range of /etc/subuid, and one with a passwd entry are never handed out."""
    start = small_range[0]
    monkeypatch.setattr(jail, "uids_in_use", lambda: {start, os.geteuid()})
    monkeypatch.setattr(jail, "_subordinate_ranges", lambda: [(start + 1, start + 1)])
    real = jail.pwd.getpwuid

    def getpwuid(uid: int) -> object:
        if uid == start + 2:
            return object()
        return real(uid)

    monkeypatch.setattr(jail.pwd, "getpwuid", getpwuid)
    lease = jail.allocate()
    try:
        assert lease.uid == start + 3
    finally:
        lease.close()


def test_a_malformed_range_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CLEANROOM_JAIL_UIDS`` that is not START-END (or reaches root's uids) is refused with
    the variable named; ``off`` switches the jail off and says so."""
    from cleanroom.errors import ConfigError

    for bad in ("lots", "5-3", "0-100", "1000-4294967295"):
        monkeypatch.setenv(jail.SWITCH_ENV, bad)
        with pytest.raises(ConfigError, match=jail.SWITCH_ENV):
            jail.configured_range()
    monkeypatch.setenv(jail.SWITCH_ENV, "off")
    assert "off" in (jail.unavailable() or "")


def test_an_egress_vm_runs_unjailed_and_says_why(tmp_path: Path) -> None:
    """A networked env gets no jail uid or chroot (its slirp helper must run the host's Python
    and pass the proxy's peer-uid check: unjailed, that broke every guest connection), and its
    provenance says so; a plain env of the same request gets both."""
    import dataclasses

    from cleanroom.drivers.qemu.jail import EGRESS, Jail
    from cleanroom.network.qemu_args import Attachment

    from ..conftest import make_fake_baseline

    if jail.unavailable() is not None:
        pytest.skip(f"no VMM jail on this host: {jail.unavailable()}")
    plain = request(make_fake_baseline(tmp_path))
    networked = dataclasses.replace(plain, network=Attachment("sock", ()))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    egress = Jail.open(networked, tmp_path / "a")
    assert egress.args is None and egress.why == EGRESS
    assert EGRESS in egress.facts(networked)["user"]
    jailed = Jail.open(plain, tmp_path / "b")
    try:
        assert jailed.args is not None and jailed.args.chroot == tmp_path / "b" / "root"
        assert jailed.facts(plain)["uid"] == jailed.args.uid
    finally:
        jailed.spawned()
