"""The root filesystem image (``rootfs.erofs``) of a baseline.

Steps, each reported to the progress callback:

1. ``rootfs``: a Debian tree from ``mmdebstrap`` (suite, variant, packages + python3-minimal),
   run once per distinct package set and cached as a tarball in
   ``cache_dir()/rootfs/<key>.tar``; every build extracts that tarball, so builds that share
   packages share one debootstrap and a rebuild starts from identical bytes.
2. ``pip``: wheels for the guest's Python (``pyinstall.install_pip``).
3. ``files``: the spec's files, then the guest agent into ``/opt/cleanroom/agent/``: the
   static ``agent/native`` binary, compiled here by ``gcc`` (for a function entrypoint, with the
   warm worker and its config as ``/opt/cleanroom/entry.json``, which needs the image's Python).
4. ``compile``: for a function entrypoint, byte-compiled by the guest's own Python,
   reproducibly (``pyinstall.byte_compile``), the worker test-imported.
5. scrub: host- and time-dependent files are emptied or fixed (hostname, resolv.conf,
   machine-id, logs, apt lists and caches, ``*-old`` files).

6. ``erofs``: ``mkfs.erofs`` with a fixed timestamp (``SOURCE_DATE_EPOCH``) and a fixed UUID.
   Ownership is kept as Debian set it (``/etc/shadow`` stays group ``shadow``); the tree is
   uncompressed (fastest to read under TCG).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.agent import native
from cleanroom.baseline import oci, users
from cleanroom.baseline.dockerfile import build_image
from cleanroom.baseline.image_user import RUNAS_PATH, RUNAS_SOURCE, RunAs, resolve_user
from cleanroom.baseline.layers import resolve_in_root
from cleanroom.baseline.lock import (
    apt_preferences,
    check_packages,
    check_pinned,
    dpkg_packages,
    spec_pins,
    tree_packages,
)
from cleanroom.baseline.oci import Image
from cleanroom.baseline.proc import Progress, quiet, run
from cleanroom.baseline.pyinstall import AGENT_DEST, byte_compile, install_pip
from cleanroom.baseline.spec import (
    AGENT_DIR,
    NATIVE_GYM_FILES,
    SKIP_NAMES,
    SOURCE_DATE_EPOCH,
    BaselineSpec,
    BaseSection,
)
from cleanroom.errors import BuildError
from cleanroom.paths import cache_dir

EROFS_UUID = "c1ea4200-0000-4000-8000-000000000001"
ROOTFS_CACHE_VERSION = "1"


def scratch_parent(need_bytes: int = 2 << 30) -> Path:
    """Where to unpack trees: ``$CLEANROOM_BUILD_TMP``, else ``/dev/shm`` if it has room and
    allows exec and device nodes (a ~200 MB tar unpacks there in 0.4 s instead of ~10 s on a
    slow disk), else ``cache_dir()``."""
    chosen = os.environ.get("CLEANROOM_BUILD_TMP")
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        options = [line.split()[3].split(",") for line in mounts if line.split()[1] == str(shm)]
        usable = bool(options) and not {"noexec", "nodev", "ro"} & set(options[-1])
        if usable and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= need_bytes:
            return shm
    except (OSError, IndexError):
        pass
    return cache_dir()


def guest_path(rootfs: Path, path: str) -> Path:
    """``path`` (absolute, in the guest) inside ``rootfs``, refusing to leave it via symlinks."""
    target = rootfs / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    real_root = rootfs.resolve()
    parent = target.parent.resolve()
    if parent != real_root and real_root not in parent.parents:
        raise BuildError(f"files: {path} resolves outside the root filesystem (symlink)")
    return target


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


def extract_base(
    base: BaseSection, rootfs: Path, progress: Progress = quiet, pins: dict[str, str] | None = None
) -> list[str]:
    """Fill the folder ``rootfs`` (created if missing) with the (cached) Debian tree; with
    ``pins`` (a locked build), exactly those package versions. Returns the Release dates."""
    tarball = debootstrap_tarball(base, progress)
    if pins and _tarball_packages(tarball) != pins:
        tarball = debootstrap_tarball(base, progress, pins)
    rootfs.mkdir(parents=True, exist_ok=True)
    progress("rootfs", "extracting")
    run(
        ["tar", "-C", rootfs, "--numeric-owner", "--xattrs", "--xattrs-include=*", "-xpf", tarball],
        "rootfs",
    )
    rootfs.chmod(0o755)
    got = tree_packages(rootfs)
    if pins:
        check_packages(pins, got)
    check_pinned(spec_pins(base.packages), got)
    return release_dates(tarball)


# -- files ----------------------------------------------------------------------------------------


def _copy_file(src: str, dst: str) -> None:
    """Copy content only; 0755 if the source is executable, else 0644 (no host umask)."""
    shutil.copyfile(src, dst, follow_symlinks=False)
    if not os.path.islink(dst):
        os.chmod(dst, 0o755 if os.stat(src).st_mode & 0o111 else 0o644)


def _copy_tree(src: Path, dest: Path) -> None:
    """Copy a folder's contents into ``dest``; new folders get 0755, existing ones keep theirs."""
    below = (p.relative_to(src) for p in src.rglob("*") if p.is_dir() and not p.is_symlink())
    folders = [Path("."), *sorted(p for p in below if not SKIP_NAMES.intersection(p.parts))]
    existing = {r: (dest / r).stat().st_mode & 0o7777 for r in folders if (dest / r).is_dir()}
    ignore = shutil.ignore_patterns(*SKIP_NAMES, "*.pyc")
    shutil.copytree(
        src, dest, symlinks=True, ignore=ignore, copy_function=_copy_file, dirs_exist_ok=True
    )
    for rel in folders:
        (dest / rel).chmod(existing.get(rel, 0o755))


