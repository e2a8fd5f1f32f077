"""What the gvisor driver hands to ``runsc``: a cached root tree and one OCI bundle per env.

runsc cannot mount an erofs image, so a baseline's ``rootfs.erofs`` is extracted once
(``fsck.erofs --extract``, well under a second) into ``$CLEANROOM_HOME/cache/gvisor-rootfs/<hex>/``
(``<hex>`` = the baseline digest). Before extraction the image is re-hashed against the
component digest the baseline digest covers; after it, the spec's mount points are created in
the tree (else runsc's gofer adds them at the first start) and a stat fingerprint of the whole
tree (path, mode, owner, size, mtime of every entry) is written next to it. The first use in a
process re-walks the tree and compares: a tree that no longer matches is moved aside (sandboxes
may still run on it) and extracted again from the (verified) image. Trees unused for a week (a
day if their baseline was deleted) are removed when another is extracted. The tree is shared
read-only by every env of that baseline: runsc's ``--overlay2=root:memory`` puts each sandbox's
writes in its own memory, which dies with the sandbox, so nothing an episode does reaches it.

``oci_spec`` writes the per-env ``config.json``: the agent as PID 1 (the static native binary,
a component of the baseline); ``/proc``,
``/sys``, ``/dev`` (with ``/dev/shm``), a tmpfs ``/run`` and ``/tmp``; the host folder holding
the agent socket bind-mounted at ``GUEST_CTL_DIR``; an empty network namespace; cgroup limits
(memory, CPU quota, pids) from the episode's limits.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from cleanroom.agent import native
from cleanroom.baseline.pyinstall import AGENT_DEST
from cleanroom.core.baseline_model import ROOTFS_FILE, Baseline
from cleanroom.drivers.base import EnvRequest
from cleanroom.errors import DriftError, LaunchError
from cleanroom.host import paths
from cleanroom.host.digests import sha256_file

GUEST_CTL_DIR = "/run/cleanroom-ctl"
SOCKET_NAME = "ctl.sock"
CGROUP_PARENT = "cleanroom"
TREE_FILE = "tree.json"
NATIVE_AGENT = f"/{AGENT_DEST}/{native.BINARY}"  # what a native /init switches to, too
# Docker's default set without NET_RAW: root in the sandbox, checked by gVisor's own kernel.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
]
STALE_AFTER_S = 7 * 86400  # a tree no env used for a week is removed at the next extraction
BASELINE_GONE_S = 86400  # ... or after a day, if its baseline was deleted from the store
PIDS_LIMIT = 4096  # host processes of the sandbox (ptrace stubs) and its gofer
MOUNT_POINTS = ("/proc", "/dev", "/dev/shm", "/sys", "/run", "/tmp", GUEST_CTL_DIR)

_verified: set[str] = set()  # digests whose tree this process has checked


def cache_root() -> Path:
    return paths.cache_dir() / "gvisor-rootfs"


def tree_dir(baseline: Baseline) -> Path:
    """The folder of a baseline's cached root tree (``rootfs/`` and ``tree.json`` inside)."""
    return cache_root() / baseline.digest.removeprefix("sha256:")


