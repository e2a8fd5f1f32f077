"""The native guest agent (C, static): its sources and the one way it is compiled.

Standard library only. The baseline builder compiles it for a baseline whose spec says
``[agent] kind = "native"`` (``baseline/rootfs.py``); the tests and ``make fuzz-native`` use
the same sources. ``CFLAGS`` are fixed and the compiler runs in this folder on relative names
(``-ffile-prefix-map``), so the same sources and compiler give the same bytes anywhere.
"""

from __future__ import annotations

import re
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent
SOURCES = (
    "agent.c", "fastseed.c", "frame.c", "gym.c", "json.c", "mux.c", "net.c", "proc.c",
    "pty.c", "tar.c", "tarpack.c", "warm.c",
)  # fmt: skip
HEADERS = (
    "fastseed.h", "frame.h", "gym.h", "json.h", "mux.h", "net.h", "proc.h", "pty.h", "tar.h",
    "warm.h",
)  # fmt: skip
FUZZ_SOURCES = (
    "fuzz_frame.c", "fastseed.c", "frame.c", "json.c", "mux.c", "proc.c", "pty.c", "tar.c",
    "tarpack.c",
)  # fmt: skip
FUZZ_TAR_SOURCES = ("fuzz_tar.c", "tar.c")
"""The tar reader's fuzz target (``make fuzz-native``): the reader and the name checks."""
CFLAGS = (
    "-static",
    "-O2",
    "-s",
    "-fstack-protector-strong",
    "-D_FORTIFY_SOURCE=2",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-pthread",
    f"-ffile-prefix-map={NATIVE_DIR}=.",
)
BINARY = "agent"
"""Its name in ``/opt/cleanroom/agent/`` of a native baseline (the initramfs starts it)."""
_VERSION_RE = re.compile(r'^#define AGENT_VERSION "([0-9][0-9.]*)"$', re.MULTILINE)


def files() -> tuple[str, ...]:
    """Every source the binary is made from (what a baseline's digest covers), sorted."""
    return tuple(sorted(SOURCES + HEADERS))


def gcc_argv(output: Path) -> list[str]:
    """The compiler command (run with ``cwd=NATIVE_DIR``) that writes the agent to ``output``."""
    return ["gcc", *CFLAGS, "-o", str(output), *SOURCES]


def agent_version() -> str | None:
    """``AGENT_VERSION`` of ``agent.c`` (None if the source names none)."""
    found = _VERSION_RE.search((NATIVE_DIR / "agent.c").read_text())
    return found.group(1) if found else None
