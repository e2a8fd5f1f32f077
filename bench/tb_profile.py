"""What a fresh clone translates during one trivial function episode (RUN -> DONE), or with
``--step ready`` while it answers its RESEED (RESEED sent -> HELLO: any baseline), by place.

Under TCG a clone's cost is mostly translating the guest code it runs for the first time. This
turns on QEMU's ``in_asm`` log (HMP ``log`` over the clone's QMP socket) just before RUN and
off after DONE, then attributes every translated block to a kernel symbol (the guest's
``/proc/kallsyms``; the kernel runs with ``nokaslr``) or to a user-space mapping of the
guest's processes (their ``/proc/PID/maps`` read after the episode: a clone's processes are
restored, so their layout is fixed). Prints the places with the most blocks and guest
instructions translated.

    python bench/tb_profile.py [--top 40] [--baseline tests/baselines/warm/baseline.toml]
    python bench/tb_profile.py --step ready --baseline tests/baselines/shell/baseline.toml \
        --symbols agent=/tmp/agent-unstripped   # the native agent's blocks by function

``--symbols NAME=BINARY`` names the blocks of the guest mapping ``NAME`` (a static, non-PIE
program: the native agent) by the functions of ``BINARY``, the same build without ``-s``
(stripping drops the symbol table only, not a byte of ``.text``).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import os
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WARM = ROOT / "tests" / "baselines" / "warm" / "baseline.toml"
KERNEL_BASE = 0xFFFF_8000_0000_0000
MAPS = (
    'for p in /proc/[0-9]*; do echo "== ${p#/proc/} $(cat $p/comm)"; cat $p/maps; done 2>/dev/null'
)


def read_blocks(log: Path) -> list[tuple[int, int]]:
    """(address, guest instructions) of every block in an ``in_asm`` log."""
    blocks: list[tuple[int, int]] = []
    start: int | None = None
    count = 0
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("IN:"):
            if start is not None:
                blocks.append((start, count))
            start, count = None, 0
        elif line.startswith("0x") and ":" in line:
            address = int(line.split(":", 1)[0], 16)
            start = address if start is None else start
            count += 1
    if start is not None:
        blocks.append((start, count))
    return blocks


def static_symbols(binary: Path) -> tuple[list[int], list[str]]:
    """(sorted addresses, names) of a static binary's functions, from ``nm -n``."""
    import subprocess

    out = subprocess.run(["nm", "-n", str(binary)], capture_output=True, text=True, check=True)
    rows = (x.split() for x in out.stdout.splitlines())
    pairs = [(int(p[0], 16), p[2]) for p in rows if len(p) == 3 and p[1].lower() in "tw"]
    return [a for a, _ in pairs], [n for _, n in pairs]


class Places:
    """Kernel symbols and user mappings, to name an address."""

    symbols: dict[str, tuple[list[int], list[str]]]  # a mapping's name -> static_symbols

    def __init__(self, kallsyms: str, maps: str) -> None:
        self.symbols = {}
        symbols = []
        for line in kallsyms.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1].lower() in "tw":
                symbols.append((int(parts[0], 16), parts[2]))
        symbols.sort()
        self.addresses = [a for a, _ in symbols]
        self.names = [n for _, n in symbols]
        self.ranges: list[tuple[int, int, str]] = []
        process = ""
        for line in maps.splitlines():
            if line.startswith("== "):
                process = line[3:]
                continue
            parts = line.split()
            if len(parts) >= 2 and "x" in parts[1]:
                low, high = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5] if len(parts) > 5 else "[anon]"
                self.ranges.append((low, high, f"{process}:{Path(path).name}"))

    def name(self, address: int) -> str:
        if address >= KERNEL_BASE:
            i = bisect.bisect_right(self.addresses, address) - 1
            return f"kernel:{self.names[i]}" if i >= 0 else "kernel:?"
        owners = {name for low, high, name in self.ranges if low <= address < high}
        for mapping, (addresses, names) in self.symbols.items():
            if any(owner.endswith(":" + mapping) for owner in owners):
                i = bisect.bisect_right(addresses, address) - 1
                return f"user:{mapping}:{names[i] if i >= 0 else '?'}"
        return "user:" + ("|".join(sorted(owners)) if owners else "?")


