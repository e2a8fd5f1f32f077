"""Session benchmark: an interactive session's paths on real microVMs, each beside a host reference.

Measures, on the tiny test baseline (qemu, snapshot starts, a spare kept ready):
  session create -> ready           (``async with session(...)`` entered; the env from a spare)
  forkable session create -> ready  (``forkable=True``: no spare, the template's RAM copied)
  first command                     (``true``, the session's first)
  repeated command                  (``true`` after the first, --cmds per session)
  1 MiB write + read round trip     (put then get of one 1 MiB file: a session's first, and
                                     3 more after it, through the VM's bulk disk; then 3 more
                                     with the disk set aside: over the agent channel, the A/B)
  64 MiB write / read throughput    (MB/s, one 64 MiB file each way)
  fork -> 4 branches ready          (``sb.fork(4)`` of a live forkable session)
  close                             (leaving the block: transcript + record exported, VM destroyed
                                     and confirmed absent)
References, measured in the same run and interleaved with the sessions: a host subprocess
(``true``) for commands, a host file copy (1 MiB, 64 MiB) for transfers, and the guest's own
floor for a command: ``bench/spawn_floor.c`` (built here with ``gcc -static``, put into each
session) spawning and reaping ``/bin/true`` in a loop inside the same VM, per spawn (the
guest kernel's spawn and the dynamic loader under TCG: no agent, no channel); each session row is
also given as a ratio to its reference (session / host: how many times slower; the paths that
are not a command or a transfer against the host subprocess too).
It uses the session's ``commands``/``files`` API where it has one, else ``exec``/``put``/``get``.
Results: bench/results/session.txt (``--out``). Run it under ``nice`` on a shared machine.

    python bench/session.py [--sessions 20] [--cmds 30] [--forks 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from stats import Table, p50_p95, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Env, ForkSnapshot
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import AsyncSession, session
from cleanroom.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
MIB = 1 << 20
BIG = 64 * MIB
RT_AGAIN = 3  # 1 MiB round trips per session after its first (the first pays first-use costs)
FLOOR_SPAWNS = 10  # /bin/true runs of the guest's own loop (bench/spawn_floor.c), per session
FLOOR_SOURCE = ROOT / "bench" / "spawn_floor.c"


def build_floor(folder: Path) -> bytes:
    """bench/spawn_floor.c as a static binary (the guest may have no compiler, or no libc)."""
    out = folder / "spawn_floor"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(FLOOR_SOURCE)], check=True)
    return out.read_bytes()


TARGETS = {
    "ready": "<= 25 ms",
    "first": "<= 150 ms",
    "true": "<= 10 ms",
    "rt": "<= 20 ms",
    "rt again": "<= 20 ms",
    "put": ">= 100 MB/s",
    "get": ">= 100 MB/s",
    "fork": "<= 1000 ms",
    "close": "<= 30 ms",
}


async def run_true(sb: AsyncSession) -> None:
    commands = getattr(sb, "commands", None)
    if commands is not None:
        (await commands.run(["true"])).check()
    else:
        (await sb.exec(["true"])).check()


async def write_file(sb: AsyncSession, path: str, data: bytes, mode: int = 0o644) -> None:
    files = getattr(sb, "files", None)
    await (files.write(path, data, mode=mode) if files is not None else sb.put(path, data, mode))


async def read_file(sb: AsyncSession, path: str) -> bytes:
    files = getattr(sb, "files", None)
    data: bytes = await (files.read(path) if files is not None else sb.get(path))
    return data


async def host_true() -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec("true")
    await proc.wait()
    return time.perf_counter() - t0


def host_round_trip(folder: Path, data: bytes) -> float:
    """Write ``data`` to a file and read it back: the host's round trip (as put + get)."""
    path = folder / "rt"
    t0 = time.perf_counter()
    path.write_bytes(data)
    assert path.read_bytes() == data
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def host_copy(folder: Path, data: bytes) -> float:
    """Copy a file of ``data`` (its page cache warm): the host's one pass over the bytes."""
    src, dst = folder / "src", folder / "dst"
    src.write_bytes(data)
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    elapsed = time.perf_counter() - t0
    src.unlink()
    dst.unlink()
    return elapsed


