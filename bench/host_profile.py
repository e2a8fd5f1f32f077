"""Where the host's CPU goes while trivial episodes run back to back: ``perf`` over a batch.

Runs --batches batches of --episodes trivial function episodes (tests/baselines/warm) at
--parallel 2 with no spares (the default on 2 cores), one warm-up batch first, and samples every
core with ``perf record -a -e cpu-clock`` while the measured batches run. The samples are then
split by process (QEMU, the controller, the launch chain ``setpriv``/``sh``/``timeout``, the
idle kernel, the rest) and QEMU's further by part:

- TCG translation: QEMU's translator, optimizer and code generator (``tcg_*``, ``tb_gen_code``,
  ``translator_*``, the x86 front end);
- guest code running: samples in QEMU's translated code (perf's ``[JIT]`` maps);
- QEMU's other code (device emulation, the softmmu TLB, the main loop, start-up), its libraries
  (glib, libc, the dynamic loader) and its kernel time (page faults, exit).

Debian's QEMU keeps only exported symbols, so a sample in a static function is named by the
exported symbols around it: it counts as translation where the one before or after it is a
translator symbol (in QEMU 7.2 the statics of ``tcg/optimize.c`` lie before ``tcg_optimize``,
those of ``target/i386/tcg/translate.c`` before ``tcg_x86_init``). That range before
``tcg_x86_init`` also holds some interrupt helpers, so the translation share is an estimate,
given with the part named outright (a floor). Needs ``perf`` (``apt-get install linux-perf``).
Results: bench/results/host-profile.txt.

    python bench/host_profile.py [--episodes 24] [--batches 2] [--hz 999]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stats import RESULTS, write

from cleanroom.drivers.accel import kvm_known_usable

QEMU_BIN = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
TRANSLATOR = re.compile(r"^(tcg_(?!flush)|tb_gen_code$|translator_|gen_intermediate_code$)")
LAUNCH_CHAIN = {"setpriv", "sh", "timeout"}
TRANSLATION = "QEMU: TCG translation"
NAMED = "  of it in symbols named outright (a floor)"
QEMU_OTHER = "QEMU: its other code (devices, softmmu, main loop)"
UNREAD = "rows perf printed that this script could not read"
ORDER = (
    TRANSLATION,
    NAMED,
    "QEMU: guest code running (translated)",
    QEMU_OTHER,
    "QEMU: libraries (glib, libc, dynamic loader)",
    "QEMU: host kernel (page faults, exit, scheduling)",
    "controller (Python)",
    "launch chain (setpriv, sh, timeout)",
    "other processes",
    UNREAD,
)
PERF_REPORT = ["perf", "report", "-n", "--no-children", "-g", "none", "-q"]
PERF_REPORT += ["--sort", "comm,dso,sym"]  # a row: percent, samples, comm, dso, [k] symbol
SAMPLES = re.compile(r"^\s*[\d.]+%\s+(\d+)\s")
ROW = re.compile(r"^\s*[\d.]+%\s+(\d+)\s+(\S+)\s+(.+?)\s+\[(.)\]\s+(\S+)\s*$")


def exported_symbols(binary: str) -> tuple[list[int], list[str]]:
    """The binary's exported functions, sorted by address."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", binary], capture_output=True, text=True, check=True
    ).stdout
    pairs = sorted(
        (int(parts[0], 16), parts[2])
        for parts in (line.split() for line in out.splitlines())
        if len(parts) == 3 and parts[1] in "Tt"
    )
    return [a for a, _ in pairs], [n for _, n in pairs]


def is_translation(symbol: str, addrs: list[int], names: list[str]) -> tuple[bool, bool]:
    """(named outright, or between translator symbols) for one of QEMU's own samples."""
    if not symbol.startswith("0x"):
        named = bool(TRANSLATOR.match(symbol))
        return named, named
    at = bisect.bisect_right(addrs, int(symbol, 16))
    around = [names[i] for i in (at - 1, at) if 0 <= i < len(names)]
    return False, any(TRANSLATOR.match(n) for n in around)


