"""Scale-out overhead: the same function episodes locally and through a 2-node Ray cluster.

In one process: N function episodes of the warm test baseline (the agent's warm worker
answers) run locally with ``--parallel P``, then through a local ``ray.cluster_utils.Cluster``
(a head with no CPUs, 2 nodes of P/2 ``cleanroom_vm`` slots each, each node its own
``CLEANROOM_HOME``, loopback only) with the same total parallelism, alternating ``--rounds``
times so machine noise hits both alike. Prints the wall ratio (cluster / local), the overhead
per episode in ms, a bare actor round trip, and the node join cost (``add_node``, then the
run's setup: actors started, store checked, predecessors reaped, baseline re-hashed). Results:
bench/results/ray.txt. All of it on one host: the cluster adds no CPUs here, only its costs.

    python bench/ray.py [--episodes 40] [--parallel 2] [--rounds 2] [--driver qemu]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

for _key, _value in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback only
}.items():
    os.environ.setdefault(_key, _value)

from stats import write  # noqa: E402

# this file is bench/ray.py: with bench/ first on sys.path, `import ray` would find it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

from cleanroom.api import arun  # noqa: E402
from cleanroom.baseline.resolve import resolve_or_build  # noqa: E402
from cleanroom.integrations.ray import RayCluster  # noqa: E402
from cleanroom.lifecycle.context import RunOptions  # noqa: E402
from cleanroom.manifest import Manifest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WARM = ROOT / "tests" / "baselines" / "warm" / "baseline.toml"


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
    ap.add_argument("--rounds", type=int, default=2)
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

    local_s, cluster_s, setup_s = [], [], []
    for r in range(args.rounds):
        wall, res = await timed(
            arun(
                manifests(args.episodes, f"local{r}"),
                baseline=baseline,
                store=tmp / "store",
                driver=args.driver,
                options=opts,
            )
        )
        assert res.ok, res.counts()  # type: ignore[attr-defined]
        local_s.append(wall)
        marks: dict[str, float] = {}
        start = time.perf_counter()

        def mark(kind: str, data: dict[str, object], marks: dict[str, float] = marks) -> None:
            marks.setdefault(kind, time.perf_counter())

        wall, res = await timed(
            arun(
                manifests(args.episodes, f"ray{r}"),
                baseline=baseline,
                store=tmp / "store",
                driver=args.driver,
                options=opts,
                on_event=mark,
                cluster=RayCluster(address=cluster.address, keep_nodes=args.keep_nodes),
            )
        )
        assert res.ok, res.counts()  # type: ignore[attr-defined]
        cluster_s.append(wall)
        setup_s.append(marks["run_started"] - start)
        print(f"round {r + 1}: local {local_s[-1]:.2f} s, cluster {cluster_s[-1]:.2f} s")
    ray.shutdown()
    cluster.shutdown()

    n, lm, cm = args.episodes, statistics.median(local_s), statistics.median(cluster_s)
    setup = statistics.median(setup_s)
    lines = [
        f"# bench/ray.py: {n} function episodes (warm baseline, driver {args.driver}), "
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
        f"actor round trip p50 (200 pings)        {statistics.median(trips) * 1000:8.2f} ms",
        f"head start                              {head_s:8.2f} s",
        "node join (add_node, each)              " + ", ".join(f"{j:.2f}" for j in joins) + " s",
    ]
    write(ROOT / "bench" / "results" / "ray.txt", lines)


if __name__ == "__main__":
    asyncio.run(main())
