"""What the build boundary costs: confined build steps against the same work unconfined.

    python bench/build.py [--runs 5] [--out bench/results/build.txt]

Rows, each beside a same-run reference:

- a sandbox's start: ``/bin/true`` in the builder sandbox (``confine.run_builder``) and with the
  tree as root (``run_in_tree``), against ``/bin/true`` as a plain subprocess;
- the Debian tree: the cached mmdebstrap tarball extracted by ``tar`` in the sandbox against the
  same ``tar`` on the host into a plain folder;
- a whole baseline build (``tests/baselines/tiny``, forced: kernel and tarball cached) with
  every step confined. (The unconfined builder is gone; the rows above are the difference.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from stats import Table, parser, ratio, write

from cleanroom.baseline import confine
from cleanroom.baseline.builder import build
from cleanroom.baseline.proc import quiet
from cleanroom.baseline.rootfs import base_tarball, extract_base, scratch_parent
from cleanroom.baseline.spec import BaseSection
from cleanroom.host.paths import cache_dir

TINY = Path(__file__).resolve().parents[1] / "tests" / "baselines" / "tiny" / "baseline.toml"


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    args = parser(__doc__ or "", "build.txt", 5).parse_args()
    tarball = base_tarball(BaseSection(), quiet, None)
    load = os.getloadavg()[0]
    lines = [f"bench/build.py, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, runs={args.runs}"]
    lines += [f"load average at the start: {load:.1f} (2 cores)", ""]
    table = Table(("n", "p50", "p95", "min", "max"), name_width=44)
    lines.append(table.header("sandbox start (ms)"))
    with confine.workspace(cache_dir()) as ws:
        plain = timed(lambda: subprocess.run(["/bin/true"], check=True), args.runs * 4)
        builder = timed(lambda: confine.run_builder(ws, ["/bin/true"], "bench"), args.runs * 4)
        shutil.copy("/bin/busybox", ws.tree / "busybox")
        tree = timed(lambda: confine.run_in_tree(ws, ["/busybox", "true"], "bench"), args.runs * 4)
    lines += [table.row("host subprocess /bin/true (reference)", plain)]
    lines += [table.row("builder sandbox /bin/true", builder)]
    lines += [table.ratio_row("/ reference", builder, plain)]
    lines += [table.row("tree-root sandbox true", tree)]
    lines += [table.ratio_row("/ reference", tree, plain), ""]

    lines.append(table.header("Debian tree extraction (ms)"))

    def host_tar() -> None:
        with tempfile.TemporaryDirectory(dir=scratch_parent()) as tmp:
            argv = ["tar", "-C", tmp, "--numeric-owner", "--exclude=./dev/*", "-xpf", str(tarball)]
            subprocess.run(argv, check=True)

    def confined_tar() -> None:
        with confine.workspace(scratch_parent()) as ws:
            extract_base(ws, tarball)

    host = timed(host_tar, args.runs)
    confined = timed(confined_tar, args.runs)
    lines += [table.row("tar on the host, as root (reference)", host)]
    lines += [table.row("tar in the sandbox + facts step", confined)]
    lines += [table.ratio_row("/ reference", confined, host), ""]

    lines.append(table.header("whole build of tests/baselines/tiny (ms)"))
    builds = timed(lambda: build(TINY, force=True), max(2, args.runs // 2))
    lines += [table.row("confined build (forced; downloads cached)", builds)]
    share = (ratio(confined, host) - 1) * (sum(host) / len(host)) / (sum(builds) / len(builds))
    lines.append(f"  extraction's extra cost as a share of the build: {share:.0%}")
    lines.append(f"load average at the end: {os.getloadavg()[0]:.1f}")
    write(args.out, lines)


if __name__ == "__main__":
    main()