def classify(report: str, addrs: list[int], names: list[str]) -> dict[str, float]:
    """Percent of all samples per part, from ``PERF_REPORT``'s rows (their sample counts: the
    percents perf prints are rounded, and thousands of small rows add up their rounding)."""
    parts: dict[str, int] = collections.defaultdict(int)
    for line in report.splitlines():
        m = ROW.match(line)
        if m is None:
            lead = SAMPLES.match(line)
            if lead is not None:  # a row this parser cannot read: said, not dropped
                parts[UNREAD] += int(lead[1])
            continue
        samples, comm, dso, _, symbol = int(m[1]), m[2], m[3], m[4], m[5]
        if comm.startswith("qemu-system"):
            if "[JIT]" in dso or dso in ("[unknown]", "//anon"):  # its only anonymous code
                parts["QEMU: guest code running (translated)"] += samples
            elif dso.startswith("qemu-system"):
                named, estimated = is_translation(symbol, addrs, names)
                parts[NAMED] += samples if named else 0
                parts[TRANSLATION if estimated else QEMU_OTHER] += samples
            elif dso == "[kernel.kallsyms]":
                parts["QEMU: host kernel (page faults, exit, scheduling)"] += samples
            else:
                parts["QEMU: libraries (glib, libc, dynamic loader)"] += samples
        elif comm == "swapper":
            parts["idle"] += samples
        elif comm in ("python", "python3") or comm.startswith("python3."):
            parts["controller (Python)"] += samples
        elif comm in LAUNCH_CHAIN:
            parts["launch chain (setpriv, sh, timeout)"] += samples
        else:
            parts["other processes"] += samples
    total = sum(n for name, n in parts.items() if name != NAMED) or 1
    return {name: n * 100 / total for name, n in parts.items()}


async def measured(episodes: int, batches: int, hz: int, data: Path) -> list[dict[str, float]]:
    import spares  # the batch and the baselines of bench/spares.py (imported here: the
    import start  # classification above needs no VM, and its test loads this file alone)

    from cleanroom.baseline.resolve import resolve_or_build

    baseline = resolve_or_build(str(start.WARM))
    await spares.batch(baseline, 4, 2, 0)  # the template, and a first batch
    perf = subprocess.Popen(
        ["perf", "record", "-a", "-e", "cpu-clock", "-F", str(hz), "-o", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    await asyncio.sleep(0.5)  # perf's own start
    try:
        return [await spares.batch(baseline, episodes, 2, 0) for _ in range(batches)]
    finally:
        perf.send_signal(signal.SIGINT)  # perf writes its data and exits
        perf.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--hz", type=int, default=999)
    parser.add_argument("--out", type=Path, default=RESULTS / "host-profile.txt")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        sys.exit("host_profile: needs perf (apt-get install linux-perf)")
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        rates = asyncio.run(measured(args.episodes, args.batches, args.hz, data))
        report = subprocess.run(
            [*PERF_REPORT, "-i", str(data)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    addrs, names = exported_symbols(QEMU_BIN)
    parts = classify(report, addrs, names)
    per_episode = sum(r["host_ms"] for r in rates) / len(rates)
    busy = 100.0 - parts.get("idle", 0.0)
    accel = "KVM" if kvm_known_usable() else "TCG"
    lines = [
        f"# bench/host_profile.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores, {accel}; load average (1 min) at the start {load0:.1f}, "
        f"at the end {os.getloadavg()[0]:.1f}",
        f"# {args.batches} batches x {args.episodes} trivial function episodes (warm baseline), "
        "--parallel 2, no spares; perf record -a -e cpu-clock over them",
        "",
        *(
            f"batch {i + 1}: {r['episodes']:.2f} episodes/s, host CPU {r['host_ms']:.0f} ms "
            f"an episode (controller {r['controller_ms']:.0f} ms)"
            for i, r in enumerate(rates)
        ),
        "",
        f"{'part of the host CPU':52s} {'% busy':>7s} {'ms/episode':>11s}",
    ]
    for name in ORDER:
        share = parts.get(name, 0.0) / busy
        lines.append(f"{name:52s} {share * 100:6.1f}% {share * per_episode:10.1f}")
    lines.append(f"{'(idle, % of all samples)':52s} {parts.get('idle', 0.0):6.1f}%")
    write(args.out, lines)


if __name__ == "__main__":
    main()