class TimedDriver(QemuDriver):
    """The qemu driver, keeping each live fork's facts (where its time went)."""

    snapshots: list[dict[str, Any]]

    async def fork_live(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        snap = await super().fork_live(env, snapshot_id)
        self.snapshots.append(snap.facts)
        return snap


class Bench:
    def __init__(self, baseline: Baseline, tmp: Path, cmds: int) -> None:
        self.baseline, self.tmp, self.cmds = baseline, tmp, cmds
        self.floor = build_floor(tmp)
        self.driver = TimedDriver(start="snapshot")
        self.driver.snapshots = []
        self.driver.keep_spares(1)  # each create starts the next session's spare
        self.ledger = Ledger(tmp / "ledger.db")
        self.store = LocalStore(tmp / "store")
        self.times: dict[str, list[float]] = {}
        self.fork_facts: list[dict[str, Any]] = []
        self.n = 0

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def _session(self, forkable: bool = False) -> Any:
        self.n += 1
        return session(
            self.baseline,
            driver=self.driver,
            ledger=self.ledger,
            store=self.store,
            run_id=f"bench-{self.n:03d}",
            options=RunOptions(staging_dir=self.tmp / "staging", spares=1),
            timeout_s=600,  # 64 MiB each way takes a while under load
            forkable=forkable,
        )

    async def one(self, big: bool) -> None:
        """One session from a spare: ready, first and repeated commands, transfers, close."""
        await self.driver.spares.settled()  # the spare the last create started
        t0 = time.perf_counter()
        async with self._session() as sb:
            self.add("ready", time.perf_counter() - t0)
            assert sb.episode.env is not None and sb.episode.env.info.spare_s is not None
            t = time.perf_counter()
            await run_true(sb)
            self.add("first", time.perf_counter() - t)
            for _ in range(self.cmds):
                t = time.perf_counter()
                await run_true(sb)
                self.add("true", time.perf_counter() - t)
            await write_file(sb, "/tmp/spawn_floor", self.floor, mode=0o755)
            loop = (await sb.exec(["/tmp/spawn_floor", str(FLOOR_SPAWNS), "/bin/true"])).check()
            self.add("guest spawn", float(loop.stdout) / 1e6)
            for key in ("rt", *["rt again"] * RT_AGAIN):  # the session's first, then more
                await self.round_trip(sb, key)
            agent = sb.episode.env.session  # the same round trips with the bulk disk set aside
            disk, agent.bulk = agent.bulk, None
            for _ in range(RT_AGAIN):
                await self.round_trip(sb, "rt channel")
            agent.bulk = disk
            if big:
                blob = os.urandom(BIG)
                t = time.perf_counter()
                await write_file(sb, "/tmp/big.bin", blob)
                self.add("put", time.perf_counter() - t)
                t = time.perf_counter()
                assert await read_file(sb, "/tmp/big.bin") == blob
                self.add("get", time.perf_counter() - t)
                await sb.exec(["rm", "-f", "/tmp/big.bin"])
            sb.finish(reward=1.0)
            closing = time.perf_counter()
        self.add("close", time.perf_counter() - closing)
        self.add("provision", sb.episode.clock.phases["provision_s"])
        self.add("export", sb.episode.clock.phases["export_s"])  # logs + record, fsynced
        assert sb.episode.result.destroy is not None
        self.add("destroy", sb.episode.result.destroy.elapsed_ms / 1000)
        self.add("host true", await host_true())
        for _ in range(3):
            self.add("host true", await host_true())
        self.add("host rt", await asyncio.to_thread(host_round_trip, self.tmp, os.urandom(MIB)))
        if big:
            self.add("host big", await asyncio.to_thread(host_copy, self.tmp, os.urandom(BIG)))

    async def round_trip(self, sb: AsyncSession, key: str) -> None:
        """1 MiB written to the guest and read back, as one ``key`` sample."""
        data = os.urandom(MIB)
        t = time.perf_counter()
        await write_file(sb, "/tmp/one.bin", data)
        assert await read_file(sb, "/tmp/one.bin") == data
        self.add(key, time.perf_counter() - t)

    async def fork(self) -> None:
        """A forkable session: its create, one command, then a fork into 4 branches."""
        t0 = time.perf_counter()
        async with self._session(forkable=True) as sb:
            self.add("forkable ready", time.perf_counter() - t0)
            await sb.exec(["sh", "-c", "echo state > /root/state"])
            t = time.perf_counter()
            branches = await sb.fork(4)
            self.add("fork", time.perf_counter() - t)
            self.fork_facts.append(dict(branches[0].live_env().info.branch or {}))
            for branch in branches:
                async with branch:
                    await run_true(branch)
                    branch.finish(reward=0.0)
            sb.finish(reward=0.0)


def ratio(values: list[float], reference: list[float]) -> str:
    """session p50 / reference p50 (how many times slower than the host)."""
    return f"{p50_p95(values)[0] / p50_p95(reference)[0]:>8.1f}x"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--cmds", type=int, default=30, help="repeated commands per session")
    parser.add_argument("--big", type=int, default=5, help="sessions that also move 64 MiB")
    parser.add_argument("--forks", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--baseline", type=Path, default=TINY, help="the spec (default: the tiny test baseline)"
    )
    args = parser.parse_args()
    baseline = resolve_or_build(str(args.baseline), progress=lambda s, d: print(f"build {s}: {d}"))
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-session-") as name:
        bench = Bench(baseline, Path(name), args.cmds)
        try:
            async with bench._session() as warmup:  # the template, built unless cached
                warmup.finish(reward=0.0)
            every = max(args.sessions // max(args.forks, 1), 1)
            forks = 0
            for i in range(args.sessions):
                await bench.one(big=i < args.big)
                if i % every == 0 and forks < args.forks:
                    await bench.fork()
                    forks += 1
                ready = bench.times["ready"][-1] * 1000
                print(f"session {i + 1}/{args.sessions}: ready {ready:.0f} ms")
            while forks < args.forks:
                await bench.fork()
                forks += 1
        finally:
            await bench.driver.release_spares()
            bench.ledger.close()
    lines = report(bench, args, load_at_start)
    write(args.out or ROOT / "bench" / "results" / "session.txt", lines)


TABLE = Table(("n", "p50", "p95"), name_width=36, n_width=4)


def report(bench: Bench, args: argparse.Namespace, load_at_start: float) -> list[str]:
    t = bench.times
    facts = bench.driver.describe()
    big_ref = t.get("host big", [])

    def row(label: str, key: str, reference: str | None) -> str:
        ref = ratio(t[key], t[reference]) if reference else f"{'':>9}"
        return f"{TABLE.row(label, t[key])} {ref}  {TARGETS.get(key, '')}"

    def rate(label: str, key: str) -> str:
        p50 = statistics.median(BIG / 1e6 / v for v in t[key])
        host = statistics.median(BIG / 1e6 / v for v in big_ref)
        return (
            f"{label:<36} {len(t[key]):>4} {p50:>9.0f} MB/s p50; host file copy {host:.0f} MB/s"
            f" ({host / p50:.1f}x)  {TARGETS[key]}"
        )

    fork_facts = bench.fork_facts[-1] if bench.fork_facts else {}
    agent = "native" if bench.baseline.agent_sha256 else "python"
    lines = [
        f"# bench/session.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores, qemu {facts.get('accelerator_version')}, accelerator "
        f"{facts.get('accelerator')}, baseline {args.baseline.parent.name} ({agent} agent); "
        "load average (1 min) at the "
        f"start {load_at_start:.1f}, at the end {os.getloadavg()[0]:.1f}",
        f"# {args.sessions} sessions from a spare ({args.cmds} repeated commands each, "
        f"{args.big} with 64 MiB each way), {args.forks} forkable sessions forked into 4; host "
        "references interleaved with them; 'vs host' = session p50 / reference p50",
        "",
        f"{TABLE.header('session path (ms)')} {'vs host':>9}  target",
        row("session create -> ready (spare)", "ready", "host true"),
        row("forkable session create -> ready", "forkable ready", "host true"),
        row("first command (`true`)", "first", "host true"),
        row("repeated command (`true`)", "true", "host true"),
        row("1 MiB write + read round trip", "rt", "host rt"),
        row("  the same, repeated in the session", "rt again", "host rt"),
        row("  the same over the channel (A/B)", "rt channel", "host rt"),
        row("fork -> 4 branches ready", "fork", "host true"),
        row("close (export + destroy + confirm)", "close", "host true"),
        row("  of ready: provision (env lease)", "provision", "host true"),
        row("  of close: export (logs, record)", "export", "host true"),
        row("  of close: destroy + confirm", "destroy", "host true"),
        row("reference: host subprocess `true`", "host true", None),
        row("reference: host 1 MiB write + read", "host rt", None),
        row("reference: guest spawn of `true`", "guest spawn", None),
        f"# repeated command / the guest's own spawn of /bin/true in the same VMs (the floor "
        f"under TCG, no agent, no channel): {ratio(t['true'], t['guest spawn']).strip()}",
    ]
    if t.get("put"):
        lines += ["", rate("64 MiB write (host -> guest)", "put")]
        lines.append(rate("64 MiB read (guest -> host)", "get"))
    if fork_facts:
        lines += ["", f"# last fork's provenance.branch: {fork_facts}"]
    snaps = bench.driver.snapshots
    if snaps:
        parts = ("prepare_s", "save_s", "copy_s", "paused_s", "rejoin_s", "fork_s")
        med = {k: p50_p95([s[k] for s in snaps])[0] for k in parts}
        ram = statistics.median(s["ram_bytes"] for s in snaps) / MIB
        lines.append(
            f"# live fork of the parent (p50, ms): SNAPSHOT_PREPARE in the guest "
            f"{med['prepare_s']:.1f}, device-state save {med['save_s']:.1f}, RAM copy "
            f"{med['copy_s']:.1f} ({ram:.0f} MiB touched), parent stopped {med['paused_s']:.1f},"
            f" its RESEED {med['rejoin_s']:.1f}, all of it {med['fork_s']:.1f}; the rest of the"
            " fork is the 4 restores (in parallel), the seal's hash and the ledger rows"
        )
    return lines


if __name__ == "__main__":
    asyncio.run(main())
