"""Fuzz the native agent's frame reader and JSON walker (``agent/native/fuzz_frame.c``) with
libFuzzer under ASan and UBSan: ``make fuzz-native`` (1,000,000 inputs), and a short run in the
test suite. The corpus starts from real frames the host sends (``protocol.encode``).

Exit status: libFuzzer's (0: no crash, no leak, no undefined behaviour); 77 if clang or its
libFuzzer runtime is missing (Debian: clang, libclang-rt-14-dev; scripts/setup.sh installs them).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cleanroom.agent import native, protocol
from cleanroom.agent.protocol import Kind

FLAGS = ("-g", "-O1", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined")
SKIP = 77


def seeds() -> list[bytes]:
    """A frame of each request the host sends, and two in one stream."""
    run = {
        "manifest": {"episode_id": "e", "task": {"a": [1, 2.5, None, True]}},
        "entrypoint": ["/bin/sh", "-c", "echo \u00e9"],
        "env": {"A": "1"},
        "timeout_s": 1.5,
        "secret_files": {"token": "x"},
        "secret_lifetimes": {"token": 2},
    }
    frames = [
        protocol.encode(Kind.PING, {"t": 1.25}),
        protocol.encode(Kind.RUN, run),
        protocol.encode(Kind.EXEC, {"argv": ["true"], "cwd": "/", "timeout_s": None}),
        protocol.encode(Kind.PUT, {"path": "/tmp/x", "mode": 420, "offset": 0}, b"data"),
        protocol.encode(Kind.GET, {"path": "/tmp/x"}),
        protocol.encode(Kind.RESEED, {"clone_id": "env-1", "time_ns": 10**18}, b"\0" * 64),
        protocol.encode(Kind.EXEC, {"id": 1, "argv": ["cat"], "stdin": True, "user": "root"}),
        protocol.encode(Kind.STDIN, {"id": 1, "eof": True}, b"input"),
        protocol.encode(Kind.UPLOAD, {"id": 2, "path": "/tmp/x", "mode": 420, "tar": False}),
        protocol.encode(Kind.DATA, {"id": 2, "offset": 0, "eof": True}, b"data"),
        protocol.encode(Kind.ACK, {"id": 3, "size": 262144}),
        protocol.encode(Kind.KILL, {"id": 1.5}),
    ]
    return [*frames, frames[0] + frames[3]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--max-time", type=int, default=0, help="seconds (0: no limit)")
    args = parser.parse_args()
    if shutil.which("clang") is None:
        print("fuzz-native: clang not installed", file=sys.stderr)
        return SKIP
    with tempfile.TemporaryDirectory(prefix="cleanroom-fuzz-native-") as tmp:
        binary, corpus = Path(tmp) / "fuzz_frame", Path(tmp) / "corpus"
        built = subprocess.run(
            ["clang", *FLAGS, "-o", str(binary), *native.FUZZ_SOURCES],
            cwd=native.NATIVE_DIR,
            capture_output=True,
            text=True,
            check=False,
        )
        if built.returncode != 0:
            print(f"fuzz-native: cannot build the target:\n{built.stderr}", file=sys.stderr)
            return SKIP if "libclang_rt" in built.stderr else built.returncode
        corpus.mkdir()
        for index, seed in enumerate(seeds()):
            (corpus / f"seed-{index}").write_bytes(seed)
        argv = [str(binary), f"-runs={args.runs}", "-max_len=8192", "-print_final_stats=1"]
        if args.max_time:
            argv.append(f"-max_total_time={args.max_time}")
        return subprocess.run([*argv, str(corpus)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