async def profile_ready(baseline_spec: Path, log: Path) -> tuple[list[tuple[int, int]], Places]:
    """A fresh clone's RESEED -> HELLO with the log on (around the driver's ``reseed``)."""
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
    from cleanroom.drivers.qemu import QemuDriver, clone
    from cleanroom.evidence.manifest import Manifest

    baseline = resolve_or_build(str(baseline_spec))
    limits = Manifest.model_validate(
        {"episode_id": "tb", "seed": 1, "policy": {"id": "bench"}}
    ).limits.merged_over(baseline.limits)
    driver = QemuDriver(start="snapshot")

    def request() -> EnvRequest:
        return EnvRequest(new_env_id(), baseline, limits, Owner("bench-tb"), 600)

    async with await driver.create(request()) as env:  # the template; and the kernel's symbols
        kallsyms = (await env.exec(["cat", "/proc/kallsyms"])).check().stdout.decode()
    original = clone.reseed

    async def logged(env_id: str, live: Any) -> Any:
        qmp = await live.open_qmp()
        await qmp.execute("human-monitor-command", {"command-line": f"logfile {log}"})
        await qmp.execute("human-monitor-command", {"command-line": "log in_asm"})
        try:
            return await original(env_id, live)
        finally:
            await qmp.execute("human-monitor-command", {"command-line": "log none"})

    clone.reseed = logged  # type: ignore[assignment]
    try:
        async with await driver.create(request()) as env:
            assert env.info.start_kind == "snapshot", env.info.start_note
            maps = (await env.exec(["sh", "-c", MAPS])).check().stdout.decode()
    finally:
        clone.reseed = original  # type: ignore[assignment]
    return read_blocks(log), Places(kallsyms, maps)


async def profile(baseline_spec: Path, log: Path) -> tuple[list[tuple[int, int]], Places]:
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
    from cleanroom.drivers.qemu import QemuDriver
    from cleanroom.evidence.manifest import Manifest

    baseline = resolve_or_build(str(baseline_spec))
    manifest = Manifest.model_validate(
        {"episode_id": "tb", "seed": 1, "policy": {"id": "bench"}, "task": {"mode": "ok"}}
    )
    limits = manifest.limits.merged_over(baseline.limits)
    driver = QemuDriver(start="snapshot")

    def request() -> EnvRequest:
        return EnvRequest(new_env_id(), baseline, limits, Owner("bench-tb"), 600)

    async with await driver.create(request()) as env:  # the template; and the kernel's symbols
        kallsyms = (await env.exec(["cat", "/proc/kallsyms"])).check().stdout.decode()
    assert baseline.function is not None, "a function baseline is needed"
    run: dict[str, Any] = {
        "manifest": manifest.guest_view(),
        "function": baseline.function.to_json(),
        "timeout_s": 60,
        "env": {},
    }
    with tempfile.TemporaryDirectory() as staging:
        async with await driver.create(request()) as env:
            qmp = await driver._live[env.env_id].open_qmp()  # closed with the env
            await qmp.execute("human-monitor-command", {"command-line": f"logfile {log}"})
            await qmp.execute("human-monitor-command", {"command-line": "log in_asm"})
            await env.run_episode(run, Path(staging) / "out", quota_bytes=1 << 24)
            await qmp.execute("human-monitor-command", {"command-line": "log none"})
            maps = (await env.exec(["sh", "-c", MAPS])).check().stdout.decode()
    return read_blocks(log), Places(kallsyms, maps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--baseline", type=Path, default=WARM)
    parser.add_argument("--by", choices=("symbol", "area"), default="symbol")
    parser.add_argument("--step", choices=("run", "ready"), default="run")
    parser.add_argument("--dump", type=Path, help="write every block: address, insns, place")
    parser.add_argument("--symbols", action="append", default=[], help="NAME=BINARY (see above)")
    args = parser.parse_args()
    # QEMU writes its in_asm log itself: a jailed QEMU's root is empty (drivers/jail.py)
    os.environ.setdefault("CLEANROOM_JAIL_UIDS", "off")
    which = profile_ready if args.step == "ready" else profile
    with tempfile.TemporaryDirectory() as tmp:
        blocks, places = asyncio.run(which(args.baseline, Path(tmp) / "in_asm.log"))
    for item in args.symbols:
        mapping, _, binary = item.partition("=")
        places.symbols[mapping] = static_symbols(Path(binary))
    if args.dump:  # e.g. to name a static binary's blocks with `nm -n` of an unstripped build
        lines = (f"{a:#x} {n} {places.name(a)}\n" for a, n in blocks)
        args.dump.write_text("".join(lines))
    by_place: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for address, instructions in blocks:
        name = places.name(address)
        if args.by == "area":
            name = name.split(":", 1)[0] if name.startswith("kernel") else name
        by_place[name][0] += 1
        by_place[name][1] += instructions
    total_blocks = len(blocks)
    total_insns = sum(i for _, i in blocks)
    step = "RESEED -> HELLO" if args.step == "ready" else "RUN -> DONE"
    print(f"translated during {step}: {total_blocks} blocks, {total_insns} instructions")
    user = sum(v[0] for k, v in by_place.items() if k.startswith("user"))
    print(f"  user space {user} blocks ({100 * user / max(total_blocks, 1):.0f}%)")
    print(f"{'place':<60} {'blocks':>7} {'insns':>7}")
    for name, (n, insns) in sorted(by_place.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{name[:60]:<60} {n:>7} {insns:>7}")


if __name__ == "__main__":
    main()
