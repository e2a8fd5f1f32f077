"""Scale-out overhead: the same function episodes locally and through a 2-node Ray cluster.

In one process: N function episodes of the warm test baseline (the agent's warm worker
answers) run locally with ``--parallel P``, then through a local ``ray.cluster_utils.Cluster``
(a head with no CPUs, 2 nodes of P/2 ``cleanroom_vm`` slots each, each node its own
``CLEANROOM_HOME``, loopback only) with the same total parallelism, alternating ``--rounds``
times so machine noise hits both alike. Prints the wall ratio (cluster / local), the overhead
per episode in ms, a bare actor round trip, and the node join cost (``add_node``, then the
run's setup: actors started, store checked, predecessors reaped, baseline re-hashed). Results:
bench/results/ray.txt. All of it on one host: the cluster adds no CPUs here, only its costs.

Before the timed rounds one untimed warm-up run on each side builds what a first run builds
(each node's snapshot template; the local one is usually cached already), so the rounds compare
steady state; the warm-up's cluster wall is printed as the first run's cost. The profile: CPU
seconds per episode of the controller side, locally (this process) and on the cluster (this
process, the head's and nodes' Ray processes and the node actors' workers; never the VMs),
read from /proc around each timed run, split into the driver, the node actors and the rest of
Ray; each part's idle rate (10 s with kept actors and nothing running) times the run's wall is
its background, and what the driver and node actors burn beyond the local run and their own
background is what the cluster path itself costs per episode. The cluster's processes inherit
the ``RAY_*`` settings below that turn Ray's metrics and event reporting off.

    python bench/ray_batch.py [--episodes 40] [--parallel 2] [--rounds 3] [--driver qemu]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray_quiet  # noqa: F401  (Ray's environment, before Ray is imported)
from stats import write

from cleanroom.api import arun
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.evidence.manifest import Manifest
from cleanroom.integrations.ray import RayCluster
from cleanroom.lifecycle.context import RunOptions

ROOT = Path(__file__).resolve().parent.parent
WARM = ROOT / "tests" / "baselines" / "warm" / "baseline.toml"


TICK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in task.read_text().split()]
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def ray_pids(cluster) -> set[int]:  # type: ignore[no-untyped-def]
    """The cluster's own processes and their children, but no VM (qemu) and nothing under one."""
    roots = []
    for node in [cluster.head_node, *cluster.worker_nodes]:
        for infos in node.all_processes.values():
            roots += [i.process.pid for i in infos]
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen or _comm(pid).startswith("qemu"):
            continue
        seen.add(pid)
        todo += _children(pid)
    return seen


