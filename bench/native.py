"""The native guest agent against the Python one, same run, same machine (issue 17).

Two baselines that differ only in ``[agent] kind`` (tests/baselines/shell and shell-native:
Debian minbase, a one-line shell entrypoint writing result.json). For each, interleaved so
machine noise hits both alike:
  spare clone -> agent ready               (a clone started ahead and paused; create -> HELLO)
    of it, RESEED -> HELLO in the guest    (the agent's own ``reseed_ms``: the rest is the host,
                                           QEMU's resume and the guest's wake-up)
  spare clone -> first `true` answered     (same clones: create + one EXEC)
  command episode in a fresh clone         (RUN -> DONE of the entrypoint, agent ready before)
Every native row is also given as a ratio to the Python row of the same run.
Results: bench/results/native.txt.

    python bench/native.py [--runs 15]
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile
from pathlib import Path

from start import ROOT, request, timed_env, timed_episode
from stats import Table, parser, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.drivers.qemu import QemuDriver

SPECS = {
    "python": ROOT / "tests" / "baselines" / "shell" / "baseline.toml",
    "native": ROOT / "tests" / "baselines" / "shell-native" / "baseline.toml",
}
ROWS = (
    ("ready", "spare clone -> agent ready"),
    ("reseed", "  of it, RESEED -> HELLO in the guest"),
    ("exec", "spare clone -> first `true`"),
    ("episode", "command episode (fresh clone)"),
)


async def main() -> None:
    args = parser(__doc__, "native.txt", runs=15).parse_args()
    load_at_start = os.getloadavg()[0]
    baselines = {
        kind: resolve_or_build(str(spec), progress=lambda s, d: print(f"build {s}: {d}"))
        for kind, spec in SPECS.items()
    }
    drivers = {kind: QemuDriver(start="snapshot") for kind in SPECS}
    times: dict[str, dict[str, list[float]]] = {k: {r: [] for r, _ in ROWS} for k in SPECS}
    hello = {}
    for kind, driver in drivers.items():
        driver.keep_spares(1)
        first = await driver.create(request(baselines[kind], driver))  # template, first spare
        hello[kind] = first.hello.get("agent_version")
        await first.aclose()
    with tempfile.TemporaryDirectory(prefix="bench-native-") as tmp:
        for _ in range(args.runs):
            for kind, driver in drivers.items():
                spare = await timed_env(driver, baselines[kind], python=False, spare=True)
                times[kind]["ready"].append(spare["ready"])
                times[kind]["reseed"].append(spare["reseed"])  # both agents report it
                times[kind]["exec"].append(spare["exec"])
                episode = await timed_episode(driver, baselines[kind], Path(tmp))
                times[kind]["episode"].append(episode)
    for driver in drivers.values():
        await driver.release_spares()

    table = Table(("n", "p50", "p95", "min"), name_width=40)
    lines = [
        f"bench/native.py: {platform.node()}, {os.cpu_count()} cores, "
        f"load {load_at_start:.1f} -> {os.getloadavg()[0]:.1f}, {args.runs} runs each, "
        f"interleaved; agents: python {hello['python']}, native {hello['native']}",
        "baselines: tests/baselines/shell (python) and shell-native (native), same content",
        "",
    ]
    for kind in SPECS:
        lines.append(table.header(f"{kind} agent"))
        lines += [table.row(name, times[kind][key]) for key, name in ROWS]
        lines.append("")
    lines.append("native / python, p50 of the same run:")
    lines += [
        table.ratio_row(name, times["native"][key], times["python"][key]) for key, name in ROWS
    ]
    write(args.out, lines)


if __name__ == "__main__":
    asyncio.run(main())
