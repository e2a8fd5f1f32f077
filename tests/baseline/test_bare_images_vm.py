"""Images that give the guest nothing, run as baselines in real QEMU VMs (issue 30: "the agent
needs nothing from the image"); and a guest that does not boot, whose evidence is kept.

- busybox-only: ``/bin/busybox`` alone, no applet links, no ``/dev``, ``/proc``, ``/sys``,
  ``/run``, ``/tmp``, no ``/etc`` at all;
- ``FROM scratch``: one program built by ``gcc -static``, not even a folder entry;
- distroless-like: a static (musl) program, an ``/etc/passwd`` with only ``nonroot`` (no root
  line), its home, ``User: nonroot``, no shell and none of the folders above.

Each builds, and its command episode completes with its durable record: the initramfs makes
the folders the guest mounts on in the overlay (never in the image), the agent makes
``/run/cleanroom``. Before, such an image panicked the guest ("attempted to kill init" after
the agent's "control port did not appear") and the episode ended ``infra_error`` with no
evidence at all.

A baseline whose guest cannot start (its initramfs's ``/init`` exits: the same kernel panic)
ends ``infra_error`` through the command line, with its console kept as
``attempts/1/logs/console.log``; the summary's hint names that file, which exists, and
``cleanroom inspect`` shows the attempt and the logs it kept (exit 2: no durable record).

One VM boot per test (no spares), the baselines built once per module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

from cleanroom.baseline.builder import build
from cleanroom.baseline.initramfs import BUSYBOX, Entry, write_newc
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import (
    INITRD_FILE,
    METADATA_FILE,
    ROOTFS_FILE,
    Baseline,
    Component,
)
from cleanroom.core.states import Outcome
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.host.digests import digest_of
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore
from tests.baseline import testimages
from tests.baseline.conftest import needs_root_tools
from tests.stored import evidence_bytes
from tests.vmkit import Harness, assert_nothing_left, manifest

pytestmark = [pytest.mark.vm, pytest.mark.build]

B = "/bin/busybox"
FIELDS = ("uid", "home", "cwd", "dev_null", "proc", "sys", "tmp_sticky", "tmp_write", "shm")
FORMAT = ", ".join(f'"{name}": ' + ('"%s"' if name in ("home", "cwd") else "%s") for name in FIELDS)
PROBE = f"""
ok() {{ if "$@"; then echo true; else echo false; fi; }}
echo probed > /run/cleanroom/out/probe.txt
printf '{{"reward": 1, "info": {{{FORMAT}}}}}' \\
  "$({B} id -u)" "$HOME" "$PWD" "$(ok [ -c /dev/null ])" "$(ok [ -r /proc/self/status ])" \\
  "$(ok [ -d /sys/class ])" "$(ok [ -k /tmp ])" "$(ok {B} touch /tmp/probe)" \\
  "$(ok {B} grep -q ' /dev/shm tmpfs ' /proc/self/mounts)" > /run/cleanroom/result.json
