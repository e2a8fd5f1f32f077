"""The native agent's own RESEED path (``fastseed.c``) reads the header the host really sends,
and only flat headers the general reader would take too (anything else goes to that reader).

A small C driver calls ``fastseed_parse`` on each line of its input. Protects: a clone's RESEED
answered on the fast path (its HELLO says ``fast_reseed``; the first version refused the host's
19-digit ``time_ns`` and fell back to the slow path unseen), and no header it should not read.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cleanroom.agent import native, protocol

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")

DRIVER = r"""
#include <stdio.h>
#include <string.h>
#include "fastseed.h"
int main(void) {
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        struct fastseed_header h;
        size_t n = strcspn(line, "\n");
        if (fastseed_parse((const unsigned char *)line, n, &h))
            printf("ok %s %lld %d\n", h.id, (long long)h.time_ns, h.has_time);
        else
            printf("no\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def parse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fastseed")
    (folder / "main.c").write_text(DRIVER)
    binary = folder / "parse"
    sources = [str(native.NATIVE_DIR / n) for n in ("fastseed.c", "frame.c", "json.c")]
    argv = ["gcc", "-O2", "-Wall", "-Werror", f"-I{native.NATIVE_DIR}", "-o", str(binary)]
    subprocess.run([*argv, str(folder / "main.c"), *sources], check=True)
    return binary


def run(binary: Path, lines: list[bytes]) -> list[str]:
    out = subprocess.run([str(binary)], input=b"\n".join(lines) + b"\n", capture_output=True)
    return out.stdout.decode().splitlines()


def test_the_header_the_host_sends_takes_the_fast_path(parse: Path) -> None:
    now = time.time_ns()
    frame = protocol.encode(protocol.Kind.RESEED, {"clone_id": "env-0123abcd", "time_ns": now})
    header = frame[11:]  # after the prefix: magic, kind, the two lengths
    spaced = json.dumps({"time_ns": 5, "clone_id": "env-x", "other": "y"}).encode()
    assert run(parse, [header, spaced]) == [f"ok env-0123abcd {now} 1", "ok env-x 5 1"]


@pytest.mark.parametrize(
    "header",
    [
        b'{"time_ns":1}',  # no clone id
        b'{"clone_id":"env/../x","time_ns":1}',  # not an id
        b'{"clone_id":"env-1","time_ns":01}',  # not JSON
        b'{"clone_id":"env-1","time_ns":99999999999999999999}',  # too large
        b'{"clone_id":"env-1","time_ns":1.5}',
        b'{"clone_id":"env-1","nested":{"a":1}}',
        b'{"clone_id":"env-\\u0031"}',  # an escape: the general reader decodes those
        b'{"clone_id":"env-1",}',
        b'{"clone_id":"env-1"} x',
    ],
)
def test_anything_else_is_left_to_the_general_reader(parse: Path, header: bytes) -> None:
    assert run(parse, [header]) == ["no"]
