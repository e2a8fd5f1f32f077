"""The guest's Python layer: pip wheels for the tree, then byte-compiling it.

``stage_pip`` installs wheels for the *guest's* Python (version, ABI and glibc platform, the
version read from the tree by the sandbox) with ``pip --target`` into a staging folder on the
host, never into the tree; the build sandbox copies them to
``/usr/local/lib/python3.X/dist-packages`` (``treefiles.install_wheels``), console scripts to
``/usr/local/bin`` with a ``/usr/bin/python3`` shebang.

``byte_compile`` runs the guest's own Python with the tree as its root, unprivileged
(``confine.run_in_tree``), with ``--invalidation-mode checked-hash`` and ``PYTHONHASHSEED=0``:
no mtimes in the ``.pyc`` files, a stable frozenset order, and still correct if an episode
edits a source file in its overlay. Then the agent is imported once the way init runs it
(``-I -S``), so a module missing from the image fails the build instead of every boot.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from cleanroom.baseline.confine import Workspace, run_in_tree
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
GUEST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONHASHSEED": "0", "LC_ALL": "C"}
"""The environment of the image's Python when the build runs it (nothing of the host's)."""


# -- pip ------------------------------------------------------------------------------------------


def site_folder(version: str) -> str:
    """The guest folder pip's wheels go to, for the guest's Python ``version``."""
    return f"/usr/local/lib/python{version}/dist-packages"


def stage_pip(
    requirements: list[str],
    version: str | None,
    staged: Path,
    progress: Progress = quiet,
    locked: list[dict[str, str]] | None = None,
) -> list[dict[str, str]]:
    """Install wheels for the guest's Python ``version`` into the host folder ``staged``;
    with ``locked`` (a lock's ``pip``), exactly those wheels, checked by hash. Returns the
    wheels installed (the lock's ``pip``)."""
    if not requirements:
        return []
    if version is None:
        raise BuildError("pip: the image has no /usr/bin/python3 to install wheels for")
    progress("pip", f"installing {len(requirements)} requirement(s) for Python {version}")
    work = Path(tempfile.mkdtemp(prefix="cleanroom-pip-"))
    report = work / "report.json"
    wanted: list[str] = list(requirements)
    if locked is not None:
        (work / "locked.txt").write_text(pip_requirements(locked))
        wanted = ["--require-hashes", "--no-deps", "-r", str(work / "locked.txt")]
    try:
        _pip(version, staged, wanted, report)
        return pip_items(json.loads(report.read_text()))
    except (OSError, ValueError) as exc:
        raise BuildError(f"pip: no install report ({exc})") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


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


# -- compile --------------------------------------------------------------------------------------


def byte_compile(
    ws: Workspace, spec: BaselineSpec, version: str | None, progress: Progress = quiet
) -> None:
    """Byte-compile the agent (must succeed), then pip packages and spec files (best effort:
    wheels and user folders may hold files that are not valid Python 3, e.g. templates), each
    by the guest's own Python with the tree as its root (``confine.run_in_tree``)."""
    progress("compile", "byte-compiling with the guest's Python (confined)")
    base = ["/usr/bin/python3", "-m", "compileall", "-q", "-f"]
    base += ["--invalidation-mode", "checked-hash"]
    run_in_tree(ws, [*base, "/" + AGENT_DEST], "compile", env=GUEST_ENV)
    names = ["worker"] if spec.warm_config() is not None else []  # the Python the agent starts
    modules = ", ".join(names + (["gym_worker"] if spec.has_gym() else []))
    agent = f"import sys; sys.path.insert(0, '/{AGENT_DEST}'); import {modules}"
    guest = ["/usr/bin/python3", "-I", "-S", "-B", "-c", agent]
    run_in_tree(ws, guest, "compile", env=GUEST_ENV)  # the guest's Python can load it
    others = [entry.dest for entry in spec.files]
    if version is not None:
        others.append(site_folder(version))  # compileall skips it where it is missing
    if others:
        run_in_tree(ws, [*base, *others], "compile", env=GUEST_ENV, ok_codes=(0, 1))
