"""The canary for guests without Python: ``canary.c`` built once, static, on the host.

``canary_binary()`` compiles it with ``gcc -static`` into ``cache_dir()/isolation/`` under the
hash of its source (``hostbuild``: an edited canary is rebuilt, an unchanged one never); no
``gcc`` is a ``CheckError`` that says so. ``plant.run_canary`` PUTs it into an env whose agent
is the native one (a busybox-only or distroless image has no ``python3`` for ``canary.py``).
"""

from __future__ import annotations

from pathlib import Path

from cleanroom.errors import CheckError
from cleanroom.host.hostbuild import cached_binary, source_key

SOURCE = Path(__file__).with_name("canary.c")
CFLAGS = ("-static", "-O2", "-s", "-Wall", "-Wextra")


def canary_binary() -> Path:
    """The compiled canary (built here on first use)."""
    return cached_binary(
        "isolation",
        "canary",
        source_key([SOURCE], CFLAGS),
        lambda gcc, out: [gcc, *CFLAGS, "-o", str(out), str(SOURCE)],
        cwd=SOURCE.parent,
        error=CheckError,
        needed_by="the native canary",
    )
