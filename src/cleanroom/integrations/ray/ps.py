"""``cleanroom ps --ray``: every node's live envs, each read by a task on that node (imports Ray).

A node's ledger and driver are the truth about the VMs on that node, so each alive node runs
one small task (``num_cpus=0``, hard node affinity, no retry) that reads its own ledger
(``CLEANROOM_HOME`` of that node) and asks its own driver which envs the host has. A node that
does not answer in time is a row saying so, not a failed command.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleanroom.integrations.ray.config import RayCluster
from cleanroom.integrations.ray.connect import connected
from cleanroom.observe.live_envs import LiveEnv, live_envs

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class NodeEnvs:
    """One node's answer: its live envs, or why there is none."""

    node: str
    envs: tuple[LiveEnv, ...] = ()
    error: str | None = None


def node_envs(driver: str, node: str) -> list[LiveEnv]:
    """This node's live envs (runs on the node, in its own home)."""
    from cleanroom.drivers import get_driver

    return [e.on_node(node) for e in live_envs(get_driver(driver))]


def cluster_envs(cluster: RayCluster, driver: str, timeout_s: float = TIMEOUT_S) -> list[NodeEnvs]:
    """Every alive node's live envs, by node id."""
    with connected(cluster, "ps --ray") as (ray, _):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        task = ray.remote(node_envs)
        refs = {
            node: task.options(
                num_cpus=0,
                max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(driver, node)
            for node in nodes
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out = []
        for node, ref in refs.items():
            if ref not in ready:
                ray.cancel(ref, force=True)
                out.append(NodeEnvs(node, error=f"no answer within {timeout_s:.0f} s"))
                continue
            try:
                envs: list[LiveEnv] = ray.get(ref)
                out.append(NodeEnvs(node, tuple(envs)))
            except ray.exceptions.RayError as exc:
                out.append(NodeEnvs(node, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        return out