def copy_files(spec: BaselineSpec, rootfs: Path, progress: Progress = quiet) -> None:
    """Copy each ``[[files]]`` entry (a folder's contents, or one file) to its ``dest``."""
    for src, entry in spec.sources():
        progress("files", f"{entry.src} -> {entry.dest}")
        dest = guest_path(rootfs, entry.dest)
        if src.is_dir() and not src.is_symlink():
            _copy_tree(src, dest)
        elif dest.is_dir() and not dest.is_symlink():
            raise BuildError(f"files: {entry.dest} is a folder in the image; give a file path")
        else:
            dest.unlink(missing_ok=True)
            _copy_file(str(src), str(dest))


RUNAS_CFLAGS = ("-static", "-O2", "-s", "-Wall", "-Wextra")


def _static_binary(source: Path, binary: Path) -> None:
    binary.parent.mkdir(parents=True, exist_ok=True)
    run(["gcc", *RUNAS_CFLAGS, "-o", binary, source], "files")
    binary.chmod(0o755)


def install_runas(rootfs: Path) -> None:
    """Compile the image-``User`` helper (``runas.c``) to ``RUNAS_PATH``: static, so it runs in
    an image with any libc or none."""
    _static_binary(RUNAS_SOURCE, rootfs / RUNAS_PATH.lstrip("/"))


NATIVE_WORKER = "worker.py"
"""The one Python file of a native baseline with a function entrypoint (stdlib only)."""


def install_native_agent(
    rootfs: Path, warm_config: dict[str, Any] | None = None, gym: bool = False
) -> None:
    """Compile the native agent (``agent/native``, ``native.CFLAGS``: static, hardened,
    reproducible) to ``/opt/cleanroom/agent/agent``, the only agent file of a command baseline.
    A function entrypoint adds the warm worker (``worker.py``, which the agent starts at boot)
    and its ``entry.json``; that needs the image's Python, so without one it is a BuildError.
    ``gym`` (a gym config in the baseline) adds the gym process's files (``NATIVE_GYM_FILES``;
    it runs in the image's Python, with gymnasium and numpy from the image)."""
    dest = rootfs / AGENT_DEST
    dest.mkdir(parents=True, exist_ok=True)
    for name in NATIVE_GYM_FILES if gym else ():
        _copy_file(str(AGENT_DIR / name), str(dest / name))
    if warm_config is not None:
        python = resolve_in_root(rootfs, GUEST_PYTHON, "the image", follow_last=True)
        if not python.is_file():
            raise BuildError(
                f"entrypoint: function {warm_config['function']!r} needs Python 3 in the image "
                "(/usr/bin/python3): the native agent runs it in the warm Python worker; "
                "give a command entrypoint, or an image with python3"
            )
        _copy_file(str(AGENT_DIR / NATIVE_WORKER), str(dest / NATIVE_WORKER))
        entry = dest.parent / "entry.json"
        entry.write_text(json.dumps(warm_config, sort_keys=True) + "\n")
        entry.chmod(0o644)
    binary = dest / native.BINARY
    run(native.gcc_argv(binary), "files", cwd=native.NATIVE_DIR)
    binary.chmod(0o755)
    for folder in (dest, dest.parent):
        folder.chmod(0o755)


# -- scrub ----------------------------------------------------------------------------------------


def _user_id(rootfs: Path, name: str) -> int:
    """The uid of a user in the tree's /etc/passwd (0 if absent)."""
    passwd = rootfs / "etc" / "passwd"
    if not passwd.is_file():
        return 0
    for line in passwd.read_text(errors="replace").splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[0] == name and fields[2].isdigit():
            return int(fields[2])
    return 0


