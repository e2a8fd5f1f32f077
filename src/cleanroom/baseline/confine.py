"""The build boundary: every step that touches an image's tree runs here, unprivileged.

An image is untrusted input. Its tree is only ever handled inside a sandbox
(``sandbox_exec.py``): user, mount, PID, IPC, UTS and network namespaces, where namespace root is
a host uid of this build's own range (``BuildIds``: ``BASE .. BASE+65535``, no host user's),
with ``no_new_privs``, a timeout, and one of two roots:

- ``run_in_tree``: the tree *is* ``/`` (the image's own programs: byte-compiling, importing a
  function entrypoint). Nothing of the host is visible; a chroot escape ends in the tree.
- ``run_builder``: a fresh tmpfs with the host's system folders read-only, the tree at
  ``/tree`` and only the paths a step names (``Bind``), for cleanroom's own code
  (``python -m cleanroom.baseline.intree``) and host tools (tar, mkfs.erofs, buildah).

Neither can write a host file outside the folders it was given, and none runs as host root.
Building image baselines therefore needs root on the host (to map the ids); everything else in
the build (fetching, pip downloads, compiling the agent) runs on the host on trusted inputs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cleanroom.baseline.proc import Progress, quiet, tail
from cleanroom.errors import BuildError, ConfigError

LAUNCHER = Path(__file__).with_name("sandbox_exec.py")
ID_BASE = 0x70000000
"""The lowest host uid/gid a build may use: above systemd's container ranges, below 2**31."""
ID_COUNT = 65536
"""Ids each build maps (``0 .. 65535`` inside: every uid an ordinary image uses)."""
ID_SLOTS = 0x0FFF
SANDBOX_FAILED = 125
TREE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
DEFAULT_TIMEOUT_S = 600.0
MAX_STDERR = 1 << 20


@dataclass(frozen=True)
class Bind:
    """A host path shown inside a builder sandbox at ``target``."""

    source: Path
    target: str
    writable: bool = False


@dataclass(frozen=True)
class BuildIds:
    """The host id range of one build: namespace id ``n`` is host id ``base + n``."""

    base: int

    @classmethod
    def fresh(cls) -> BuildIds:
        """A random slot: two builds at once rarely share one, and if they do, each still sees
        only its own namespaces and folders."""
        return cls(ID_BASE + secrets.randbelow(ID_SLOTS) * ID_COUNT)

    def host(self, inside: int) -> int:
        return self.base + inside


@dataclass
class Workspace:
    """One build's private folder (0700, host root): ``tree`` (owned by namespace root),
    ``out`` (the sandbox writes the erofs there), ``stage`` (host-made inputs, read-only
    inside) and ``root`` (the builder sandbox's mount point)."""

    folder: Path
    ids: BuildIds
    timeouts: dict[str, float] = field(default_factory=dict)

    @property
    def tree(self) -> Path:
        return self.folder / "tree"

    @property
    def out(self) -> Path:
        return self.folder / "out"

    @property
    def stage(self) -> Path:
        return self.folder / "stage"

    @property
    def root(self) -> Path:
        return self.folder / "root"


def require_root() -> None:
    if os.geteuid() != 0:
        raise ConfigError(
            "building a baseline confines every step that touches the image in a user "
            "namespace with its own id range, which needs root: run the build as root"
        )


@contextmanager
def workspace(parent: Path) -> Iterator[Workspace]:
    """A fresh ``Workspace`` under ``parent``, removed afterwards (``rmtree`` never follows a
    link the image planted)."""
    require_root()
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="cleanroom-rootfs-", dir=parent))
    ids = BuildIds.fresh()
    try:
        folder.chmod(0o700)
        for name in ("tree", "out", "root"):
            (folder / name).mkdir(mode=0o755)
        for name in ("tree", "out"):
            os.chown(folder / name, ids.base, ids.base)
        (folder / "stage").mkdir(mode=0o755)
        yield Workspace(folder, ids)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def python_binds() -> list[Bind]:
    """What cleanroom's own Python needs inside a builder sandbox: the interpreter's prefix
    and the folder cleanroom is imported from, at the same paths, read-only."""
    import cleanroom

    wanted = {Path(sys.prefix), Path(sys.base_prefix), Path(cleanroom.__file__).parent.parent}
    binds = []
    for path in sorted(wanted):
        if path == Path("/usr") or Path("/usr") in path.parents:
            continue  # the sandbox shows /usr anyway
        binds.append(Bind(path, str(path)))
    return binds


