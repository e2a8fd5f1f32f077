"""The root filesystem image (``rootfs.erofs``) of a baseline, built across the build boundary.

The host fetches and prepares trusted inputs; everything that reads or writes the image's tree
runs in the build sandbox (``confine.py``: unprivileged, namespaced, with a timeout), where
every path is resolved inside the tree (``inroot.py``). Steps, each reported to the progress
callback:

1. ``rootfs``: a Debian tree from ``mmdebstrap`` (suite, variant, packages + python3-minimal),
   run once per distinct package set and cached as a tarball in ``cache_dir()/rootfs/<key>.tar``
   (host), extracted by ``tar`` in the sandbox; or ``image``: the image's layers, fetched and
   checked by digest on the host (``oci.fetch``), applied in the sandbox within the image limits
   (``layers.ImageLimits``).
2. ``pip``: wheels for the guest's Python, installed by pip into a host staging folder
   (``pyinstall.stage_pip``).
3. ``files``: the spec's files, the user ``agent``, the guest agent (the static
   ``agent/native`` binary compiled here by ``gcc``; for a function entrypoint the warm worker and
   its ``entry.json``), the image-``User`` helper: staged on the host, copied in by the sandbox.
4. ``compile``: for a function entrypoint or a gym, byte-compiled by the guest's own Python
   with the tree as its root, reproducibly (``pyinstall.byte_compile``).
5. scrub: host- and time-dependent files emptied or fixed (``treefiles.scrub``).
6. ``erofs``: ``mkfs.erofs`` in the sandbox with a fixed timestamp (``SOURCE_DATE_EPOCH``) and a
   fixed UUID, the tree read-only. Ownership is kept as the image set it (ids ``0 .. 65535``).

The scratch (``scratch_parent``) is on disk unless the tree is small enough for ``/dev/shm``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.agent import native
from cleanroom.baseline import oci
from cleanroom.baseline.confine import Bind, Workspace, run_builder, run_step
from cleanroom.baseline.dockerfile import build_image
from cleanroom.baseline.image_user import RUNAS_SOURCE
from cleanroom.baseline.layers import ImageLimits
from cleanroom.baseline.lock import (
    apt_preferences,
    check_packages,
    check_pinned,
    dpkg_packages,
    spec_pins,
)
from cleanroom.baseline.oci import Image
from cleanroom.baseline.proc import Progress, quiet, run
from cleanroom.baseline.pyinstall import AGENT_DEST, byte_compile, site_folder, stage_pip
from cleanroom.baseline.spec import (
    AGENT_DIR,
    NATIVE_GYM_FILES,
    SKIP_NAMES,
    SOURCE_DATE_EPOCH,
    BaselineSpec,
    BaseSection,
)
from cleanroom.core.run_as import RunAs
from cleanroom.errors import BuildError
from cleanroom.host.paths import cache_dir

EROFS_UUID = "c1ea4200-0000-4000-8000-000000000001"
ROOTFS_CACHE_VERSION = "1"
AGENT_PATH = f"/{AGENT_DEST}/{native.BINARY}"
SHM_MAX_TREE = 1 << 30
"""The largest tree (estimated) unpacked in ``/dev/shm`` (RAM); a larger one goes to disk."""
SHM_HEADROOM = 4
"""``/dev/shm`` must have this many times the estimate free to be used."""
COMPRESSED_RATIO = 4
"""How many bytes a compressed layer byte is estimated to unpack to (for the scratch choice)."""
TAR_TIMEOUT_S = 600.0
ERofs_TIMEOUT_S = 900.0


def scratch_parent(need_bytes: int = SHM_MAX_TREE) -> Path:
    """Where to unpack a tree of about ``need_bytes``: ``$CLEANROOM_BUILD_TMP``, else
    ``/dev/shm`` if the tree is small (``SHM_MAX_TREE``), it has ``SHM_HEADROOM`` times that
    free and allows exec and device nodes (a ~200 MB tar unpacks there in 0.4 s instead of ~10 s
    on a slow disk), else ``cache_dir()`` (disk: a large or hostile image cannot fill RAM)."""
    chosen = os.environ.get("CLEANROOM_BUILD_TMP")
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")
    if need_bytes > SHM_MAX_TREE:
        return cache_dir()
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        options = [line.split()[3].split(",") for line in mounts if line.split()[1] == str(shm)]
        usable = bool(options) and not {"noexec", "nodev", "ro"} & set(options[-1])
        room = shutil.disk_usage(shm).free >= SHM_HEADROOM * need_bytes
        if usable and os.access(shm, os.W_OK) and room:
            return shm
    except (OSError, IndexError):
        pass
    return cache_dir()


# -- debootstrap ----------------------------------------------------------------------------------


def base_cache_key(base: BaseSection, pins: dict[str, str] | None = None) -> str:
    """The rootfs tarball's cache key: suite, variant, sorted packages, the recipe version and,
    for a locked build, the pinned versions."""
    recipe: dict[str, Any] = {
        "suite": base.suite,
        "variant": base.variant,
        "packages": list(base.all_packages()),
        "epoch": SOURCE_DATE_EPOCH,
        "version": ROOTFS_CACHE_VERSION,
    }
    if pins:
        recipe["pins"] = pins
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:32]


def release_dates(tarball: Path) -> list[str]:
    """The ``Date:`` lines of the archive's Release files mmdebstrap used (kept beside it)."""
    path = tarball.with_suffix(".release")
    return path.read_text().split("\n")[:-1] if path.is_file() else []


