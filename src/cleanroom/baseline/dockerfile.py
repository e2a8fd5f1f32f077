"""A Dockerfile as the base of a baseline, built daemonless with ``buildah``, confined.

``build_image(dockerfile, context, work)`` runs ``buildah`` inside the build sandbox
(``confine.py``: an unprivileged host uid range, its own namespaces), with its own throwaway
storage (``vfs``, so nothing of one build is seen by the next), ``RUN`` steps isolated by
``chroot`` inside that sandbox, and pushes the result to an ``oci-archive`` that ``oci.fetch``
then reads like any other image. Two phases, so that no image content ever runs with the host's
network: the ``FROM`` images are pulled with the host's network (``buildah pull``: no image code
runs), then the build runs with ``--pull never`` in a sandbox whose network namespace has only a
loopback of its own: ``RUN`` steps are offline. A ``FROM`` on a loopback registry is pulled
without TLS; a ``FROM`` that cannot be resolved (offline, unknown name) is a ``BuildError`` that
says so, with buildah's own words.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

from cleanroom.baseline import confine
from cleanroom.baseline.confine import Bind, Workspace
from cleanroom.baseline.proc import Progress, quiet, require_tool
from cleanroom.baseline.spec import SKIP_NAMES, SOURCE_DATE_EPOCH
from cleanroom.errors import BuildError

TAG = "localhost/cleanroom-build:latest"
UNRESOLVED = ("initializing source", "pinging container registry", "manifest unknown", "resolv")
"""What buildah says when a FROM image cannot be found or reached."""
FROM_RE = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)", re.IGNORECASE | re.MULTILINE)
ALIAS_RE = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*\S+\s+AS\s+(\S+)", re.IGNORECASE | re.MULTILINE)
STORAGE = "/work/storage"
BUILD_TIMEOUT_S = 3600.0
PULL_TIMEOUT_S = 900.0


def base_images(dockerfile: Path) -> list[str]:
    """The images a Dockerfile's ``FROM`` lines name (``scratch`` included)."""
    return FROM_RE.findall(_text(dockerfile))


def _text(dockerfile: Path) -> str:
    try:
        return dockerfile.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise BuildError(f"dockerfile {dockerfile}: cannot read ({exc})") from exc


def pulled_images(dockerfile: Path) -> list[str]:
    """The ``FROM`` images to pull: not ``scratch``, not an earlier stage's name."""
    text = _text(dockerfile)
    aliases = {alias.lower() for alias in ALIAS_RE.findall(text)}
    wanted = []
    for image in FROM_RE.findall(text):
        if image.lower() != "scratch" and image.lower() not in aliases and image not in wanted:
            wanted.append(image)
    return wanted


def _loopback(image: str) -> bool:
    return image.startswith(("127.", "localhost:", "localhost/", "[::1]"))


def _buildah(ws: Workspace, args: list[str], step: str, *, network: bool, timeout_s: float) -> None:
    argv = [require_tool("buildah"), "--storage-driver", "vfs", "--root", STORAGE]
    argv += ["--runroot", "/work/run", *args]
    env = {
        **confine.TREE_ENV,
        "HOME": "/work",
        "TMPDIR": "/work/tmp",
        "BUILDAH_ISOLATION": "chroot",
    }
    binds = [Bind(ws.folder / "buildah", "/work", writable=True), Bind(ws.stage, "/in")]
    confine.run_builder(
        ws, argv, step, binds=binds, env=env, network=network, proc=True, timeout_s=timeout_s
    )


def _stage(dockerfile: Path, context: Path, ws: Workspace) -> None:
    """The context and the Dockerfile, copied where namespace root can read them."""
    ignore = shutil.ignore_patterns(*SKIP_NAMES)
    shutil.copytree(context, ws.stage / "context", symlinks=True, ignore=ignore)
    shutil.copyfile(dockerfile, ws.stage / "Dockerfile")
    for path in [ws.stage, *ws.stage.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
    work = ws.folder / "buildah"
    for folder in (work, work / "tmp"):
        folder.mkdir()
        os.chown(folder, ws.ids.base, ws.ids.base)


def build_image(dockerfile: Path, context: Path, work: Path, progress: Progress = quiet) -> str:
    """Build ``dockerfile`` in ``context``; the ``oci-archive:`` reference of the result."""
    images = base_images(dockerfile)
    progress("dockerfile", f"buildah bud {dockerfile.name} (FROM {', '.join(images) or '?'})")
    work.mkdir(parents=True, exist_ok=True)
    archive = work / "image.tar"
    with confine.workspace(work) as ws:
        _stage(dockerfile, context, ws)
        try:
            for image in pulled_images(dockerfile):
                progress("dockerfile", f"buildah pull {image} (confined)")
                tls = ["--tls-verify=false"] if _loopback(image) else []
                args = ["pull", "--quiet", *tls, image]
                _buildah(ws, args, "dockerfile", network=True, timeout_s=PULL_TIMEOUT_S)
            progress("dockerfile", "buildah bud (confined, RUN offline)")
            args = ["bud", "--quiet", "--isolation", "chroot", "--layers=false", "--pull=never"]
            args += [f"--timestamp={SOURCE_DATE_EPOCH}"]  # the same inputs give the same bytes
            args += ["--file", "/in/Dockerfile", "--tag", TAG, "/in/context"]
            _buildah(ws, args, "dockerfile", network=False, timeout_s=BUILD_TIMEOUT_S)
            args = ["push", "--quiet", TAG, "oci-archive:/work/image.tar"]
            _buildah(ws, args, "dockerfile", network=False, timeout_s=PULL_TIMEOUT_S)
        except BuildError as exc:
            hint = ""
            if any(sign in str(exc) for sign in UNRESOLVED):
                hint = f" (a FROM image could not be resolved: {', '.join(images)})"
            raise BuildError(f"dockerfile {dockerfile}: build failed{hint}: {exc}") from exc
        made = ws.folder / "buildah" / "image.tar"
        if not stat.S_ISREG(os.lstat(made).st_mode):
            raise BuildError(f"dockerfile {dockerfile}: buildah made no regular image archive")
        shutil.copyfile(made, archive, follow_symlinks=False)
    return f"oci-archive:{archive}"
