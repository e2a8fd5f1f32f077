"""Pause/resume and fork of served sandboxes, through the real e2b SDK, beside same-run references.

Two ``cleanroom serve`` processes on the same driver and baseline: one with forkable sandboxes
(the default: pause and fork need it), one with ``--no-forkable``. Interleaved, run by run:
  create -> first command        (``Sandbox.create`` + ``commands.run("true")``), on each server:
                                 what ``forkable`` costs at create
  pause                          (``sandbox.pause()``: snapshot sealed, VM destroyed, confirmed)
  resume -> first command        (``Sandbox.connect(id)`` + ``commands.run("true")``)
  fork into 4 -> 4 first commands (``sandbox.fork(count=4)``, then ``true`` in each)
Results: bench/results/serve_pause.txt (``--out``).

    python bench/serve_pause.py --driver qemu --baseline tests/baselines/tiny/baseline.toml
"""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from serve import _fake_baseline
from served import start_server
from stats import Table, parser, ratio, write

ROOT = Path(__file__).resolve().parent.parent


def _server(
    driver: str, digest: str, tmp: Path, *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    args = ["--driver", driver, "--template", f"b={digest}", "--per-key", "16",
            "--max-sandboxes", "32", *extra]  # fmt: skip
    return start_server(args, tmp / f"serve-{time.monotonic_ns()}.log", 60)


def main() -> None:
    p = parser(__doc__ or "", "serve_pause.txt", runs=10)
    p.add_argument("--driver", default="fake-snap")
    p.add_argument("--baseline", default=None, help="baseline ref (default: a fake baseline)")
    args = p.parse_args()
    os.environ.setdefault("CLEANROOM_HOME", str(ROOT / ".cache" / "bench-home"))
    tmp = Path(tempfile.mkdtemp(prefix="serve-pause-bench-"))
    from cleanroom.host import private

    private.check_home()
    if args.baseline is None:
        digest = _fake_baseline(tmp)
    else:
        from cleanroom.baseline.resolve import resolve_or_build

        digest = resolve_or_build(args.baseline).digest
    from e2b import Sandbox

    from cleanroom.server.keys import KeyRing

    key = KeyRing().create("bench")[1]
    forkable, url_f = _server(args.driver, digest, tmp)
    plain, url_p = _server(args.driver, digest, tmp, "--no-forkable")
    opts_f: dict[str, Any] = {"api_url": url_f, "sandbox_url": url_f, "api_key": key}
    opts_p: dict[str, Any] = {"api_url": url_p, "sandbox_url": url_p, "api_key": key}
    t: dict[str, list[float]] = {k: [] for k in ("plain", "forkable", "pause", "resume", "fork")}
    load0 = os.getloadavg()[0]
    try:
        for _ in range(args.runs):
            a = time.perf_counter()
            ref = Sandbox.create("b", timeout=600, **opts_p)
            ref.commands.run("true")
            t["plain"].append(time.perf_counter() - a)
            ref.kill()
            a = time.perf_counter()
            sbx = Sandbox.create("b", timeout=600, **opts_f)
            sbx.commands.run("true")
            t["forkable"].append(time.perf_counter() - a)
            sbx.files.write("/tmp/state.txt", "kept")
            a = time.perf_counter()
            sbx.pause()
            t["pause"].append(time.perf_counter() - a)
            a = time.perf_counter()
            back = Sandbox.connect(sbx.sandbox_id, timeout=600, **opts_f)
            back.commands.run("true")
            t["resume"].append(time.perf_counter() - a)
            assert back.files.read("/tmp/state.txt") == "kept"
            a = time.perf_counter()
            forks = back.fork(count=4)
            for f in forks:
                assert isinstance(f, Sandbox), f
                f.commands.run("true")
            t["fork"].append(time.perf_counter() - a)
            for f in forks:
                assert isinstance(f, Sandbox)
                f.kill()
            back.kill()
    finally:
        for proc in (forkable, plain):
            proc.terminate()
            proc.wait(120)
    table = Table(("n", "p50", "p95"), 44)
    lines = [
        f"# bench/serve_pause.py — {time.strftime('%Y-%m-%d %H:%M')} — driver {args.driver}, "
        f"baseline {args.baseline or 'fake'}, {os.cpu_count()} cores, {platform.machine()}; "
        f"load average (1 min) at the start {load0:.1f}, at the end {os.getloadavg()[0]:.1f}",
        f"# {args.runs} runs, interleaved: a --no-forkable server's sandbox, then a forkable one "
        "paused, resumed and forked into 4",
        "",
        table.header("served path (ms)"),
        table.row("create -> first command (--no-forkable)", t["plain"]),
        table.row("create -> first command (forkable)", t["forkable"]),
        table.row("pause (snapshot sealed, VM confirmed gone)", t["pause"]),
        table.row("resume (connect) -> first command", t["resume"]),
        table.row("fork into 4 -> 4 first commands", t["fork"]),
        "",
        f"# forkable create / --no-forkable create (p50): {ratio(t['forkable'], t['plain']):.2f}x",
        f"# resume -> first command / fresh forkable create (p50): "
        f"{ratio(t['resume'], t['forkable']):.2f}x",
        f"# fork into 4 / fresh forkable create (p50): {ratio(t['fork'], t['forkable']):.2f}x",
    ]
    write(args.out, lines)


if __name__ == "__main__":
    main()