def debootstrap_tarball(
    base: BaseSection, progress: Progress = quiet, pins: dict[str, str] | None = None
) -> Path:
    """The cached mmdebstrap tarball for ``base`` (with apt pinned to ``pins``, if given, and
    to the spec's own ``name=version`` packages), running mmdebstrap (~30 s) if absent. The
    pins go into apt's preferences: an ``--include`` version alone is not enough for a package
    the variant installs anyway (minbase's tzdata stayed at the newest version)."""
    pins = {**(pins or {}), **spec_pins(base.packages)} or None
    folder = cache_dir() / "rootfs"
    folder.mkdir(parents=True, exist_ok=True)
    tarball = folder / f"{base_cache_key(base, pins)}.tar"
    if tarball.is_file():
        progress("rootfs", f"cached debootstrap {tarball.name}")
        return tarball
    packages = ",".join(base.all_packages())
    progress("rootfs", f"mmdebstrap {base.variant} {base.suite} +{packages}")
    partial = folder / f".{tarball.stem}.{os.getpid()}.partial"
    tmpdir = Path(tempfile.mkdtemp(prefix="cleanroom-mmdebstrap-", dir=scratch_parent()))
    release = tmpdir / "release"
    hooks = []
    if pins:
        (tmpdir / "pins").write_text(apt_preferences(pins))
        prefs = '"$1/etc/apt/preferences.d/cleanroom-lock"'
        hooks += [f'--setup-hook=mkdir -p "$1/etc/apt/preferences.d" && cp {tmpdir}/pins {prefs}']
        hooks += [f"--customize-hook=rm -f {prefs}"]
    lists = '"$1"/var/lib/apt/lists/*Release'
    hooks += [f"--customize-hook=grep -h '^Date:' {lists} > {release} || :"]
    try:
        run(
            [
                "mmdebstrap",
                "--quiet",
                "--format=tar",
                f"--variant={base.variant}",
                f"--include={packages}",
                '--customize-hook=echo cleanroom > "$1/etc/hostname"',
                '--customize-hook=: > "$1/etc/resolv.conf"',
                *hooks,
                base.suite,
                partial,
            ],
            "rootfs",
            env={"SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH), "TMPDIR": str(tmpdir)},
        )
        if release.is_file():
            shutil.copyfile(release, tarball.with_suffix(".release"))
        os.replace(partial, tarball)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(tmpdir, ignore_errors=True)
    return tarball


def _tarball_packages(tarball: Path) -> dict[str, str]:
    with tarfile.open(tarball) as tar:
        member = tar.extractfile("./var/lib/dpkg/status")
        return dpkg_packages(member.read().decode("utf-8", "replace")) if member else {}


def base_tarball(base: BaseSection, progress: Progress, pins: dict[str, str] | None) -> Path:
    """The (cached) Debian tarball; with ``pins`` (a locked build), exactly those versions."""
    tarball = debootstrap_tarball(base, progress)
    if pins and _tarball_packages(tarball) != pins:
        tarball = debootstrap_tarball(base, progress, pins)
    return tarball


def extract_base(ws: Workspace, tarball: Path, progress: Progress = quiet) -> dict[str, Any]:
    """Extract the Debian tarball into the tree, in the sandbox; the tree's facts."""
    progress("rootfs", "extracting (confined)")
    argv = ["/usr/bin/tar", "-C", "/tree", "--numeric-owner", "--xattrs", "--xattrs-include=*"]
    argv += ["--exclude=./dev/*", "-xpf", "-"]  # /dev is the guest kernel's devtmpfs
    run_builder(ws, argv, "rootfs", stdin_input=tarball, timeout_s=TAR_TIMEOUT_S)
    return run_step(ws, "facts", {}, progress=progress)


# -- images ---------------------------------------------------------------------------------------


def fetch_image(spec: BaselineSpec, work: Path, progress: Progress = quiet) -> Image:
    """The spec's container image (a reference, or a Dockerfile built here) with its blobs
    under ``work``, checked against their digests."""
    docker = spec.dockerfile_paths()
    ref = build_image(*docker, work, progress) if docker else spec.image_ref()
    if ref is None:
        raise BuildError(f"{spec.name}: no image to unpack")
    return oci.fetch(ref, work, progress)


def image_estimate(image: Image) -> int:
    """About how many bytes the image's tree takes (for the scratch's choice)."""
    return sum(blob.stat().st_size for _, blob in image.layers) * COMPRESSED_RATIO


def unpack_image(
    ws: Workspace,
    image: Image,
    source: str,
    progress: Progress = quiet,
    limits: ImageLimits | None = None,
) -> dict[str, Any]:
    """Apply the image's layers in the sandbox, each blob passed as an open descriptor (3, 4,
    ...); the tree's facts."""
    plan = {
        "source": f"image {source}",
        "layers": [[digest, 3 + i] for i, (digest, _) in enumerate(image.layers)],
        "limits": vars(limits or ImageLimits()),
    }
    blobs = [blob for _, blob in image.layers]
    return run_step(ws, "unpack", plan, inputs=blobs, progress=progress, timeout_s=TAR_TIMEOUT_S)


# -- staged inputs --------------------------------------------------------------------------------


RUNAS_CFLAGS = ("-static", "-O2", "-s", "-Wall", "-Wextra")
AGENT_BINARY = "agent-binary"
NATIVE_WORKER = "worker.py"
"""The one Python file of a native baseline with a function entrypoint (stdlib only)."""


def _stage_copy(src: Path, dest: Path) -> None:
    """A spec source copied for the sandbox (skipping host caches), readable by it."""
    dest.parent.mkdir(parents=True, exist_ok=True)  # a single file first: no folder made yet
    if src.is_dir() and not src.is_symlink():
        ignore = shutil.ignore_patterns(*SKIP_NAMES, "*.pyc")
        shutil.copytree(src, dest, symlinks=True, ignore=ignore)
    else:
        shutil.copyfile(src, dest, follow_symlinks=False)
        if not dest.is_symlink():
            dest.chmod(0o755 if os.stat(src).st_mode & 0o111 else 0o644)


def stage_agent(
    stage: Path, warm_config: dict[str, Any] | None, gym: bool, has_python: bool
) -> None:
    """The guest agent in ``stage``: ``cleanroom/`` as ``/opt/cleanroom`` will hold it (for a
    function entrypoint the warm worker and its ``entry.json``, which need the image's Python:
    without one it is a BuildError; for a gym its files) and the native binary
    ``agent-binary`` (``native.CFLAGS``: static, hardened, reproducible), installed last."""
    folder = stage / "cleanroom" / "agent"
    folder.mkdir(parents=True)
    for name in NATIVE_GYM_FILES if gym else ():
        shutil.copyfile(AGENT_DIR / name, folder / name)
    if warm_config is not None:
        if not has_python:
            raise BuildError(
                f"entrypoint: function {warm_config['function']!r} needs Python 3 in the image "
                "(/usr/bin/python3): the native agent runs it in the warm Python worker; "
                "give a command entrypoint, or an image with python3"
            )
        shutil.copyfile(AGENT_DIR / NATIVE_WORKER, folder / NATIVE_WORKER)
        (folder.parent / "entry.json").write_text(json.dumps(warm_config, sort_keys=True) + "\n")
    binary = stage / AGENT_BINARY
    run(native.gcc_argv(binary), "files", cwd=native.NATIVE_DIR)
    binary.chmod(0o755)


def compile_runas(binary: Path) -> None:
    """The image-``User`` helper (``runas.c``): static, so it runs in an image with any libc."""
    run(["gcc", *RUNAS_CFLAGS, "-o", binary, RUNAS_SOURCE], "files")
    binary.chmod(0o755)


def _readable(folder: Path) -> None:
    """Let namespace root read what the host staged (the user's files may be private)."""
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))


