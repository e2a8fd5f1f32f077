"""Serve-through-Ray benchmark: the real e2b SDK against ``cleanroom serve --ray`` and against a
local ``cleanroom serve``, in the same run.

A local ``ray.cluster_utils.Cluster`` (a head with no CPUs, 2 nodes each with its own
``CLEANROOM_HOME``, loopback only: ``bench/ray_batch.py``'s set-up) and two servers on the same
template and driver: one holding its sandboxes itself, one placing them on the nodes. Run by
run, alternating so machine noise hits both alike:
  create                    (``Sandbox.create``: returns once the env is ready)
  commands.run("true")      (--cmds per sandbox)
  kill                      (returns once the env is confirmed absent, on its node)
p50 / p99 of each, and the Ray / local ratio of the p50s. All of it on one host: the cluster
adds no CPUs here, only its costs (an actor call per envd call, a long poll per command's
output). Results: bench/results/serve_ray.txt (``--out``), with the host's load average.

    python bench/serve_ray.py [--runs 20] [--cmds 20] [--driver fake]
"""

from __future__ import annotations

import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray_quiet  # noqa: F401  (Ray's environment, before Ray is imported)
from serve import ROOT, _e2b_version, _fake_baseline
from served import start_server
from stats import Table, parser, ratio, write


def one_run(url: str, key: str, cmds: int) -> dict[str, list[float]]:
    from e2b import Sandbox

    os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key})
    out: dict[str, list[float]] = {"create": [], "cmd": [], "end": []}
    t = time.perf_counter()
    sbx = Sandbox.create("b")
    out["create"].append(time.perf_counter() - t)
    for _ in range(cmds):
        t = time.perf_counter()
        sbx.commands.run("true")
        out["cmd"].append(time.perf_counter() - t)
    t = time.perf_counter()
    sbx.kill()
    out["end"].append(time.perf_counter() - t)
    return out


def cluster(root: Path) -> Any:
    """A head with no CPUs and 2 nodes (each its own home, 2 ``cleanroom_vm``)."""
    from ray import cluster_utils

    sys.path.insert(0, str(ROOT))
    from tests.conftest import seed_agent_cache

    c = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
    )
    for name in ("a", "b"):
        home = root / name
        home.mkdir()
        seed_agent_cache(home)
        c.add_node(
            num_cpus=1,
            resources={"cleanroom_vm": 2},
            node_ip_address="127.0.0.1",
            env_vars={"CLEANROOM_HOME": str(home)},
        )
    return c


def main() -> None:
    p = parser(__doc__ or "", "serve_ray.txt", runs=20)
    p.add_argument("--cmds", type=int, default=20)
    p.add_argument("--driver", default="fake")
    args = p.parse_args()
    os.environ.setdefault("CLEANROOM_HOME", str(ROOT / ".cache" / "bench-home"))
    tmp = Path(tempfile.mkdtemp(prefix="serve-ray-bench-"))
    from cleanroom.host import private

    private.check_home()
    digest = _fake_baseline(tmp)
    from cleanroom.server.keys import KeyRing

    key = KeyRing().create("bench")[1]
    ray_cluster = cluster(tmp)
    common = ["--driver", args.driver, "--template", f"b={digest}"]
    servers: list[Any] = []
    got: dict[str, dict[str, list[float]]] = {
        side: {"create": [], "cmd": [], "end": []} for side in ("local", "ray")
    }
    try:
        local, local_url = start_server(common, tmp / "local.log", 180)
        servers.append(local)
        t = time.perf_counter()
        ray_srv, ray_url = start_server(
            [*common, "--ray", ray_cluster.address], tmp / "ray.log", 180
        )
        servers.append(ray_srv)
        ray_start = time.perf_counter() - t
        one_run(local_url, key, 1)  # untimed warm-up on each side (each node's first start)
        one_run(ray_url, key, 1)
        for _ in range(args.runs):
            for side, url in (("local", local_url), ("ray", ray_url)):
                for k, v in one_run(url, key, args.cmds).items():
                    got[side][k] += v
        load = os.getloadavg()
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
            server.wait(120)
        ray_cluster.shutdown()
    table = Table(("n", "p50", "p95", "p99", "min", "max"), 46)
    lines = [
        f"cleanroom serve --ray benchmark ({args.driver} driver, e2b SDK {_e2b_version()}, "
        f"{platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')})",
        f"runs {args.runs} alternating, {args.cmds} commands.run('true') per sandbox; ms; "
        "a local 2-node Ray cluster on this one host",
        table.header("path"),
    ]
    names = {
        "create": "Sandbox.create",
        "cmd": "commands.run('true')",
        "end": "kill (env confirmed absent)",
    }
    for k, name in names.items():
        lines.append(table.row(f"local: {name}", got["local"][k]))
        lines.append(table.row(f"ray:   {name}", got["ray"][k]))
    lines.append("ray / local (p50):")
    for k, name in names.items():
        lines.append(f"  {name:<40} {ratio(got['ray'][k], got['local'][k]):.2f}")
    lines.append(f"serve --ray start (actors on 2 nodes, ready): {ray_start:.2f} s")
    lines.append(f"# load average at the end: {' '.join(f'{x:.1f}' for x in load)}")
    write(args.out, lines)


if __name__ == "__main__":
    main()
