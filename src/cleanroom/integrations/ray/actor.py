"""The Ray side of a node: ``NodeController`` as an actor pinned to one node (imports Ray).

An async actor (its episodes run on the actor's own event-loop thread, so the VMs it creates
have that thread as their parent-death anchor), ``num_cpus=0`` (VMs are not Ray tasks),
holding the node's ``cleanroom_vm`` slots when the node declares them, pinned to the node with
a hard node-affinity strategy, and never restarted or retried by Ray (``max_restarts=0``,
``max_task_retries=0``): only the driver's scheduler runs an episode again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cleanroom.integrations.ray.node import NodeController
from cleanroom.lifecycle.context import RunOptions


@dataclass(frozen=True)
class NodeSlot:
    """An alive node of the cluster and how many episodes it takes at once."""

    node_id: str
    slots: int
    declared: float | None  # its ``cleanroom_vm`` resource, if it declares one


def start_actor(
    node: NodeSlot,
    resource: str,
    driver: str,
    store: str | None,
    options: RunOptions,
    cls: type[NodeController] = NodeController,
    **more: Any,
) -> Any:
    """A ``cls`` actor (a ``NodeController``) on ``node`` (its handle); ``more``: keyword
    arguments ``cls`` takes beyond the controller's."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(cls)
    return remote.options(
        num_cpus=0,
        resources={resource: node.declared} if node.declared else {},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        max_restarts=0,
        max_task_retries=0,
        max_concurrency=node.slots + 4,  # its episodes and the control calls beside them
    ).remote(driver, store, replace(options, parallel=node.slots), node=node.node_id, **more)


def discover(resource: str, slots_for: Any) -> list[NodeSlot]:
    """The alive nodes that take episodes: those declaring ``resource`` if any do, else all."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    declaring = [n for n in alive if n.get("Resources", {}).get(resource)]
    chosen = declaring or alive
    out = []
    for n in chosen:
        declared = n.get("Resources", {}).get(resource)
        out.append(NodeSlot(n["NodeID"], slots_for(declared), declared))
    return sorted(out, key=lambda s: s.node_id)