@dataclass(frozen=True)
class RootfsFacts:
    """What a rootfs build resolved: the lock's tree parts (``lock.py``) and its image."""

    image: Image | None = None
    run_as: RunAs | None = None  # the image's User, if not root (``image_user.py``)
    packages: dict[str, str] = field(default_factory=dict)
    release: list[str] = field(default_factory=list)
    pip: list[dict[str, str]] = field(default_factory=list)
    python: str | None = None


def _install(
    spec: BaselineSpec,
    ws: Workspace,
    image: Image | None,
    found: dict[str, Any],
    progress: Progress,
    locked: dict[str, Any] | None,
) -> tuple[list[dict[str, str]], RunAs | None]:
    """Stage pip, files, agent and helper on the host, then copy them in (sandbox)."""
    stage, python = ws.stage, found.get("python")
    wheels = stage_pip(
        spec.pip.packages, python, stage / "pip", progress, locked.get("pip") if locked else None
    )
    files = []
    for i, (src, entry) in enumerate(spec.sources()):
        _stage_copy(src, stage / "files" / str(i))
        folder = src.is_dir() and not src.is_symlink()
        files.append({"src": entry.src, "dest": entry.dest, "folder": folder})
        files[-1]["staged"] = f"/in/stage/files/{i}"
    stage_agent(stage, spec.warm_config(), spec.has_gym(), bool(found.get("has_python")))
    if image is not None:
        compile_runas(stage / "runas")
    _readable(stage)
    source = str(spec.base.image or spec.base.dockerfile)
    plan = {
        "source": f"image {source}" if image is not None else spec.name,
        "pip": "/in/stage/pip" if wheels else None,
        "site": site_folder(python) if python else None,
        "files": files,
        "agent": "/in/stage/cleanroom",
        "agent_dest": "/" + str(Path(AGENT_DEST).parent),
        "user": image.config.user if image is not None else None,
        "runas": "/in/stage/runas",
    }
    result = run_step(ws, "install", plan, binds=[Bind(stage, "/in/stage")], progress=progress)
    run_as = RunAs.from_json(result["run_as"]) if result.get("run_as") else None
    return wheels, run_as


