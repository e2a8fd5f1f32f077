"""The canary for guests without Python: ``canary.c`` built once, static, on the host.

``canary_binary()`` compiles it with ``gcc -static`` into ``cache_dir()/isolation/`` under the
hash of its source (so an edited canary is rebuilt, an unchanged one never), atomically; no
``gcc`` is a ``CheckError`` that says so. ``plant.run_canary`` PUTs it into an env whose agent
is the native one (a busybox-only or distroless image has no ``python3`` for ``canary.py``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from cleanroom.errors import CheckError
from cleanroom.paths import cache_dir

SOURCE = Path(__file__).with_name("canary.c")
CFLAGS = ("-static", "-O2", "-s", "-Wall", "-Wextra")


def canary_binary() -> Path:
    """The compiled canary (built here on first use)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    binary = cache_dir() / "isolation" / f"canary-{key}"
    if binary.is_file():
        return binary
    gcc = shutil.which("gcc")
    if gcc is None:
        raise CheckError("the native canary needs gcc on the host (make setup installs it)")
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f".{binary.name}.{os.getpid()}")
    proc = subprocess.run(
        [gcc, *CFLAGS, "-o", str(partial), str(SOURCE)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise CheckError(f"cannot compile {SOURCE.name}: {proc.stderr.strip()[-400:]}")
    os.replace(partial, binary)
    return binary
