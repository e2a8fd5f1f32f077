"""The guest's Python layer: pip wheels into the tree, then byte-compiling it.

``install_pip`` installs wheels for the *guest's* Python (version, ABI and glibc platform read
from the tree) into ``/usr/local/lib/python3.X/dist-packages`` with ``pip --target``; console
scripts move to ``/usr/local/bin`` with a ``/usr/bin/python3`` shebang.

``byte_compile`` runs the guest's own Python in a chroot with ``--invalidation-mode
checked-hash`` and ``PYTHONHASHSEED=0``: no mtimes in the ``.pyc`` files, a stable frozenset
order, and still correct if an episode edits a source file in its overlay. Then the agent is
imported once the way init runs it (``-I -S``), so a module missing from the image fails the
build instead of every boot.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cleanroom.baseline.lock import pip_items, pip_requirements
from cleanroom.baseline.proc import Progress, quiet, run
from cleanroom.baseline.spec import SOURCE_DATE_EPOCH, BaselineSpec
from cleanroom.errors import BuildError

AGENT_DEST = "opt/cleanroom/agent"
GUEST_GLIBC_MINOR = 36  # bookworm's glibc 2.36: wheels for it and every older manylinux fit
GUEST_PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(GUEST_GLIBC_MINOR, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
"""Platform tags for ``pip --platform`` (pip does not expand ``manylinux_2_36`` downwards)."""
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONHASHSEED": "0", "LC_ALL": "C"}


# -- pip ------------------------------------------------------------------------------------------


def guest_python(rootfs: Path) -> str:
    """The guest's Python version, e.g. ``"3.11"``, from ``/usr/bin/python3``'s link target."""
    link = rootfs / "usr" / "bin" / "python3"
    try:
        name = os.readlink(link)
    except OSError as exc:
        raise BuildError(f"rootfs: {link} is missing; is python3-minimal installed?") from exc
    version = Path(name).name.removeprefix("python")
    if not version.replace(".", "").isdigit():
        raise BuildError(f"rootfs: cannot tell the Python version from /usr/bin/python3 -> {name}")
    return version


def site_packages(rootfs: Path) -> Path:
    return rootfs / "usr" / "local" / "lib" / f"python{guest_python(rootfs)}" / "dist-packages"


def install_pip(
    requirements: list[str],
    rootfs: Path,
    progress: Progress = quiet,
    locked: list[dict[str, str]] | None = None,
) -> list[dict[str, str]]:
    """Install wheels for the guest's Python (version, ABI, glibc platform) into the tree;
    with ``locked`` (a lock's ``pip``), exactly those wheels, checked by hash. Returns the
    wheels installed (the lock's ``pip``)."""
    if not requirements:
        return []
    version = guest_python(rootfs)
    target = site_packages(rootfs)
    progress("pip", f"installing {len(requirements)} requirement(s) for Python {version}")
    work = Path(tempfile.mkdtemp(prefix="cleanroom-pip-"))
    report = work / "report.json"
    wanted: list[str] = list(requirements)
    if locked is not None:
        (work / "locked.txt").write_text(pip_requirements(locked))
        wanted = ["--require-hashes", "--no-deps", "-r", str(work / "locked.txt")]
    try:
        _pip(version, target, wanted, report)
        items = pip_items(json.loads(report.read_text()))
    except (OSError, ValueError) as exc:
        raise BuildError(f"pip: no install report ({exc})") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _move_scripts(rootfs, target)
    return items


def _pip(version: str, target: Path, wanted: list[str], report: Path) -> None:
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-input",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--no-compile",
            "--target",
            target,
            "--python-version",
            version,
            "--implementation",
            "cp",
            "--abi",
            f"cp{version.replace('.', '')}",
            *(arg for tag in GUEST_PLATFORMS for arg in ("--platform", tag)),
            "--only-binary=:all:",
            "--report",
            str(report),
            *wanted,
        ],
        "pip",
        env={"SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH), "PIP_ROOT_USER_ACTION": "ignore"},
    )


def _move_scripts(rootfs: Path, target: Path) -> None:
    """Console scripts to ``/usr/local/bin``, with the guest's Python in the shebang."""
    scripts = target / "bin"
    if scripts.is_dir():
        bindir = rootfs / "usr" / "local" / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        for script in sorted(scripts.iterdir()):
            body = script.read_bytes()
            if body.startswith(b"#!") and b"python" in body.split(b"\n", 1)[0]:
                body = b"#!/usr/bin/python3\n" + body.split(b"\n", 1)[1]
            dest = bindir / script.name
            dest.write_bytes(body)
            dest.chmod(0o755)
        shutil.rmtree(scripts)


# -- compile --------------------------------------------------------------------------------------


def byte_compile(rootfs: Path, spec: BaselineSpec, progress: Progress = quiet) -> None:
    """Byte-compile the agent (must succeed), then pip packages and spec files (best effort:
    wheels and user folders may hold files that are not valid Python 3, e.g. templates)."""
    progress("compile", "byte-compiling with the guest's Python")
    base: list[str | Path] = ["chroot", rootfs, "/usr/bin/python3", "-m", "compileall", "-q", "-f"]
    base += ["--invalidation-mode", "checked-hash"]
    run([*base, "/" + AGENT_DEST], "compile", env=CHROOT_ENV, inherit_env=False)
    names = ["worker"] if spec.warm_config() is not None else []  # the Python the agent starts
    modules = ", ".join(names + (["gym_worker"] if spec.has_gym() else []))
    agent = f"import sys; sys.path.insert(0, '/{AGENT_DEST}'); import {modules}"
    guest: list[str | Path] = ["chroot", rootfs, "/usr/bin/python3", "-I", "-S", "-B", "-c", agent]
    run(guest, "compile", env=CHROOT_ENV, inherit_env=False)  # the guest's Python can load it
    others = [entry.dest for entry in spec.files]
    if site_packages(rootfs).is_dir():
        others.append("/" + str(site_packages(rootfs).relative_to(rootfs)))
    if others:
        run([*base, *others], "compile", env=CHROOT_ENV, inherit_env=False, ok_codes=(0, 1))