def _relay(stream: IO[bytes], progress: Progress, kept: list[bytes]) -> None:
    """Pass ``progress<TAB>step<TAB>detail`` lines on as they come; keep the rest (bounded)."""
    size = 0
    for line in stream:
        parts = line.rstrip(b"\n").split(b"\t", 2)
        if len(parts) == 3 and parts[0] == b"progress":
            progress(parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace"))
        elif size < MAX_STDERR:
            kept.append(line)
            size += len(line)


def _launch(
    config: dict[str, object],
    argv: Sequence[str],
    step: str,
    timeout_s: float,
    input_bytes: bytes | None,
    ok_codes: tuple[int, ...],
    progress: Progress = quiet,
) -> subprocess.CompletedProcess[bytes]:
    launcher = [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(config), "--", *argv]
    proc = subprocess.Popen(
        launcher,
        stdin=subprocess.PIPE if input_bytes is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    errors, proc.stderr = proc.stderr, None  # read by the relay alone, not by communicate()
    assert errors is not None
    kept: list[bytes] = []
    relay = threading.Thread(target=_relay, args=(errors, progress, kept), daemon=True)
    relay.start()
    try:
        out, _ = proc.communicate(input_bytes, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise BuildError(
            f"{step}: timed out after {timeout_s:g} s (confined step killed)"
        ) from None
    finally:
        relay.join(timeout=5)
        errors.close()
    err = b"".join(kept)
    result = subprocess.CompletedProcess(launcher, proc.returncode, out, err)
    if proc.returncode == SANDBOX_FAILED and b"sandbox:" in err:
        raise BuildError(f"{step}: the build sandbox could not start: {tail(err)}")
    if proc.returncode not in ok_codes:
        detail = tail(err) or tail(out) or "(no output)"
        raise BuildError(f"{step}: {' '.join(argv[:4])} exited with {proc.returncode}:\n{detail}")
    return result


def run_in_tree(
    ws: Workspace,
    argv: Sequence[str],
    step: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ok_codes: tuple[int, ...] = (0,),
) -> subprocess.CompletedProcess[bytes]:
    """Run the image's own ``argv`` with the tree as ``/``, as namespace root, no network."""
    config: dict[str, object] = {
        "base": ws.ids.base,
        "count": ID_COUNT,
        "tree": str(ws.tree),
        "env": dict(env if env is not None else TREE_ENV),
        "rlimits": {"nproc": 4096, "nofile": 4096},
    }
    return _launch(config, argv, step, timeout_s, None, ok_codes)


def run_builder(
    ws: Workspace,
    argv: Sequence[str],
    step: str,
    *,
    binds: Sequence[Bind] = (),
    tree_writable: bool = True,
    env: Mapping[str, str] | None = None,
    network: bool = False,
    proc: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    input_bytes: bytes | None = None,
    inputs: Sequence[Path] = (),
    stdin_input: Path | None = None,
    ok_codes: tuple[int, ...] = (0,),
    progress: Progress = quiet,
) -> subprocess.CompletedProcess[bytes]:
    """Run a trusted program (cleanroom's code, a host tool) over the tree at ``/tree``.
    ``inputs``: host files it gets as descriptors 3, 4, ... (opened by host root, so the
    files may be private); ``stdin_input``: one such file as its standard input."""
    mounts = [Bind(ws.tree, "/tree", tree_writable), *binds, *python_binds()]
    config: dict[str, object] = {
        "base": ws.ids.base,
        "count": ID_COUNT,
        "root": str(ws.root),
        "mounts": [
            {"source": str(b.source), "target": b.target, "writable": b.writable} for b in mounts
        ],
        "env": dict(env if env is not None else {**TREE_ENV, "HOME": "/tmp"}),
        "network": network,
        "proc": proc,
        "inputs": [str(p) for p in ([stdin_input] if stdin_input else inputs)],
        "stdin_input": stdin_input is not None,
        "rlimits": {"nproc": 4096, "nofile": 4096},
    }
    return _launch(config, argv, step, timeout_s, input_bytes, ok_codes, progress)


def run_step(
    ws: Workspace,
    step: str,
    plan: dict[str, Any],
    *,
    binds: Sequence[Bind] = (),
    inputs: Sequence[Path] = (),
    progress: Progress = quiet,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Run ``intree``'s ``step`` with ``plan`` over the tree; its JSON result, or the typed
    error it reported raised again here."""
    from cleanroom.baseline.intree import STEP_FAILED, raise_reported

    argv = [sys.executable, "-I", "-m", "cleanroom.baseline.intree", step]
    proc = run_builder(
        ws,
        argv,
        step,
        binds=binds,
        timeout_s=timeout_s,
        input_bytes=json.dumps(plan).encode(),
        inputs=inputs,
        ok_codes=(0, STEP_FAILED),
        progress=progress,
    )
    last = proc.stdout.strip().rsplit(b"\n", 1)[-1]
    if proc.returncode == STEP_FAILED:
        raise_reported(last, step)
    try:
        result = json.loads(last)
    except ValueError:
        raise BuildError(f"{step}: the build sandbox gave no result: {tail(proc.stderr)}") from None
    if not isinstance(result, dict):
        raise BuildError(f"{step}: the build sandbox gave no result object")
    return result
