"""A Dockerfile as the base of a baseline, built daemonless with ``buildah``.

``build_image(dockerfile, context, work)`` runs ``buildah bud`` with its own throwaway storage
(``vfs`` under ``work``, so nothing of one build is seen by the next), ``RUN`` steps isolated by
``chroot`` (no container runtime needed), and pushes the result to an ``oci-archive`` that
``oci.fetch`` then reads like any other image. A ``FROM`` on a loopback registry is pulled
without TLS; a ``FROM`` that cannot be resolved (offline, unknown name) is a ``BuildError``
that says so, with buildah's own words.
"""

from __future__ import annotations

import re
from pathlib import Path

from cleanroom.baseline.proc import Progress, quiet, require_tool, run
from cleanroom.baseline.spec import SOURCE_DATE_EPOCH
from cleanroom.errors import BuildError

TAG = "localhost/cleanroom-build:latest"
UNRESOLVED = ("initializing source", "pinging container registry", "manifest unknown", "resolv")
"""What buildah says when a FROM image cannot be found or reached."""
FROM_RE = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)", re.IGNORECASE | re.MULTILINE)


def base_images(dockerfile: Path) -> list[str]:
    """The images a Dockerfile's ``FROM`` lines name (``scratch`` included)."""
    try:
        return FROM_RE.findall(dockerfile.read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        raise BuildError(f"dockerfile {dockerfile}: cannot read ({exc})") from exc


def _loopback(images: list[str]) -> bool:
    return any(i.startswith(("127.", "localhost:", "localhost/", "[::1]")) for i in images)


def build_image(dockerfile: Path, context: Path, work: Path, progress: Progress = quiet) -> str:
    """Build ``dockerfile`` in ``context``; the ``oci-archive:`` reference of the result."""
    buildah = require_tool("buildah")
    storage = ["--storage-driver", "vfs", "--root", str(work / "root")]
    storage += ["--runroot", str(work / "runroot")]
    images = base_images(dockerfile)
    progress("dockerfile", f"buildah bud {dockerfile.name} (FROM {', '.join(images) or '?'})")
    argv = [buildah, *storage, "bud", "--quiet", "--isolation", "chroot", "--layers=false"]
    argv.append(f"--timestamp={SOURCE_DATE_EPOCH}")  # the same inputs give the same bytes
    if _loopback(images):
        argv.append("--tls-verify=false")  # a registry on this machine serves plain HTTP
    argv += ["--file", str(dockerfile), "--tag", TAG, str(context)]
    try:
        run(argv, "dockerfile", env={"BUILDAH_ISOLATION": "chroot"})
    except BuildError as exc:
        hint = ""
        if any(sign in str(exc) for sign in UNRESOLVED):
            hint = f" (a FROM image could not be resolved: {', '.join(images)})"
        raise BuildError(f"dockerfile {dockerfile}: build failed{hint}: {exc}") from exc
    archive = work / "image.tar"
    run([buildah, *storage, "push", "--quiet", TAG, f"oci-archive:{archive}"], "dockerfile")
    return f"oci-archive:{archive}"
