"""Build a baseline from its spec: ``build(spec_path) -> Baseline``.

1. Load the spec and compute its spec digest; unless ``force``, a baseline already built from
   the same spec digest (``baselines_dir()/by-spec/<hex>``) by the same builder code
   (``builder_fingerprint``) that passes ``quick_check`` is returned as is.
2. ``kernel``: fetch (cached) the guest kernel and its modules.
3. ``rootfs`` / ``pip`` / ``files`` / ``compile`` / ``erofs``: build ``rootfs.erofs``; then
   ``entry``: a function entrypoint is imported in the built tree by the guest's Python, the
   way the warm worker will (``check_function_entry``), so a typo in ``function`` or a
   ``preimport`` that is not installed fails the build with the guest's traceback instead of
   every episode.
4. ``initramfs``: write ``initrd.cpio``.
5. ``digest``: hash the components, compute the digest, write ``baseline.json`` and move the
   folder atomically to ``baselines_dir()/<hex>/`` (an intact baseline with the same digest is
   kept as is; a drifted one is replaced).

Scratch work happens in ``cache_dir()/build-*`` (the unpacked root tree in a private
``confine.workspace``, in ``/dev/shm`` when the tree is small and it has room:
``rootfs.scratch_parent``), removed on success and on failure. Every step that touches the
image's tree runs in the build sandbox (``confine.py``). Every failure is a ``CleanroomError``
(``BuildError`` with the failing command's stderr tail; ``ImageError`` for an image over a
limit).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cleanroom.agent import native
from cleanroom.baseline import confine, lock, store
from cleanroom.baseline.confine import Workspace, run_in_tree
from cleanroom.baseline.initramfs import build_initramfs
from cleanroom.baseline.kernel import Kernel, fetch_kernel, kernel_cache
from cleanroom.baseline.oci import Image
from cleanroom.baseline.proc import Progress, quiet, tail
from cleanroom.baseline.pyinstall import AGENT_DEST, GUEST_ENV
from cleanroom.baseline.rootfs import (
    AGENT_BINARY,
    SHM_MAX_TREE,
    RootfsFacts,
    build_rootfs,
    fetch_image,
    image_estimate,
    scratch_parent,
)
from cleanroom.baseline.spec import (
    BUILDER_VERSION,
    BaselineSpec,
    builder_fingerprint,
    load_spec,
    spec_digest,
)
from cleanroom.core.baseline_model import (
    AGENT_FILE,
    INITRD_FILE,
    KERNEL_FILE,
    METADATA_FILE,
    ROOTFS_FILE,
    Baseline,
    Component,
    FunctionEntry,
    identity,
)
from cleanroom.core.run_as import RunAs
from cleanroom.errors import BaselineNotFound, BuildError, DriftError
from cleanroom.evidence import header_budget
from cleanroom.host.digests import digest_of, sha256_file
from cleanroom.host.paths import baselines_dir, cache_dir


def native_agent_version() -> str:
    """``AGENT_VERSION`` of the native agent (``agent/native/agent.c``)."""
    version = native.agent_version()
    if version is None:
        raise BuildError(f"agent: {native.NATIVE_DIR / 'agent.c'} defines no AGENT_VERSION")
    return version


def _component(folder: Path, name: str) -> Component:
    path = folder / name
    return Component(name=name, size=path.stat().st_size, sha256=sha256_file(path))


def _install(out: Path, digest: str) -> None:
    """Move a finished baseline folder to its content address (idempotent, atomic rename)."""
    final = baselines_dir() / digest.removeprefix("sha256:")
    if final.exists():
        try:
            store.require_intact(store.load(digest))
            return  # the same content is already stored and intact: keep it
        except (DriftError, BaselineNotFound):
            shutil.rmtree(final)
    try:
        os.replace(out, final)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return  # a concurrent build of the same content got there first
        if exc.errno != errno.EXDEV:
            raise
        staging = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        shutil.copytree(out, staging)  # copy2 keeps the recorded mtimes
        os.replace(staging, final)


ENTRY_CHECK = (
    "import json, sys; sys.path.insert(0, {agent!r}); import worker; "
    "sys.modules.pop('worker'); sys.path.remove({agent!r}); "
    "worker.warm_up(json.load(open({entry!r})))"
)
"""What ``worker.main`` does before it serves: path, preimports, the function resolved."""


def check_function_entry(spec: BaselineSpec, ws: Workspace, progress: Progress = quiet) -> None:
    """Import a function entrypoint (and its ``preimport``) in the built tree with the
    guest's Python, as the warm worker does; BuildError with the guest's traceback if it fails.
    This runs the spec's own modules at build time, with the tree as their root and
    unprivileged (``confine.run_in_tree``), after the erofs is made, as every episode would."""
    config = spec.warm_config()
    if config is None:
        return
    progress("entry", f"importing {config['function']} with the guest's Python (confined)")
    agent = "/" + AGENT_DEST
    code = ENTRY_CHECK.format(agent=agent, entry=str(Path(agent).parent / "entry.json"))
    argv = ["/usr/bin/python3", "-I", "-B", "-c", code]
    proc = run_in_tree(ws, argv, "entry", env=GUEST_ENV, ok_codes=tuple(range(256)))
    if proc.returncode != 0:
        preimport = f" (preimport {', '.join(config['preimport'])})" if config["preimport"] else ""
        raise BuildError(
            f"entrypoint: function {config['function']!r}{preimport} cannot be loaded in the "
            f"built rootfs; the guest's Python said:\n{tail(proc.stderr) or '(no output)'}"
        )


def image_record(image: Image | None, run_as: RunAs | None = None) -> dict[str, Any] | None:
    """What a baseline records of its container image: digests, and the config it honours
    (``run_as``: its ``User`` resolved to numbers, when not root; its ``Entrypoint``, which a
    Harbor environment starts as Docker would)."""
    if image is None:
        return None
    record = {
        **{k: v for k, v in image.identity().items() if k != "ref"},  # the spec names the source
        "env": list(image.config.env),
        "working_dir": image.config.working_dir,
        "user": image.config.user,
    }
    if image.config.entrypoint:  # only when set: images without one keep their digests
        record["entrypoint"] = list(image.config.entrypoint)
    if run_as is not None:
        record["run_as"] = run_as.to_json()
    return record


def _entrypoint(spec: BaselineSpec, image: Image | None) -> tuple[str, ...]:
    """The spec's command; with no ``[entrypoint]``, the image's ``Entrypoint`` + ``Cmd``."""
    if spec.entrypoint is not None:
        return tuple(spec.entrypoint.command or ())
    command = image.config.command() if image is not None else ()
    if not command:
        raise BuildError(f"{spec.name}: no [entrypoint] and the image sets no Entrypoint or Cmd")
    return command


def _lock(facts: RootfsFacts, kernel: Kernel, package: str, image: Image | None) -> dict[str, Any]:
    """The lock of this build (``lock.py``): packages, wheels, kernel, image."""
    debs = sorted(
        p.name for p in kernel_cache().joinpath("debs").glob(f"linux-image-{kernel.version}_*.deb")
    )
    return {
        "format": lock.FORMAT,
        "debian": {"packages": facts.packages, "release": facts.release}
        if facts.packages
        else None,
        "pip": facts.pip,
        "kernel": {"package": package, "version": kernel.version, "deb": debs[-1] if debs else ""},
        "image": {k: v for k, v in image.identity().items() if k != "ref"} if image else None,
    }


def _assemble(
    spec: BaselineSpec,
    sdigest: str,
    work: Path,
    progress: Progress,
    locked: dict[str, Any] | None = None,
) -> Baseline:
    started = time.monotonic()
    kernel = fetch_kernel(spec.kernel.package, progress)
    out = work / "out"
    out.mkdir()
    image = fetch_image(spec, work / "image", progress) if spec.base.from_image else None
    need = image_estimate(image) if image is not None else SHM_MAX_TREE // 2
    with confine.workspace(scratch_parent(need)) as ws:
        facts = build_rootfs(spec, ws, out / ROOTFS_FILE, progress, locked, image)
        check_function_entry(spec, ws, progress)
        # the agent: the same bytes as in the image, hashed as a component of its own
        shutil.copyfile(ws.stage / AGENT_BINARY, out / AGENT_FILE)
    progress("initramfs", f"{len(kernel.order)} modules")
    build_initramfs(kernel, out / INITRD_FILE)
    shutil.copyfile(kernel.vmlinux, out / KERNEL_FILE)

    progress("digest", "hashing components")
    names = (KERNEL_FILE, INITRD_FILE, ROOTFS_FILE, AGENT_FILE)
    components = tuple(_component(out, n) for n in names)
    image = facts.image
    the_lock = _lock(facts, kernel, spec.kernel.package, image)
    if locked is not None:
        for key in ("kernel", "image"):
            lock.check_equal(key, locked.get(key), the_lock.get(key))
    entrypoint = _entrypoint(spec, image)
    warm = spec.warm_config()
    function = FunctionEntry.from_json(warm) if warm is not None else None
    version = native_agent_version()
    network = tuple(spec.network.allow) if spec.network is not None else None
    ident = identity(
        components,
        entrypoint,
        spec.limits,
        kernel.version,
        version,
        sdigest,
        function,
        network=network,
        image=image_record(image, facts.run_as),
        lock_digest=lock.lock_digest(the_lock),
    )
    digest = digest_of(ident)
    for component in components:
        (out / component.name).chmod(0o444)
    baseline = Baseline(
        digest=digest,
        path=out,
        spec_digest=sdigest,
        name=spec.name,
        components=components,
        entrypoint=entrypoint,
        limits=spec.limits,
        kernel_version=kernel.version,
        agent_version=version,
        spec=spec.canonical(),
        function=function,
        network=network,
        image=image_record(image, facts.run_as),
        lock=the_lock,
    )
    header_budget.check_entry(  # the guest agent refuses a RUN header over its limit
        f"baseline {spec.name}",
        baseline.function.to_json() if baseline.function else list(baseline.entrypoint),
        baseline.image_env,
        baseline.workdir,
    )
    data = baseline.to_json()
    data["built"] = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - started, 2),
        "host": socket.gethostname(),
        "builder_version": BUILDER_VERSION,
        "builder_fingerprint": builder_fingerprint(),
        "mtime_ns": {c.name: (out / c.name).stat().st_mtime_ns for c in components},
    }
    (out / METADATA_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    _install(out, digest)
    store.record_spec(sdigest, digest, builder_fingerprint())
    progress("digest", digest)
    return store.load(digest)


def build(
    spec_path: Path,
    progress: Progress = quiet,
    force: bool = False,
    locked: bool = False,
    keep_lock: bool = True,
) -> Baseline:
    """Build (or find in the cache) the baseline of a ``baseline.toml``; see module docstring.

    ``locked``: install exactly what ``baseline.lock`` beside the spec says (``lock.py``), or
    fail naming what is no longer available. A build writes that lock if there is none, unless
    ``keep_lock`` is False (a spec shipped inside the package: its folder is not the user's)."""
    spec = load_spec(Path(spec_path))
    sdigest = spec_digest(spec)
    the_lock = lock.read(Path(spec_path)) if locked else None
    baseline = None if force or locked else _cached(spec, sdigest, progress)
    if baseline is None:
        baseline = _fresh(spec, sdigest, progress, the_lock)
    if keep_lock:
        _keep_lock(Path(spec_path), baseline, progress)
    return baseline


def _cached(spec: BaselineSpec, sdigest: str, progress: Progress) -> Baseline | None:
    cached = store.lookup_spec(sdigest, builder_fingerprint())
    if cached is None:
        return None
    try:
        store.quick_check(cached)
    except DriftError as exc:
        progress("cache", f"cached {cached.short} drifted ({exc}); rebuilding")
        return None
    progress("cache", f"{spec.name}: already built as {cached.digest}")
    return cached


def _fresh(
    spec: BaselineSpec, sdigest: str, progress: Progress, locked: dict[str, Any] | None
) -> Baseline:
    scratch = cache_dir()
    scratch.mkdir(parents=True, exist_ok=True)
    baselines_dir().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=scratch))
    try:
        return _assemble(spec, sdigest, work, progress, locked)
    except OSError as exc:
        raise BuildError(f"build of {spec.name} failed: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _keep_lock(spec_path: Path, baseline: Baseline, progress: Progress) -> None:
    """Write ``baseline.lock`` beside the spec if it has none (a read-only folder is fine);
    say so if the one there no longer matches what this build got."""
    if baseline.lock is None:
        return
    path = lock.lock_path(spec_path)
    if path.exists():
        try:
            same = lock.read(spec_path) == baseline.lock
        except BuildError:
            same = False
        if not same:
            progress("lock", f"{path} differs from this build; `cleanroom baseline lock` renews it")
        return
    try:
        progress("lock", str(lock.write(spec_path, baseline.lock)))
    except OSError as exc:
        progress("lock", f"not written beside the spec ({exc.strerror})")


def relock(spec_path: Path, progress: Progress = quiet) -> Path:
    """``cleanroom baseline lock``: build afresh, unlocked, and replace the spec's lock."""
    baseline = build(spec_path, progress, force=True)
    if baseline.lock is None:
        raise BuildError(f"{spec_path}: the build recorded no lock")
    return lock.write(Path(spec_path), baseline.lock)