def cpu_s(pids: set[int]) -> dict[int, float]:
    """utime + stime of each pid (its own, not its children's), in seconds."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def profile(store_root: Path, run_ids: list[str], slots: int) -> dict[str, float]:
    """Medians over the runs' records, in ms: each phase of an episode, and the slot time per
    episode spent outside any episode (scheduling, destroy, idle): wall x slots - their spans."""
    from cleanroom.store import open_store

    store = open_store(store_root)
    phases: dict[str, list[float]] = {"provision_s": [], "run_s": [], "export_s": []}
    outside = []
    for run_id in run_ids:
        records = store.list_records(run_id)
        spans = [(r["timings"]["started_at"], r["timings"]["ended_at"]) for r in records]
        wall = max(e for _, e in spans) - min(s for s, _ in spans)
        outside.append((wall * slots - sum(e - s for s, e in spans)) / len(spans))
        for r in records:
            for name, values in phases.items():
                values.append(r["timings"].get(name, 0.0))
    out = {name: statistics.median(v) * 1000 for name, v in phases.items()}
    out["outside"] = statistics.median(outside) * 1000
    return out


def manifests(n: int, tag: str) -> list[Manifest]:
    return [
        Manifest.model_validate(
            {"episode_id": f"{tag}-{i:03d}", "seed": i, "policy": {"id": "bench"}, "task": {}}
        )
        for i in range(n)
    ]


async def timed(coro) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    result = await coro
    return time.perf_counter() - t0, result


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=40)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--driver", default="qemu")
    ap.add_argument("--keep-nodes", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    baseline = resolve_or_build(str(WARM), progress=lambda s, d: print(f"build {s}: {d}"))
    tmp = Path(tempfile.mkdtemp(prefix="cr-bench-ray-"))
    opts = RunOptions(parallel=args.parallel)
    t0 = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
    )
    head_s = time.perf_counter() - t0
    joins = []
    for i in range(2):
        t1 = time.perf_counter()
        cluster.add_node(
            num_cpus=1,
            resources={"cleanroom_vm": max(1, args.parallel // 2)},
            node_ip_address="127.0.0.1",
            env_vars={"CLEANROOM_HOME": str(tmp / f"node{i}")},
        )
        joins.append(time.perf_counter() - t1)
    ray.init(address=cluster.address, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Echo:
        async def ping(self) -> int:
            return 1

    echo = Echo.remote()  # type: ignore[attr-defined]
    ray.get(echo.ping.remote())
    trips = []
    for _ in range(200):
        t1 = time.perf_counter()
        ray.get(echo.ping.remote())
        trips.append(time.perf_counter() - t1)

    def run(tag: str, on_cluster: bool = False, on_event=None):  # type: ignore[no-untyped-def]
        where = RayCluster(address=cluster.address, keep_nodes=args.keep_nodes)
        return arun(
            manifests(args.episodes, tag),
            baseline=baseline,
            store=tmp / "store",
            driver=args.driver,
            options=opts,
            on_event=on_event,
            cluster=where if on_cluster else None,
        )

    warm_local, res = await timed(run("warm-local"))
    assert res.ok, res.counts()  # type: ignore[attr-defined]
    warm_actors: set[int] = set()

    def actor_pids(kind: str, data: dict[str, object]) -> None:
        if kind == "node_ready" and isinstance(data.get("pid"), int):
            warm_actors.add(data["pid"])  # type: ignore[arg-type]

    warm_cluster, res = await timed(run("warm-ray", True, actor_pids))
    assert res.ok, res.counts()  # type: ignore[attr-defined]
    print(f"warm-up: local {warm_local:.2f} s, cluster {warm_cluster:.2f} s")
    before, t_idle, c_idle = cpu_s(ray_pids(cluster)), time.perf_counter(), own_cpu_s()
    await asyncio.sleep(10)  # Ray's own background, nothing running (node actors kept)
    after = cpu_s(ray_pids(cluster))
    idle_used = {pid: v - before.get(pid, 0.0) for pid, v in after.items()}
    idle_s = time.perf_counter() - t_idle
    idle_share = sum(idle_used.values()) / idle_s
    idle_rate = {  # share of a core each part burns with nothing running
        "driver": (own_cpu_s() - c_idle) / idle_s,
        "actors": sum(v for pid, v in idle_used.items() if pid in warm_actors) / idle_s,
        "ray": sum(v for pid, v in idle_used.items() if pid not in warm_actors) / idle_s,
    }

    local_s, cluster_s, setup_s, local_cpu, cluster_cpu = [], [], [], [], []
    split: dict[str, list[float]] = {"driver": [], "actors": [], "ray": []}
    local_ids: list[str] = []
    cluster_ids: list[str] = []
    for r in range(args.rounds):
        c0 = own_cpu_s()
        wall, res = await timed(run(f"local{r}"))
        assert res.ok, res.counts()  # type: ignore[attr-defined]
        local_s.append(wall)
        local_ids.append(res.run_id)  # type: ignore[attr-defined]
        local_cpu.append(own_cpu_s() - c0)
        marks: dict[str, float] = {}
        start = time.perf_counter()

        actors: set[int] = set()

        def mark(
            kind: str,
            data: dict[str, object],
            marks: dict[str, float] = marks,
            actors: set[int] = actors,
        ) -> None:
            marks.setdefault(kind, time.perf_counter())
            if kind == "node_ready" and isinstance(data.get("pid"), int):
                actors.add(data["pid"])  # type: ignore[arg-type]

        before, c0 = cpu_s(ray_pids(cluster)), own_cpu_s()
        wall, res = await timed(run(f"ray{r}", True, mark))
        assert res.ok, res.counts()  # type: ignore[attr-defined]
        after = cpu_s(ray_pids(cluster))
        used = {pid: v - before.get(pid, 0.0) for pid, v in after.items()}
        ray_cpu = sum(used.values())
        driver_cpu = own_cpu_s() - c0
        cluster_cpu.append(driver_cpu + ray_cpu)
        split["driver"].append(driver_cpu)
        split["actors"].append(sum(v for pid, v in used.items() if pid in actors))
        split["ray"].append(sum(v for pid, v in used.items() if pid not in actors))
        cluster_s.append(wall)
        cluster_ids.append(res.run_id)  # type: ignore[attr-defined]
        setup_s.append(marks["run_started"] - start)
        print(
            f"round {r + 1}: local {local_s[-1]:.2f} s ({local_cpu[-1]:.1f} CPU s), "
            f"cluster {cluster_s[-1]:.2f} s ({cluster_cpu[-1]:.1f} CPU s)"
        )
    ray.shutdown()
    cluster.shutdown()

    n, lm, cm = args.episodes, statistics.median(local_s), statistics.median(cluster_s)
    setup = statistics.median(setup_s)
    paired = statistics.median(c / loc for loc, c in zip(local_s, cluster_s, strict=True))
    cpu_local = statistics.median(local_cpu) / n * 1000
    lp = profile(tmp / "store", local_ids, args.parallel)
    cp = profile(tmp / "store", cluster_ids, 2 * max(1, args.parallel // 2))
    shutil.rmtree(tmp, ignore_errors=True)
    cpu_cluster = statistics.median(cluster_cpu) / n * 1000
    parts = {k: statistics.median(v) / n * 1000 for k, v in split.items()}
    idle_part = {k: rate * cm / n * 1000 for k, rate in idle_rate.items()}  # at the run's wall
    left = parts["driver"] + parts["actors"] - cpu_local - idle_part["driver"] - idle_part["actors"]
    lines = [
        f"# bench/ray_batch.py: {n} function episodes (warm baseline, driver {args.driver}), "
        f"parallel {args.parallel} locally vs 2 nodes x {max(1, args.parallel // 2)} slots, "
        f"{args.rounds} rounds alternating",
        f"# {time.strftime('%Y-%m-%d')} {platform.node()} {os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}, ray {ray.__version__}; one host (the cluster adds "
        "no CPUs here)",
        f"local wall (median)                     {lm:8.2f} s  ({n / lm:.2f} episodes/s)",
        f"cluster wall (median)                   {cm:8.2f} s  ({n / cm:.2f} episodes/s)",
        f"wall ratio cluster / local              {cm / lm:8.3f}",
        f"overhead per episode (wall x P / n)     {(cm - lm) * args.parallel / n * 1000:8.1f} ms",
        f"  of which the run's setup (per run)    {setup:8.2f} s  "
        "(actors, store check, reap, baseline re-hash on each node)",
        f"wall ratio without the run's setup      {(cm - setup) / lm:8.3f}",
        f"wall ratio, median of the rounds' pairs {paired:8.3f}  (each cluster run / the local "
        "run just before it)",
        f"host-side CPU per episode, local        {cpu_local:8.1f} ms  (this process; not the VMs)",
        f"host-side CPU per episode, cluster      {cpu_cluster:8.1f} ms  "
        "(driver, head, raylets, node actors; not the VMs)",
        f"  the driver (this process)             {parts['driver']:8.1f} ms  (scheduler, "
        "its ledger, Ray's client side)",
        f"  the node actors (their workers)       {parts['actors']:8.1f} ms  (each node's "
        "controller: the local run's work)",
        f"  the rest of Ray                       {parts['ray']:8.1f} ms  (head, raylets, "
        "reapers, idle workers: its background)",
        "  idle background at the cluster wall   "
        + ", ".join(f"{k} {idle_part[k]:.1f}" for k in ("driver", "actors", "ray"))
        + " ms  (each part's idle share of a core x wall / n)",
        f"  left per episode, the cluster path    {left:8.1f} ms  (driver + node actors - local "
        "- their idle background)",
        "per episode, p50 (ms)                      local   cluster   ratio",
        *(
            f"  {label:40} {lp[key]:7.1f}  {cp[key]:8.1f}  {cp[key] / max(lp[key], 1e-9):6.2f}"
            for key, label in (
                ("provision_s", "provision (spare or clone)"),
                ("run_s", "run (in the guest)"),
                ("export_s", "export (store)"),
                ("outside", "slot time outside episodes (per ep.)"),
            )
        ),
        f"Ray's own CPU, idle (10 s, kept actors) {idle_share * 100:8.1f} % of a core",
        f"actor round trip p50 (200 pings)        {statistics.median(trips) * 1000:8.2f} ms",
        f"first run on fresh nodes (warm-up)      {warm_cluster:8.2f} s  "
        f"(local warm-up {warm_local:.2f} s): each node's first template",
        f"head start                              {head_s:8.2f} s",
        "node join (add_node, each)              " + ", ".join(f"{j:.2f}" for j in joins) + " s",
        "# rounds (local / cluster wall s): "
        + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(local_s, cluster_s, strict=True)),
        f"# load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
    ]
    write(ROOT / "bench" / "results" / "ray.txt", lines)


if __name__ == "__main__":
    asyncio.run(main())
