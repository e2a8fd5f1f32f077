"""The native guest agent (C, static): its sources and the one way it is compiled.

Standard library only. The baseline builder compiles it into every baseline
(``baseline/rootfs.py``); the fake driver runs ``host_binary()``; the tests and ``make
fuzz-native`` use the same sources. ``CFLAGS`` are fixed and the compiler runs in this folder on
relative names (``-ffile-prefix-map``), so the same sources and compiler give the same bytes
anywhere.
"""

from __future__ import annotations

import re
from pathlib import Path

from cleanroom.errors import ConfigError
from cleanroom.host import hostbuild

NATIVE_DIR = Path(__file__).resolve().parent
SOURCES = (
    "agent.c", "bulk.c", "fastseed.c", "frame.c", "gym.c", "json.c", "mux.c", "net.c", "port.c",
    "proc.c", "pty.c", "tar.c", "tarpack.c", "warm.c",
)  # fmt: skip
HEADERS = (
    "bulk.h", "fastseed.h", "frame.h", "gym.h", "json.h", "mux.h", "net.h", "port.h", "proc.h",
    "pty.h", "tar.h", "warm.h",
)  # fmt: skip
FUZZ_SOURCES = (
    "fuzz_frame.c", "bulk.c", "fastseed.c", "frame.c", "json.c", "mux.c", "port.c", "proc.c",
    "pty.c", "tar.c", "tarpack.c",
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
WORKER = NATIVE_DIR.parent / "worker.py"
"""The warm Python worker a function entrypoint runs in (the agent starts it from its folder)."""
GYM_FILES = ("gym_codec.py", "gym_worker.py", "protocol.py")
"""The gym process's files, beside the agent where a baseline has a gym config."""
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


def host_binary() -> Path:
    """The agent compiled by the host's gcc (the fake driver runs it as a host process), with
    the warm worker and the gym process's files beside it as in a baseline's
    ``/opt/cleanroom/agent/``; cached under
    ``cache_dir()/agent/`` by the digest of those sources and the flags. No gcc is a
    ``ConfigError`` that says so."""
    beside = [WORKER, *(NATIVE_DIR.parent / name for name in GYM_FILES)]
    sources = [NATIVE_DIR / name for name in files()] + beside
    return hostbuild.cached_binary(
        "agent",
        BINARY,
        hostbuild.source_key(sources, CFLAGS),
        lambda gcc, out: [gcc, *gcc_argv(out)[1:]],
        cwd=NATIVE_DIR,
        error=ConfigError,
        needed_by="the fake driver's guest agent (agent/native)",
        extras=beside,
    )
