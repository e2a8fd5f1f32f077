"""Snapshot templates for the qemu driver: a baseline booted once, saved, restored per episode.

A template is a VM booted to a ready agent with its guest RAM in a file, saved with the
migration capability ``x-ignore-shared`` (so the state file holds only device state, not RAM;
the migration stops the VM last, so the state says "running"). A clone is a new QEMU process
with the same devices that maps the same RAM file *privately* (``share=off``: copy-on-write,
untouched pages shared by every clone through the page cache), starts with ``-incoming defer``
and a monitor that already holds ``restore_script`` (``migrate-incoming fd:N``), and runs as
soon as the state is loaded: no round trip to the host on the way.

On disk, ``$CLEANROOM_HOME/templates/<key>/`` holds ``ram``, ``state`` and ``template.json``
(the key's facts and the size and sha256 of every file; its ``digest`` covers all of it). The
key hashes the baseline digest, the QEMU version, the accelerator and the machine's command
line, so a change in any of them makes a new template. A saved template is immutable: files
read-only, verified by full hash on first use in a process and by ``stat`` (size, mtime,
ctime; re-hash when one moved) before every clone. A modified file raises ``DriftError``
naming it; the driver then rebuilds the template.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qmp import QmpClient
from cleanroom.drivers.qmp import script as qmp_script
from cleanroom.errors import CleanroomError, DriftError, DriverError
from cleanroom.host import digests, hostproc, paths
from cleanroom.host.digests import digest_of, sha256_file

if TYPE_CHECKING:
    from cleanroom.agent.connection import AgentConnection

FORMAT = 3  # 3: the guest caches warmed before the save; 2: saved running (1 stayed paused)
META_FILE = "template.json"
RAM_FILE = "ram"
STATE_FILE = "state"
FILES = (RAM_FILE, STATE_FILE)
MIN_AGENT = (0, 2)  # the first agent that understands SNAPSHOT_PREPARE and RESEED
SAVE_TIMEOUT_S = 60.0
KEEP = 8  # templates kept on disk (newest first); older ones are removed when one is saved
IGNORE_SHARED = {"capabilities": [{"capability": "x-ignore-shared", "state": True}]}

_verified: dict[str, tuple[digests.Signature, ...]] = {}  # path -> stat signature hashed OK


def templates_dir() -> Path:
    return paths.home() / "templates"


def qemu_opt(value: object) -> str:
    """A value inside a QEMU ``key=value,...`` option (commas are doubled)."""
    return str(value).replace(",", ",,")


def memory_args(ram: Path, memory_mib: int, *, shared: bool) -> list[str]:
    """Guest RAM in ``ram``: ``shared`` for the template, private copy-on-write for a clone."""
    share = "on" if shared else "off"
    spec = f"memory-backend-file,id=mem,size={memory_mib}M,mem-path={qemu_opt(ram)},share={share}"
    return ["-object", spec]


def template_key(baseline: Baseline, qemu_version: str, accel: str, machine: list[str]) -> str:
    """Which template a VM with this baseline, QEMU, accelerator and command line can use."""
    facts = {"format": FORMAT, "baseline": baseline.digest, "qemu": qemu_version, "accel": accel}
    canonical = json.dumps({**facts, "machine": machine}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def agent_supports_snapshots(hello: dict[str, Any]) -> bool:
    version = str(hello.get("agent_version", "0"))
    try:
        parts = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return parts >= MIN_AGENT


@dataclass(frozen=True)
class Template:
    """A saved, immutable template."""

    key: str
    path: Path
    digest: str  # "sha256:<hex>" over template.json's canonical content
    memory_mib: int
    files: dict[str, dict[str, Any]]  # name -> {"size", "sha256"}
    facts: dict[str, Any]

    @property
    def ram(self) -> Path:
        return self.path / RAM_FILE

    @property
    def state(self) -> Path:
        return self.path / STATE_FILE


def _signature(path: Path) -> tuple[digests.Signature, ...]:
    return tuple(digests.signature((path / name).stat()) for name in (*FILES, META_FILE))


def _drifted(path: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    bad = []
    for name in FILES:
        want = files.get(name, {})
        try:
            ok = (path / name).stat().st_size == want.get("size") and sha256_file(
                path / name
            ) == want.get("sha256")
        except OSError:
            ok = False
        if not ok:
            bad.append(name)
    return bad


def _read_meta(path: Path, key: str) -> Template:
    try:
        data = json.loads((path / META_FILE).read_text())
        body = {k: data[k] for k in ("format", "key", "memory_mib", "files", "facts")}
        template = Template(
            key=data["key"],
            path=path,
            digest=data["digest"],
            memory_mib=int(data["memory_mib"]),
            files=dict(data["files"]),
            facts=dict(data["facts"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DriftError(f"template {key}", [META_FILE]) from exc
    if template.key != key or digest_of(body) != template.digest or body["format"] != FORMAT:
        raise DriftError(f"template {key}", [META_FILE])
    return template


def load(key: str) -> Template | None:
    """The saved template for ``key``, checked; None if there is none.

    Raises ``DriftError`` naming every file that no longer matches its recorded sha256. The
    full hash runs once per process (and again whenever a file's stat signature moved).
    """
    path = templates_dir() / key
    if not (path / META_FILE).is_file():
        return None
    try:
        template = _read_meta(path, key)
        sig = _signature(path)
    except (DriftError, OSError) as exc:
        if not path.exists():
            return None  # removed under us (pruned or discarded by another process)
        if isinstance(exc, DriftError):
            raise
        raise DriftError(f"template {key}", [Path(str(exc.filename)).name]) from exc
    if _verified.get(str(path)) != sig:
        drifted = _drifted(path, template.files)
        if drifted:
            _verified.pop(str(path), None)
            raise DriftError(f"template {key}", drifted)
        _verified[str(path)] = sig
    return template


def discard(key: str) -> None:
    """Remove a (drifted) template so it can be rebuilt."""
    path = templates_dir() / key
    _verified.pop(str(path), None)
    trash = path.with_name(f".trash-{key}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        return  # already gone (another process got there first)
    shutil.rmtree(trash, ignore_errors=True)


def prune(keep: int = KEEP, spare: str | None = None) -> list[str]:
    """Remove all but the ``keep`` newest templates (and ``spare``); returns the removed keys.

    Safe for running clones (their QEMU keeps the mapped RAM file alive); a clone starting
    from a template removed under it fails and is retried cold (``auto``) or rebuilt.
    """
    root = templates_dir()
    found = []
    for meta in root.glob(f"*/{META_FILE}") if root.is_dir() else []:
        with contextlib.suppress(OSError):
            found.append((meta.stat().st_mtime, meta.parent.name))
    found.sort(reverse=True)
    removed = [key for _, key in found[keep:] if key != spare]
    for key in removed:
        discard(key)
    return removed


def build_dir(key: str) -> Path:
    """A fresh scratch folder for building ``key`` (stale ones of dead builders are removed)."""
    root = templates_dir()
    root.mkdir(parents=True, exist_ok=True)
    for stale in [*root.glob(f".build-{key}-*"), *root.glob(".trash-*")]:
        pid = stale.name.split("-")[-1 if stale.name.startswith(".build-") else -2]
        if pid.isdigit() and not hostproc.pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)  # left by a builder that died
    work = root / f".build-{key}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(mode=0o700)
    return work


def seal(work: Path, key: str, memory_mib: int, facts: dict[str, Any]) -> Template:
    """Hash and freeze a finished build, then move it to its key (atomic rename).

    If another builder sealed the same key first, its template is kept and ours discarded.
    """
    files = {}
    for name in FILES:
        path = work / name
        with path.open("rb+") as f:
            os.fsync(f.fileno())
        files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    body = {"format": FORMAT, "key": key, "memory_mib": memory_mib, "files": files, "facts": facts}
    meta = {**body, "digest": digest_of(body)}
    (work / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    for name in (*FILES, META_FILE):
        (work / name).chmod(0o444)
    final = templates_dir() / key
    try:
        os.replace(work, final)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)  # a concurrent builder won
    prune(keep=KEEP, spare=key)
    loaded = load(key)
    if loaded is None:
        raise DriverError(f"template {key} vanished right after it was saved")
    return loaded


@contextlib.asynccontextmanager
async def build_lock(key: str, timeout_s: float) -> Any:
    """Cross-process lock on building ``key`` (flock on ``templates/.lock-<key>``)."""
    root = templates_dir()
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / f".lock-{key}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    end = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise DriverError(f"template {key} is being built by another process") from None
                await asyncio.sleep(0.05)
        yield
    finally:
        os.close(fd)


async def save(qmp: QmpClient, state_fd: int, timeout_s: float = SAVE_TIMEOUT_S) -> float:
    """Write the VM's device state to ``state_fd`` (RAM stays in its file).

    The VM is not paused first: the migration stops it at its end (so RAM and state match)
    and records it as running, which makes every clone run as soon as it is loaded. Returns
    the seconds the migration took; raises DriverError if it fails or times out.
    """
    started = time.monotonic()
    await qmp.execute("migrate-set-capabilities", IGNORE_SHARED)
    await qmp.send_fd("template-state", state_fd)
    await qmp.execute("migrate", {"uri": "fd:template-state"})
    delay = 0.002
    while True:
        info = await qmp.execute("query-migrate")
        status = info.get("status") if isinstance(info, dict) else None
        if status == "completed":
            return time.monotonic() - started
        if status in ("failed", "cancelled"):
            raise DriverError(f"saving the template failed: {info.get('error-desc', status)}")
        if time.monotonic() - started > timeout_s:
            raise DriverError(f"saving the template took over {timeout_s:.0f}s ({status})")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


RESTORE_COMMANDS = ("migrate-set-capabilities", "migrate-incoming")


def restore_script(state_fd: int) -> bytes:
    """The monitor commands that load a clone from ``state_fd`` (inherited by QEMU), for
    ``qmp.script``/``qmp.read_answers``: QEMU runs them as soon as it has started. A load
    that fails ends the QEMU process."""
    return qmp_script(
        ("migrate-set-capabilities", IGNORE_SHARED),
        ("migrate-incoming", {"uri": f"fd:{state_fd}"}),
    )


async def prepare(session: AgentConnection, timeout_s: float = 10.0) -> dict[str, Any]:
    """Tell the template's agent a snapshot follows (SNAPSHOT_PREPARE); its OK's header
    (which reseeder will answer the clones' RESEED: ``native`` or ``python``, and why)."""
    try:
        return await asyncio.wait_for(session.snapshot_prepare(), timeout_s)
    except TimeoutError:
        raise DriverError(
            f"the agent did not confirm SNAPSHOT_PREPARE in {timeout_s:.0f}s"
        ) from None
    except (ConnectionError, OSError) as exc:
        raise DriverError(f"agent channel failed during SNAPSHOT_PREPARE: {exc}") from exc
    except CleanroomError as exc:  # the guest broke the protocol, or went silent
        raise DriverError(f"the agent's answer to SNAPSHOT_PREPARE: {exc}") from exc