echo "busybox only"
"""
"""The busybox-only image's entrypoint: what the guest has, as the record's ``info``."""


def _build(folder: Path, name: str, layer: bytes, config: dict[str, Any]) -> Baseline:
    folder.mkdir()
    ref = testimages.save([layer], config, folder, "oci-archive")
    return build(testimages.spec(folder, name, ref))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needs_root_tools()
    return tmp_path_factory.mktemp("bare-images")


@pytest.fixture(scope="module")
def busybox_only(images: Path) -> Baseline:
    config = {"Entrypoint": [B, "sh", "-c", PROBE]}
    return _build(images / "busybox", "busybox-only", testimages.bare_busybox_layer(), config)


@pytest.fixture(scope="module")
def squatted(images: Path) -> Baseline:
    config = {"Entrypoint": [B, "sh", "-c", PROBE]}
    layer = testimages.bare_busybox_layer(squatted=True)
    return _build(images / "squatted", "busybox-squatted", layer, config)


@pytest.fixture(scope="module")
def scratch(images: Path) -> Baseline:
    layer = testimages.scratch_layer(images)
    return _build(images / "scratch", "scratch", layer, {"Entrypoint": ["/entry"]})


@pytest.fixture(scope="module")
def distroless(images: Path) -> Baseline:
    layer = testimages.bare_distroless_layer(images)
    config = {"Entrypoint": ["/app/entry"], "User": "nonroot", "WorkingDir": "/home/nonroot"}
    return _build(images / "distroless", "distroless-bare", layer, config)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    """A controller over a cold-booting qemu driver that keeps no spares (one boot a test)."""
    ledger = Ledger(tmp_path / "ledger.db")
    store = LocalStore(tmp_path / "store")
    driver = QemuDriver(start="cold")
    options = RunOptions(parallel=1, cleanup_window_s=30, spares=0)
    yield Controller(driver, ledger, store, options=options), ledger, store, driver
    ledger.close()


async def _completed(harness: Harness, baseline: Baseline, run_id: str) -> dict[str, Any]:
    ctl, ledger, store, driver = harness
    result = await ctl.run([manifest("ep", 1)], baseline, run_id=run_id)
    assert result.episodes[0].outcome == Outcome.COMPLETED, result.episodes[0].error
    record = store.get_record(run_id, "ep")
    assert record is not None and record["outcome"] == "completed"
    assert_nothing_left(driver, ledger, run_id)
    return record


PROBED = {
    "uid": 0,
    "home": "/root",
    "cwd": "/",
    "dev_null": True,
    "proc": True,
    "sys": True,
    "tmp_sticky": True,
    "tmp_write": True,
    "shm": True,
}
"""What ``PROBE`` finds in a guest that has what it needs."""


async def test_a_busybox_only_image_runs(harness: Harness, busybox_only: Baseline) -> None:
    """No folder, no /etc: the episode sees /dev, /proc, /sys, a sticky writable /tmp and
    /dev/shm, runs as root with HOME /root in /, and its artifact and stdout are kept."""
    record = await _completed(harness, busybox_only, "bare-busybox")
    assert record["info"] == PROBED
    store = harness[2]
    assert evidence_bytes(store, "bare-busybox", "ep", "artifacts", "probe.txt") == b"probed\n"
    assert evidence_bytes(store, "bare-busybox", "ep", "logs", "stdout.log") == b"busybox only\n"


async def test_what_the_guest_mounts_on_may_be_taken(harness: Harness, squatted: Baseline) -> None:
    """A file at /proc, symlinks at /dev and /sys: each is replaced in the overlay (the image
    is untouched) and the guest has what it needs."""
    record = await _completed(harness, squatted, "squatted-busybox")
    assert record["info"] == PROBED


async def test_a_from_scratch_image_runs(harness: Harness, scratch: Baseline) -> None:
    """One static glibc program and nothing else: it runs as root and writes its result."""
    record = await _completed(harness, scratch, "bare-scratch")
    info = record["info"]
    assert (info["uid"], info["gid"], info["home"], info["cwd"]) == (0, 0, "/root", "/")
    assert info["libc"] == "glibc"
    who = evidence_bytes(harness[2], "bare-scratch", "ep", "artifacts", "who.txt")
    assert who == b"uid 0\n"


async def test_a_bare_distroless_image_runs_as_its_user(
    harness: Harness, distroless: Baseline
) -> None:
    """No shell, no root line in /etc/passwd, no guest folders: the program runs as nonroot."""
    record = await _completed(harness, distroless, "bare-distroless")
    assert record["info"] == {
        "uid": 65532,
        "gid": 65532,
        "groups": "65532",
        "home": "/home/nonroot",
        "cwd": "/home/nonroot",
        "libc": "musl",
    }


async def test_gvisor_runs_the_same_baselines(
    tmp_path: Path,
    busybox_only: Baseline,
    scratch: Baseline,
    distroless: Baseline,
    gvisor_usable: None,
) -> None:
    """Under gVisor too (its bundle mounts /proc, /dev, /run, /tmp over the extracted tree):
    each baseline's episode completes as on qemu."""
    driver = GvisorDriver(run_root=tmp_path / "run")
    ledger, store = Ledger(tmp_path / "ledger.db"), LocalStore(tmp_path / "store")
    ctl = Controller(driver, ledger, store, options=RunOptions(parallel=1, cleanup_window_s=30))
    try:
        for baseline, uid in ((busybox_only, 0), (scratch, 0), (distroless, 65532)):
            run_id = f"gvisor-{baseline.name}"
            result = await ctl.run([manifest("ep", 1)], baseline, run_id=run_id)
            [episode] = result.episodes
            assert episode.outcome == Outcome.COMPLETED, (baseline.name, episode.error)
            record = store.get_record(run_id, "ep")
            assert record is not None and record["info"]["uid"] == uid
            assert record["provenance"]["isolation"] == "userspace-kernel"
            assert_nothing_left(driver, ledger, run_id)
    finally:
        ledger.close()


# -- a guest that does not boot ---------------------------------------------------------------

BROKEN_INIT = b"""#!/bin/busybox sh
echo "cleanroom-init: this initramfs starts no agent (a test)"
exit 1
"""