def fingerprint(tree: Path) -> str:
    """sha256 over path, type/mode, owner, size and mtime of every entry (sorted, links kept)."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, tree)
        for name in sorted(dirnames + filenames):
            st = os.lstat(os.path.join(dirpath, name))
            digest.update(
                f"{rel_dir}/{name}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0"
                f"{st.st_size}\0{st.st_mtime_ns}\n".encode()
            )
    return digest.hexdigest()


def _expected_rootfs_sha(baseline: Baseline) -> str:
    for component in baseline.components:
        if component.name == ROOTFS_FILE:
            return component.sha256
    raise LaunchError(f"baseline {baseline.short} has no {ROOTFS_FILE}: it cannot run under gVisor")


def _tree_ok(folder: Path, baseline: Baseline, *, deep: bool) -> bool:
    try:
        meta = json.loads((folder / TREE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if meta.get("digest") != baseline.digest or not (folder / "rootfs").is_dir():
        return False
    return not deep or meta.get("fingerprint") == fingerprint(folder / "rootfs")


def make_mount_points(tree: Path) -> None:
    """Create the spec's mount points in the tree before it is fingerprinted (else runsc's gofer
    creates them at the first start and the tree no longer matches). Never through a link."""
    for point in MOUNT_POINTS:
        current = tree
        for part in point.strip("/").split("/"):
            current = current / part
            if current.is_symlink():
                break
            if not current.exists():
                current.mkdir(mode=0o755)


def _extract(folder: Path, baseline: Baseline) -> None:
    """Verify the image, extract it to a scratch folder, fingerprint it, move it in place."""
    image = baseline.path / ROOTFS_FILE
    expected = _expected_rootfs_sha(baseline)
    if sha256_file(image) != expected:
        raise DriftError(baseline.digest, [ROOTFS_FILE])
    folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        proc = subprocess.run(
            ["fsck.erofs", f"--extract={scratch / 'rootfs'}", "--preserve", str(image)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise LaunchError(f"fsck.erofs --extract failed: {proc.stderr.strip()[-500:]}")
        make_mount_points(scratch / "rootfs")
        meta = {
            "digest": baseline.digest,
            "rootfs_sha256": expected,
            "fingerprint": fingerprint(scratch / "rootfs"),
        }
        (scratch / TREE_FILE).write_text(json.dumps(meta, indent=1))
        if folder.exists():  # a drifted tree: sandboxes may still run on it, so only move it
            os.rename(folder, folder.with_name(f"{folder.name}.stale-{secrets.token_hex(4)}"))
        os.rename(scratch, folder)
    except FileNotFoundError as exc:
        raise LaunchError(f"cannot extract the root tree ({exc}); install erofs-utils") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _ensure_tree_sync(baseline: Baseline) -> Path:
    folder = tree_dir(baseline)
    folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one extraction at a time across processes
        deep = baseline.digest not in _verified
        if not _tree_ok(folder, baseline, deep=deep):
            _extract(folder, baseline)
            prune_stale_trees(keep=folder)
        _verified.add(baseline.digest)
        os.utime(folder / TREE_FILE)  # last use, for pruning
    return folder / "rootfs"


def prune_stale_trees(keep: Path, unused_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove cached trees unused for ``unused_s`` (no env can still run on them: hard
    deadlines are far shorter), trees whose baseline is gone from the store (drifted trees moved
    aside included) after a day, and dead scratch folders; the caller holds the cache lock.
    Returns what was removed."""
    removed = []
    now = time.time()
    for folder in cache_root().iterdir():
        if folder == keep or not folder.is_dir():
            continue
        if ".tmp-" in folder.name:  # an extraction that died (we hold the lock)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            continue
        try:
            last_use = (folder / TREE_FILE).stat().st_mtime
        except FileNotFoundError:
            last_use = 0.0  # a partial tree
        baseline_gone = not (paths.baselines_dir() / folder.name).is_dir()
        if now - last_use > unused_s or (baseline_gone and now - last_use > BASELINE_GONE_S):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


async def ensure_tree(baseline: Baseline) -> Path:
    """The baseline's verified, extracted root tree (extracted on first use, then cached).

    Concurrent callers (threads or processes) are serialised by an ``flock`` on the cache.
    """
    return await asyncio.to_thread(_ensure_tree_sync, baseline)


def cgroup_path(container_id: str) -> str:
    return f"/{CGROUP_PARENT}/{container_id}"


def cgroup_leaves(container_id: str) -> list[Path]:
    """The env's cgroup folders that still exist (v1: one per controller; v2: one)."""
    root = Path("/sys/fs/cgroup")
    candidates = [root / CGROUP_PARENT / container_id]
    candidates += root.glob(f"*/{CGROUP_PARENT}/{container_id}")
    return [c for c in candidates if c.is_dir()]


def agent_args(baseline: Baseline) -> list[str]:
    """PID 1 of the sandbox: the baseline's agent (the native binary, a component of the
    baseline). A baseline without one was built for the removed Python agent: LaunchError."""
    if baseline.agent_sha256 is None:
        raise LaunchError(
            f"baseline {baseline.short}: built for the removed Python guest "
            "agent (no native agent component); rebuild it with `cleanroom build`"
        )
    return [NATIVE_AGENT]


def oci_spec(request: EnvRequest, rootfs: Path, ctl_dir: Path, container_id: str) -> dict[str, Any]:
    """The OCI runtime spec of one env: the agent as PID 1 in a fresh sandbox."""
    limits = request.limits
    tmpfs_opts = ["nosuid", "nodev"]
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": agent_args(request.baseline),
            "env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME=/root",
                "LANG=C.UTF-8",
                f"CLEANROOM_AGENT_SOCKET={GUEST_CTL_DIR}/{SOCKET_NAME}",
            ],
            "cwd": "/",
            "capabilities": {
                key: CAPABILITIES for key in ("bounding", "effective", "permitted", "inheritable")
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},  # writes go to the memory overlay
        "hostname": "cleanroom",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": tmpfs_opts},
            {"destination": "/run", "type": "tmpfs", "source": "tmpfs", "options": tmpfs_opts},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmpfs_opts},
            {
                "destination": GUEST_CTL_DIR,
                "type": "bind",
                "source": str(ctl_dir),
                "options": ["rbind", "ro"],
            },
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "cgroupsPath": cgroup_path(container_id),
            "resources": {
                "memory": {"limit": limits.memory_mib * 1024 * 1024},
                "cpu": {"quota": limits.vcpus * 100_000, "period": 100_000},
                "pids": {"limit": PIDS_LIMIT},
            },
        },
    }


def write_bundle(bundle: Path, spec: dict[str, Any]) -> None:
    bundle.mkdir(mode=0o700)
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