def scrub(rootfs: Path) -> None:
    """Remove or fix everything host- or time-dependent, and make the folders the guest needs."""
    (rootfs / "etc").mkdir(mode=0o755, exist_ok=True)  # an image may have none
    for name, content in (("hostname", b"cleanroom\n"), ("resolv.conf", b""), ("machine-id", b"")):
        path = rootfs / "etc" / name
        path.unlink(missing_ok=True)
        path.write_bytes(content)
        path.chmod(0o644)
    if not (rootfs / "etc" / "environment").exists():
        (rootfs / "etc" / "environment").write_bytes(b"")
        (rootfs / "etc" / "environment").chmod(0o644)
    for pattern in (
        "var/lib/apt/lists/*",
        "var/cache/apt/*.bin",
        "var/cache/apt/archives/*.deb",
        "var/cache/ldconfig/aux-cache",
        "var/lib/dpkg/*-old",
        "var/cache/debconf/*-old",
        "tmp/*",
        "var/tmp/*",
        "run/*",
    ):
        for path in rootfs.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                if path.name != "partial":
                    shutil.rmtree(path)
            else:
                path.unlink()
    apt_uid = _user_id(rootfs, "_apt")
    for partial in ("var/cache/apt/archives/partial", "var/lib/apt/lists/partial"):
        if (rootfs / partial).is_dir():  # apt leaves these root- or _apt-owned, by host
            os.chown(rootfs / partial, apt_uid, 0)
            (rootfs / partial).chmod(0o700)
    for log in (rootfs / "var" / "log").rglob("*"):
        if log.is_file() and not log.is_symlink():
            log.write_bytes(b"")  # keep the file (owner, mode), drop what it says
    for folder, mode in (("root", 0o700), ("tmp", 0o1777), ("var/tmp", 0o1777)):
        (rootfs / folder).mkdir(parents=True, exist_ok=True)
        (rootfs / folder).chmod(mode)
    (rootfs / "run" / "cleanroom").mkdir(parents=True, exist_ok=True)
    (rootfs / "run" / "cleanroom").chmod(0o755)


# -- erofs ----------------------------------------------------------------------------------------


def make_erofs(rootfs: Path, out: Path, progress: Progress = quiet) -> None:
    """Pack ``rootfs`` into a read-only erofs image with fixed timestamps and UUID."""
    progress("erofs", "mkfs.erofs")
    run(
        ["mkfs.erofs", "--quiet", f"-T{SOURCE_DATE_EPOCH}", f"-U{EROFS_UUID}", out, rootfs],
        "erofs",
    )


BUILDER_WRITES = ("etc", "opt", "opt/cleanroom", "root", "run", "tmp", "var", "var/log", "var/tmp")
"""Folders the build writes into after an image is unpacked: never through a symlink."""
GUEST_PYTHON = ("usr", "bin", "python3")
"""Where the Python guest agent's Python must be (a native-agent baseline needs none)."""


def unpack_image(spec: BaselineSpec, tree: Path, progress: Progress = quiet) -> Image:
    """Fill ``tree`` from the spec's container image (a reference, or a Dockerfile built
    here), which must hold the agent's Python unless the baseline runs the native agent."""
    work = Path(tempfile.mkdtemp(prefix="cleanroom-image-", dir=scratch_parent()))
    docker = spec.dockerfile_paths()
    try:
        ref = build_image(*docker, work, progress) if docker else spec.image_ref()
        if ref is None:
            raise BuildError(f"{spec.name}: no image to unpack")
        image = oci.fetch(ref, work, progress)
        oci.unpack(image, tree, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    source = spec.base.image or spec.base.dockerfile
    for folder in BUILDER_WRITES:
        if (tree / folder).is_symlink():
            raise BuildError(f"image {source}: /{folder} is a symlink; the builder writes there")
    return image


@dataclass(frozen=True)
class RootfsFacts:
    """What a rootfs build resolved: the lock's tree parts (``lock.py``) and its image."""

    image: Image | None = None
    run_as: RunAs | None = None  # the image's User, if not root (``image_user.py``)
    packages: dict[str, str] = field(default_factory=dict)
    release: list[str] = field(default_factory=list)
    pip: list[dict[str, str]] = field(default_factory=list)


def build_rootfs(
    spec: BaselineSpec,
    tree: Path,
    out: Path,
    progress: Progress = quiet,
    locked: dict[str, Any] | None = None,
) -> RootfsFacts:
    """Every step above: an empty folder ``tree`` becomes the image at ``out``. With a
    ``locked`` lock, exactly its Debian packages and wheels are installed.

    Runs under umask 022 (restored after), so no host umask reaches the image's modes.
    """
    previous = os.umask(0o022)
    image, release, run_as = None, [], None
    try:
        if spec.base.from_image:
            image = unpack_image(spec, tree, progress)
        else:
            pins = ((locked or {}).get("debian") or {}).get("packages") if locked else None
            release = extract_base(spec.base, tree, progress, pins)
        packages = tree_packages(tree)
        wheels = install_pip(
            spec.pip.packages, tree, progress, locked.get("pip") if locked else None
        )
        copy_files(spec, tree, progress)
        users.add_agent_user(tree)
        install_native_agent(tree, spec.warm_config(), spec.has_gym())
        if spec.warm_config() is not None or spec.has_gym():
            byte_compile(tree, spec, progress)
        if image is not None:
            source = str(spec.base.image or spec.base.dockerfile)
            run_as = resolve_user(tree, image.config.user, source)
            if run_as is not None:
                progress("files", f"User {run_as.user}: uid {run_as.uid}, gid {run_as.gid}")
                install_runas(tree)
        scrub(tree)
        make_erofs(tree, out, progress)
    finally:
        os.umask(previous)
    return RootfsFacts(image, run_as, packages=packages, release=release, pip=wheels)