def _broken_initrd() -> bytes:
    """An initramfs whose ``/init`` says so and exits: the kernel panics ("Attempted to kill
    init!"), as a guest whose agent cannot start does."""
    entries = [Entry.dir("bin"), Entry.dir("dev"), Entry.chardev("dev/console", 5, 1)]
    entries += [Entry.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)]
    entries += [Entry.file("init", BROKEN_INIT, 0o755)]
    buf = io.BytesIO()
    write_newc(entries, buf)
    return buf.getvalue()


def _with_file(baseline: Baseline, name: str, data: bytes, home: Path) -> Baseline:
    """``baseline`` with ``data`` as its component ``name``: a baseline of its own (its digest
    covers the new component) in the baseline store of ``home``; the other files copied."""
    component = Component(name, len(data), hashlib.sha256(data).hexdigest())
    parts = tuple(component if c.name == name else c for c in baseline.components)
    derived = dataclasses.replace(baseline, components=parts)
    derived = dataclasses.replace(derived, digest=digest_of(derived.identity()))
    folder = home / "baselines" / derived.digest.removeprefix("sha256:")
    folder.mkdir(parents=True)
    for c in baseline.components:
        if c.name != name:
            shutil.copy(baseline.path / c.name, folder / c.name)
    (folder / name).write_bytes(data)
    derived = dataclasses.replace(derived, path=folder)
    (folder / METADATA_FILE).write_text(json.dumps(derived.to_json()))
    return derived


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CLEANROOM_HOME": str(home), "CI": "true"}
    env["CLEANROOM_QEMU_START"] = "cold"  # no template: one boot
    return subprocess.run(
        [sys.executable, "-m", "cleanroom", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_guest_that_does_not_boot_keeps_its_console_and_the_hint_names_it(
    tmp_path: Path, busybox_only: Baseline
) -> None:
    """``cleanroom run``: ``infra_error`` (launch failed), the console kept as the attempt's
    ``logs/console.log`` (the panic and what /init said), the hint's file exists and holds
    it; ``cleanroom inspect`` shows the attempt (its error, outcome, that log), exit 2."""
    home = tmp_path / "home"
    broken = _with_file(busybox_only, INITRD_FILE, _broken_initrd(), home)
    manifests = tmp_path / "m.jsonl"
    manifests.write_text(json.dumps({"episode_id": "ep", "seed": 1, "policy": {"id": "p"}}))
    ran = _cli(
        home,
        "run",
        str(manifests),
        "--baseline",
        broken.digest,
        "--driver",
        "qemu",
        "--parallel",
        "1",
        "--spares",
        "0",
        "--run-id",
        "noboot",
    )
    said = ran.stdout + ran.stderr
    assert "infra_error" in said, said
    hint = re.search(r"or its console\.log: (\S+)", said)
    assert hint is not None, said
    console = Path(unquote(urlparse(hint.group(1)).path))
    assert console.is_file() and stat.S_ISREG(console.stat().st_mode)
    assert console.parts[-4:] == ("attempts", "1", "logs", "console.log")
    kept = console.read_bytes()
    assert b"this initramfs starts no agent" in kept and b"Attempted to kill init" in kept

    inspect = _cli(home, "inspect", "ep", "--run-id", "noboot")
    assert inspect.returncode == 2, inspect.stderr
    assert "no durable record" in inspect.stderr
    shown = json.loads(inspect.stdout)
    assert shown["record"] is None and shown["run_id"] == "noboot"
    [attempt] = shown["attempts"]
    assert attempt["outcome"] == "infra_error" and attempt["error"].startswith("launch failed")
    assert [log["name"] for log in attempt["logs"]] == ["console.log"]
    assert attempt["logs"][0]["path"] == "attempts/1/logs/console.log"
    assert Path(unquote(urlparse(attempt["evidence"]).path)) == console.parents[1]
    assert not list((home / "run").glob("qemu/env-*"))  # the env is gone


async def test_an_init_step_that_fails_says_so_and_powers_off(
    tmp_path: Path, harness: Harness, busybox_only: Baseline
) -> None:
    """A root image the kernel cannot mount: ``/init`` prints ``cleanroom-init: cannot mount
    root image`` and powers the VM off (no panic); the attempt keeps that console."""
    broken = _with_file(busybox_only, ROOTFS_FILE, b"\0" * 8192, tmp_path / "home")
    ctl, ledger, store, driver = harness
    result = await ctl.run([manifest("ep", 1)], broken, run_id="no-root")
    [episode] = result.episodes
    assert episode.outcome == Outcome.INFRA_ERROR and store.get_record("no-root", "ep") is None
    assert (episode.error or "").startswith("launch failed")
    console = store.get_bytes("no-root", "ep", "attempts/1/logs/console.log")
    assert console is not None and b"cleanroom-init: cannot mount root image" in console
    assert b"Kernel panic" not in console, console[-2000:]
    assert_nothing_left(driver, ledger, "no-root")
