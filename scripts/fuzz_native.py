"""Fuzz the native agent's frame reader and JSON walker (``agent/native/fuzz_frame.c``) and its
tar reader (``fuzz_tar.c``) with libFuzzer under ASan and UBSan: ``make fuzz-native``
(1,000,000 inputs each), and a short run in the test suite. The corpora start from real frames
the host sends (``protocol.encode``) and from archives Python's ``tarfile`` writes.

Exit status: libFuzzer's (0: no crash, no leak, no undefined behaviour); 77 if clang or its
libFuzzer runtime is missing (Debian: clang, libclang-rt-14-dev; scripts/setup.sh installs them).
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
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
        protocol.encode(Kind.DOWNLOAD, {"id": 6, "path": "/tmp/x", "tar": False}),
        protocol.encode(Kind.FS, {"id": 7, "op": "list", "path": "/tmp", "depth": 2}),
        protocol.encode(Kind.RESEED, {"clone_id": "env-1", "time_ns": 10**18}, b"\0" * 64),
        protocol.encode(Kind.EXEC, {"id": 1, "argv": ["cat"], "stdin": True, "user": "root"}),
        protocol.encode(Kind.STDIN, {"id": 1, "eof": True}, b"input"),
        protocol.encode(Kind.UPLOAD, {"id": 2, "path": "/tmp/x", "mode": 420, "tar": False}),
        protocol.encode(Kind.DATA, {"id": 2, "offset": 0, "eof": True}, b"data"),
        protocol.encode(Kind.ACK, {"id": 3, "size": 262144}),
        protocol.encode(Kind.KILL, {"id": 1.5}),
        protocol.encode(Kind.CONNECT, {"id": 4, "port": 8000}),
        protocol.encode(Kind.CONNECT, {"id": 5, "port": 65536}),
        protocol.encode(Kind.DATA, {"id": 4, "offset": 0, "eof": True}, b"GET / HTTP/1.0\r\n\r\n"),
    ]
    return [*frames, frames[0] + frames[3]]


def tar_seeds() -> list[bytes]:
    """Archives in each format tarfile writes: files, a folder, links, long and hostile names."""
    out = []
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
            for name, kind, link in (
                ("d", tarfile.DIRTYPE, ""),
                ("d/f", tarfile.REGTYPE, ""),
                ("d/" + "n" * 99, tarfile.REGTYPE, ""),
                ("d/l", tarfile.SYMTYPE, "f"),
                ("h", tarfile.LNKTYPE, "d/f"),
                ("../up", tarfile.SYMTYPE, "../../x"),
                ("d/" + "\u00e9" * 60, tarfile.REGTYPE, ""),
            ):
                if fmt == tarfile.USTAR_FORMAT and len(name.encode()) > 100:
                    continue
                info = tarfile.TarInfo(name)
                info.type, info.linkname = kind, link
                data = b"data" if kind == tarfile.REGTYPE else b""
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        out.append(buffer.getvalue())
    return out


TARGETS = {  # name: (sources, seeds, max_len)
    "fuzz_frame": (native.FUZZ_SOURCES, seeds, 8192),
    "fuzz_tar": (native.FUZZ_TAR_SOURCES, tar_seeds, 65536),
}


def fuzz(name: str, tmp: Path, runs: int, max_time: int) -> int:
    """Build one target and run it; libFuzzer's status (SKIP: no clang runtime)."""
    sources, make_seeds, max_len = TARGETS[name]
    binary, corpus = tmp / name, tmp / f"corpus-{name}"
    built = subprocess.run(
        ["clang", *FLAGS, "-o", str(binary), *sources],
        cwd=native.NATIVE_DIR,
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        print(f"fuzz-native: cannot build {name}:\n{built.stderr}", file=sys.stderr)
        return SKIP if "libclang_rt" in built.stderr else built.returncode
    corpus.mkdir()
    for index, seed in enumerate(make_seeds()):
        (corpus / f"seed-{index}").write_bytes(seed)
    argv = [str(binary), f"-runs={runs}", f"-max_len={max_len}", "-print_final_stats=1"]
    if max_time:
        argv.append(f"-max_total_time={max_time}")
    print(f"fuzz-native: {name} ({runs} inputs)", file=sys.stderr, flush=True)
    return subprocess.run([*argv, str(corpus)], check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--max-time", type=int, default=0, help="seconds (0: no limit)")
    args = parser.parse_args()
    if shutil.which("clang") is None:
        print("fuzz-native: clang not installed", file=sys.stderr)
        return SKIP
    with tempfile.TemporaryDirectory(prefix="cleanroom-fuzz-native-") as tmp:
        for name in TARGETS:
            status = fuzz(name, Path(tmp), args.runs, args.max_time)
            if status != 0:
                return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