def make_erofs(ws: Workspace, out: Path, progress: Progress = quiet) -> None:
    """Pack the tree into a read-only erofs image with fixed timestamps and UUID (sandbox: the
    tree read-only, only ``out``'s folder writable); ``out`` must come back a regular file."""
    progress("erofs", "mkfs.erofs (confined)")
    argv = ["/usr/bin/mkfs.erofs", "--quiet", f"-T{SOURCE_DATE_EPOCH}", f"-U{EROFS_UUID}"]
    argv += ["/out/rootfs.erofs", "/tree"]
    binds = [Bind(ws.out, "/out", writable=True)]
    run_builder(ws, argv, "erofs", binds=binds, tree_writable=False, timeout_s=ERofs_TIMEOUT_S)
    made = ws.out / "rootfs.erofs"
    if not stat.S_ISREG(os.lstat(made).st_mode):
        raise BuildError("erofs: mkfs.erofs made no regular file")
    shutil.copyfile(made, out, follow_symlinks=False)


def build_rootfs(
    spec: BaselineSpec,
    ws: Workspace,
    out: Path,
    progress: Progress = quiet,
    locked: dict[str, Any] | None = None,
    image: Image | None = None,
) -> RootfsFacts:
    """Every step above: the empty tree of ``ws`` becomes the image at ``out``. With a
    ``locked`` lock, exactly its Debian packages and wheels are installed; ``image``: the
    spec's fetched image (``fetch_image``), for an image baseline."""
    release: list[str] = []
    if image is not None:
        found = unpack_image(ws, image, str(spec.base.image or spec.base.dockerfile), progress)
    else:
        pins = ((locked or {}).get("debian") or {}).get("packages") if locked else None
        tarball = base_tarball(spec.base, progress, pins)
        found = extract_base(ws, tarball, progress)
        if pins:
            check_packages(pins, found["packages"])
        check_pinned(spec_pins(spec.base.packages), found["packages"])
        release = release_dates(tarball)
    python = found.get("python")
    wheels, run_as = _install(spec, ws, image, found, progress, locked)
    if spec.warm_config() is not None or spec.has_gym():
        byte_compile(ws, spec, python, progress)
    plan = {"source": spec.name, "agent": f"/in/stage/{AGENT_BINARY}", "agent_dest": AGENT_PATH}
    run_step(ws, "scrub", plan, binds=[Bind(ws.stage, "/in/stage")], progress=progress)
    make_erofs(ws, out, progress)
    return RootfsFacts(image, run_as, found["packages"], release, wheels, python)
