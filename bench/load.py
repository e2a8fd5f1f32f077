"""Load test of ``cleanroom serve``: many concurrent sandboxes from many concurrent SDK clients.

    python bench/load.py [--sandboxes 1000 --clients 100 --procs 4] [--out bench/results/load.txt]
    python bench/load.py --qemu [--idle 6] [--rates 0.25,0.5,1] [--out bench/results/load-qemu.txt]

Fake driver (default): one ``cleanroom serve`` subprocess; ``--clients`` SDK clients (the real
``e2b`` package, its async API, one API key each) spread over ``--procs`` client processes, each
client making ``--sandboxes / --clients`` sandboxes, so that all ``--sandboxes`` are alive at
once. In phases, every client waiting for every other at the end of each (a barrier):

  create        ``AsyncSandbox.create``, each client its sandboxes one after the other;
  commands.run  ``commands.run("true")`` once in each sandbox;
  file write    ``files.write`` of 4 KiB into each sandbox;
  kill          ``kill()`` of each (returns once the env is confirmed absent).

p50/p99 of each call; the server's CPU (utime + stime of its process, from /proc/PID/stat, its
agents not included) over each phase divided by the phase's requests; its RSS at its peak (all
sandboxes alive) and at the end; its idle CPU with all sandboxes alive. Then, in the same run,
the references: the same shape (the same number of concurrent clients and sandboxes) through the
Python API in this process (``cleanroom.session``: open, ``commands.run`` of the SDK's argv,
``files.write``, close), with this process's CPU per call; and a host subprocess (the same
``/bin/bash -l -c true``) and a host file write for ``commands.run`` and file write. At the end
every served sandbox must have its final outcome (``completed``) with one durable record, its env
confirmed absent, nothing of the driver left: the run fails (exit 1) on any lost sandbox or error.

qemu (``--qemu``): ``--idle`` idle sandboxes of the tiny baseline through ``cleanroom serve``;
the PSS of each QEMU process (``/proc/PID/smaps_rollup``), and from it how many idle sandboxes a
24 GiB host holds. Then a short ramp: sandboxes created at each rate of ``--rates`` (per second,
each killed ``--hold`` s after it is ready) for ``--step-s`` s; the p99 of create at each, and
the highest rate whose p99 stays under 1 s.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from served import start_server, stop_server
from stats import Table, parser, write

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
PHASES = ("create", "run", "write", "kill")
NAMES = {
    "create": "create",
    "run": "commands.run('true')",
    "write": "file write (4 KiB)",
    "kill": "kill (env confirmed absent)",
}
BLOB = os.urandom(4096)
ARGV = ["/bin/bash", "-l", "-c", "true"]  # what the SDK's commands.run("true") sends
HOST_GIB = 24
TICK = os.sysconf("SC_CLK_TCK")


# -- the server and /proc ---------------------------------------------------------------------


def cpu_s(pid: int | str = "self") -> float:
    """utime + stime of one process (not its children), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def serve(driver: str, digest: str, n: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A server of ``digest`` as template ``b`` that lets ``n`` sandboxes be made at once."""
    args = ["--driver", driver, "--template", f"b={digest}", "--per-key", str(n)]
    args += ["--burst", str(n), "--creates-per-s", "100000", "--max-sandboxes", str(n)]
    return start_server(args, log)


def live_count(url: str) -> int:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("cleanroom_serve_sandboxes_live "):
            return int(line.split()[1])
    return -1


# -- the clients (each process: its clients, on one event loop) -------------------------------


def client_proc(
    url: str, keys: list[str], per_client: int, folder: str, barrier: Any, results: Any
) -> None:
    os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url})
    out = asyncio.run(_clients(keys, per_client, folder, barrier))
    results.put(out)


async def _clients(keys: list[str], per_client: int, folder: str, barrier: Any) -> dict[str, Any]:
    from e2b import AsyncSandbox

    times: dict[str, list[float]] = {p: [] for p in PHASES}
    errors: list[str] = []
    ids: list[str] = []
    boxes: dict[int, list[Any]] = {i: [] for i in range(len(keys))}

    async def call(phase: str, what: Any) -> Any:
        t = time.perf_counter()
        try:
            got = await what
        except Exception as exc:  # counted: the run fails on any
            errors.append(f"{phase}: {type(exc).__name__}: {exc}"[:300])
            return None
        times[phase].append(time.perf_counter() - t)
        return got

    async def create(i: int) -> None:
        for _ in range(per_client):
            sbx = await call("create", AsyncSandbox.create("b", api_key=keys[i], timeout=3600))
            if sbx is not None:
                boxes[i].append(sbx)
                ids.append(sbx.sandbox_id)

    async def run(i: int) -> None:
        for sbx in boxes[i]:
            # no 60 s cap (the SDK's default): 100 commands at once on 2 cores can take longer,
            # and the direct reference has none
            await call("run", sbx.commands.run("true", timeout=0))

    async def write_(i: int) -> None:
        for sbx in boxes[i]:
            await call("write", sbx.files.write(f"{folder}/{sbx.sandbox_id}.bin", BLOB))

    async def kill(i: int) -> None:
        for sbx in boxes[i]:
            if await call("kill", sbx.kill()) is False:  # the server did not know it
                errors.append(f"kill: {sbx.sandbox_id} was not found")

    warm = await AsyncSandbox.create("b", api_key=keys[0], timeout=600)  # the SDK's set-up
    await warm.commands.run("true")
    await warm.kill()
    await asyncio.to_thread(barrier.wait)  # every process ready: go
    for step in (create, run, write_, kill):
        await asyncio.gather(*(step(i) for i in range(len(keys))))
        await asyncio.to_thread(barrier.wait)  # done: the main process measures
        await asyncio.to_thread(barrier.wait)  # then lets the next phase go
    return {"times": times, "errors": errors, "ids": ids}


# -- the same-run references (this process) ---------------------------------------------------


async def direct(baseline: Any, clients: int, per_client: int, folder: Path) -> dict[str, Any]:
    """The same shape through the Python API: ``clients`` tasks, each ``per_client`` sessions;
    phases as the served run's; this process's CPU per phase."""
    from cleanroom.drivers import get_driver
    from cleanroom.lifecycle.context import RunOptions
    from cleanroom.sessions import session

    driver = get_driver("fake")
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    cpu: dict[str, float] = {}
    errors: list[str] = []
    gate = asyncio.Barrier(clients + 1)

    async def client() -> None:
        blocks: list[tuple[Any, Any]] = []
        t0 = time.perf_counter()
        try:
            for _ in range(per_client):
                t = time.perf_counter()
                # the served sandboxes' timeout (3600 s): a session's default (60 s) would
                # expire, and cancel its client, while the others are still being made
                block = session(
                    baseline, driver=driver, options=RunOptions(spares=0), timeout_s=3600
                )
                sb = await block.__aenter__()
                times["create"].append(time.perf_counter() - t)
                blocks.append((block, sb))
            await gate.wait()
            for _, sb in blocks:
                t = time.perf_counter()
                await sb.commands.run(ARGV)
                times["run"].append(time.perf_counter() - t)
            await gate.wait()
            for _, sb in blocks:
                t = time.perf_counter()
                await sb.files.write(str(folder / f"{id(sb)}.bin"), BLOB)
                times["write"].append(time.perf_counter() - t)
            await gate.wait()
        except (Exception, asyncio.CancelledError) as exc:  # never a barrier left waiting
            errors.append(f"direct: {type(exc).__name__}: {exc}"[:300])
            await gate.abort()
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            for block, sb in blocks:
                t = time.perf_counter()
                sb.finish(0.0)
                await block.__aexit__(None, None, None)
                times["kill"].append(time.perf_counter() - t)
        del t0

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    c = cpu_s()
    for phase in PHASES[:-1]:
        await gate.wait()
        c, cpu[phase] = cpu_s(), cpu_s() - c
    await asyncio.gather(*tasks)
    cpu["kill"] = cpu_s() - c
    return {"times": times, "cpu": cpu, "errors": errors}


async def host_refs(clients: int, n: int, folder: Path) -> dict[str, list[float]]:
    """A host subprocess (the SDK's argv) and a host file write, ``clients`` at once, ``n``
    in all."""
    out: dict[str, list[float]] = {"run": [], "write": []}

    async def one(i: int) -> None:
        for j in range(i, n, clients):
            t = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(*ARGV)
            await proc.wait()
            out["run"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await asyncio.to_thread((folder / f"host-{j}.bin").write_bytes, BLOB)
            out["write"].append(time.perf_counter() - t)

    await asyncio.gather(*(one(i) for i in range(clients)))
    return out


# -- the fake-driver load ---------------------------------------------------------------------


def fake_load(args: Any) -> tuple[list[str], bool]:
    sys.path.insert(0, str(ROOT))
    home = os.environ["CLEANROOM_HOME"]
    from tests.server.kit import stored_fake_baseline  # resets CLEANROOM_HOME: put back

    os.environ["CLEANROOM_HOME"] = home
    from cleanroom.baseline.store import load
    from cleanroom.drivers import get_driver
    from cleanroom.ledger import Ledger
    from cleanroom.server.keys import KeyRing
    from cleanroom.store import open_store

    tmp = Path(tempfile.mkdtemp(prefix="load-bench-"))
    baseline = load(stored_fake_baseline(tmp).digest)
    per_client = args.sandboxes // args.clients
    total = per_client * args.clients
    keys = [KeyRing().create(f"load-{i}")[1] for i in range(args.clients)]
    server, url = serve("fake", baseline.digest, total + 10, tmp / "serve.log")
    files = tmp / "files"
    files.mkdir()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.procs + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=client_proc,
            args=(url, keys[i :: args.procs], per_client, str(files), barrier, results),
        )
        for i in range(args.procs)
    ]
    cpu: dict[str, float] = {}
    rss: dict[str, float] = {"start": rss_mib(server.pid)}
    idle_cpu_per_s = 0.0
    live = -1
    started = time.monotonic()
    try:
        for p in procs:
            p.start()
        barrier.wait(timeout=600)  # each client process made (and killed) one: warm
        c = cpu_s(server.pid)
        for phase in PHASES:
            barrier.wait(timeout=3600)
            now = cpu_s(server.pid)
            c, cpu[phase] = now, now - c
            rss[phase] = rss_mib(server.pid)
            print(f"load: {phase} done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
            if phase == "write":  # all alive, nobody calling: the idle cost
                live = live_count(url)
                time.sleep(10)
                now = cpu_s(server.pid)
                idle_cpu_per_s = (now - c) / 10
                c = now
            barrier.wait(timeout=60)
        got = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        served_s = time.monotonic() - started
        rss["end"] = rss_mib(server.pid)
        left_live = live_count(url)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        code = stop_server(server)
    times = {ph: [t for g in got for t in g["times"][ph]] for ph in PHASES}
    errors = [e for g in got for e in g["errors"]]
    ids = [i for g in got for i in g["ids"]]
    # nothing lost: each sandbox's session completed, one durable record, env confirmed absent
    store = open_store(None)
    lost: list[str] = []
    with Ledger() as ledger:
        for sid in ids:
            rows = ledger.episodes(f"serve-{sid}")
            envs = ledger.envs(run_id=f"serve-{sid}")
            record = store.get_record(f"serve-{sid}", sid)
            if not rows or rows[0].outcome != "completed" or record is None:
                lost.append(f"{sid}: {rows[0].outcome if rows else None}, record {bool(record)}")
            elif record["outcome"] != "completed" or record["attempt"] != rows[0].attempt:
                lost.append(f"{sid}: the record disagrees with the ledger")
            if not envs or any(e.confirmed_absent_at is None for e in envs):
                lost.append(f"{sid}: env not confirmed absent")
    owned = get_driver("fake").list_owned()

    # the references, same run, same shape, the server stopped
    ref_dir = tmp / "ref"
    ref_dir.mkdir()
    c0 = time.monotonic()
    ref = asyncio.run(direct(baseline, args.clients, per_client, ref_dir))
    direct_s = time.monotonic() - c0
    host = asyncio.run(host_refs(args.clients, total, ref_dir))
    owned += get_driver("fake").list_owned()

    requests = {ph: len(times[ph]) for ph in PHASES}
    table = Table(("n", "p50", "p99", "max"), 44)
    lines = [
        f"cleanroom serve load (fake driver, e2b SDK {_e2b_version()} async, {platform.node()}, "
        f"{os.cpu_count()} cores shared with other work, {time.strftime('%Y-%m-%d %H:%M')})",
        f"{total} sandboxes alive at once from {args.clients} concurrent SDK clients (one key "
        f"each) in {args.procs} client processes; {per_client} sandboxes per client, made one "
        "after the other (after one warm-up sandbox per process, not counted); ms",
        f"served run {served_s:.0f} s, direct reference {direct_s:.0f} s",
        table.header("call"),
    ]
    for ph in PHASES:
        lines.append(table.row(f"served: {NAMES[ph]}", times[ph]))
        lines.append(table.row(f"direct session: {NAMES[ph]}", ref["times"][ph]))
        if ph in host:
            lines.append(table.row(f"host: {'subprocess' if ph == 'run' else 'write'}", host[ph]))
    lines.append("CPU per call, ms (the phase's CPU / its calls; the idle cost below included)")
    lines.append(f"  {'call':<28} {'server process':>15} {'direct (this process)':>22}")
    for ph in PHASES:
        s = 1000 * cpu[ph] / max(1, requests[ph])
        d = 1000 * ref["cpu"][ph] / max(1, len(ref["times"][ph]))
        lines.append(f"  {NAMES[ph]:<28} {s:>15.2f} {d:>22.2f}")
    lines += [
        f"server idle with {live} sandboxes alive: {idle_cpu_per_s * 100:.1f}% of one core",
        "server RSS, MiB: "
        + ", ".join(f"{k} {v:.0f}" for k, v in rss.items())
        + f" (peak: {max(rss.values()):.0f}; "
        f"{(max(rss.values()) - rss['start']) * 1024 / max(1, total):.0f} KiB per sandbox)",
        f"errors: {len(errors)} (create {requests['create']}/{total} ok, run "
        f"{requests['run']}, write {requests['write']}, kill {requests['kill']}); direct "
        f"reference errors: {len(ref['errors'])}",
        f"lost or unconfirmed sandboxes: {len(lost)}; live after the kills: {left_live}; "
        f"envs the driver still owns: {len(owned)}; server exit on SIGTERM: {code}",
    ]
    seen = Counter(errors + ref["errors"] + lost)
    lines += [f"  {n} x {e}" for e, n in seen.most_common(20)]
    ok = not errors and not ref["errors"] and not lost and not owned and left_live == 0
    ok = ok and requests["create"] == total and code == 0
    return lines, ok


# -- qemu -------------------------------------------------------------------------------------


def qemu_pids(home: str) -> list[int]:
    """The QEMU processes of this bench's home (other homes' VMs, e.g. a test suite's, not)."""
    needle = home.encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"qemu-system-x86_64") and any(needle in c for c in cmd):
            out.append(int(d.name))
    return out


def qemu_load(args: Any) -> tuple[list[str], bool]:
    from e2b import Sandbox

    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.server.keys import KeyRing

    tmp = Path(tempfile.mkdtemp(prefix="load-qemu-"))
    digest = resolve_or_build(str(TINY)).digest
    home = os.environ["CLEANROOM_HOME"]
    before = set(qemu_pids(home))
    rates = [float(r) for r in args.rates.split(",")]
    n = max(args.idle, 64)
    server, url = serve("qemu", digest, n, tmp / "serve.log")
    os.environ.update(
        {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": KeyRing().create("load")[1]}
    )
    errors: list[str] = []
    ramp: list[tuple[float, list[float], int, int]] = []
    lines: list[str] = []
    try:
        rss0 = rss_mib(server.pid)
        idle = [Sandbox.create("b", timeout=600) for _ in range(args.idle)]
        for sbx in idle:
            sbx.commands.run("true")  # ready and used once, then left idle
        time.sleep(args.settle)
        pids = [p for p in qemu_pids(home) if p not in before]
        pss = [pss_mib(p) for p in pids]
        rss = [rss_mib(p) for p in pids]
        server_rss = rss_mib(server.pid)
        for sbx in idle:
            sbx.kill()
        per = sum(pss) / max(1, len(pss))
        server_per = (server_rss - rss0) / max(1, args.idle)
        reserve = 2.0  # GiB for the host, the server and the page cache
        fits = int((HOST_GIB - reserve) * 1024 / (per + server_per))
        lines += [
            f"cleanroom serve load (qemu driver, TCG: no KVM on this host, e2b SDK "
            f"{_e2b_version()}, {platform.node()}, {os.cpu_count()} cores shared with other "
            f"work, {time.strftime('%Y-%m-%d %H:%M')})",
            f"idle sandboxes: {args.idle} of the tiny baseline, each used once "
            f"(commands.run), then idle {args.settle:.0f} s",
            f"  QEMU PSS per sandbox (smaps_rollup), MiB: mean {per:.1f}, min {min(pss):.1f}, "
            f"max {max(pss):.1f} (RSS mean {sum(rss) / max(1, len(rss)):.1f}; {len(pids)} "
            "QEMU processes)",
            f"  server RSS: {rss0:.0f} MiB idle, {server_rss:.0f} MiB with them "
            f"({server_per:.1f} MiB per sandbox)",
            f"  a {HOST_GIB} GiB host, {reserve:.0f} GiB kept back: about {fits} idle "
            f"sandboxes ({per + server_per:.1f} MiB each, QEMU PSS + server share)",
        ]
        for rate in rates:
            created, peak, failed = _ramp_step(rate, args.step_s, args.hold)
            ramp.append((rate, created, peak, failed))
    finally:
        code = stop_server(server)
    table = Table(("n", "p50", "p99", "max"), 30)
    lines.append(
        f"sustained creates (each killed {args.hold:.0f} s after it is ready; {args.step_s:.0f} "
        "s per rate; 2 cores, TCG)"
    )
    lines.append(table.header("rate /s") + "  alive  failed")
    best = 0.0
    for rate, created, peak, failed in ramp:
        lines.append(table.row(f"{rate:g}", created) + f"  {peak:>5}  {failed:>6}")
        if created and failed == 0 and sorted(created)[-1 - len(created) // 100] < 1.0:
            best = max(best, rate)
    lines.append(
        f"highest rate with p99 create under 1 s: {best:g}/s"
        if best
        else "no rate tried kept p99 create under 1 s (TCG on 2 shared cores)"
    )
    left = [p for p in qemu_pids(home) if p not in before]
    lines.append(f"errors: {len(errors)}; QEMU processes left: {len(left)}; server exit: {code}")
    return lines, not errors and not left and code == 0


def _ramp_step(rate: float, seconds: float, hold: float) -> tuple[list[float], int, int]:
    """Creates at ``rate``/s for ``seconds`` (threads, one per create), each killed ``hold`` s
    after it is ready: their create latencies, the most alive at once, the failures."""
    import threading

    from e2b import Sandbox

    created: list[float] = []
    failed = [0]
    alive = [0, 0]
    lock = threading.Lock()

    def one() -> None:
        t = time.perf_counter()
        try:
            sbx = Sandbox.create("b", timeout=120)
        except Exception:
            failed[0] += 1
            return
        with lock:
            created.append(time.perf_counter() - t)
            alive[0] += 1
            alive[1] = max(alive[1], alive[0])
        time.sleep(hold)
        try:
            sbx.kill()
        except Exception:
            failed[0] += 1
        with lock:
            alive[0] -= 1

    threads = []
    start = time.monotonic()
    for i in range(max(1, int(rate * seconds))):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(300)
    return created, alive[1], failed[0]


def _e2b_version() -> str:
    from importlib.metadata import version

    return version("e2b")


def main() -> int:
    p = parser(__doc__ or "", "load.txt", runs=1)
    p.add_argument("--sandboxes", type=int, default=1000)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--qemu", action="store_true")
    p.add_argument("--idle", type=int, default=6)
    p.add_argument("--settle", type=float, default=10.0)
    p.add_argument("--rates", default="0.25,0.5,1")
    p.add_argument("--step-s", type=float, default=40.0)
    p.add_argument("--hold", type=float, default=5.0)
    args = p.parse_args()
    if args.qemu and args.out.name == "load.txt":
        args.out = args.out.with_name("load-qemu.txt")
    os.environ.setdefault("CLEANROOM_HOME", str(ROOT / ".cache" / "bench-home"))
    # the fake driver's commands are host processes (``bash -l``): the host user's login
    # profile (here: pyenv's rehash, under a lock) is not what is measured; an empty HOME
    clean_home = Path(tempfile.mkdtemp(prefix="load-home-"))
    os.environ["HOME"] = str(clean_home)
    from cleanroom.host import private

    private.check_home()
    lines, ok = qemu_load(args) if args.qemu else fake_load(args)
    write(args.out, lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
