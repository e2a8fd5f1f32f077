"""The node actors of a cluster run, kept for the next run if asked (``keep_nodes``).

A run with ``RayCluster(keep_nodes=True)`` from a process that connected to Ray itself (a
training loop, a benchmark) leaves its node actors alive for its next run: their drivers keep
templates and the baseline they re-hashed, so a run pays a node's start once (and the nodes'
slots stay held by this process). Otherwise, and always when the run connected to Ray for
itself (the CLI), its actors are killed at its end. One actor per node at most (it holds the
node's slots): a run with other settings (driver, store, options) replaces it; one that died is
replaced; a node gone is dropped.
"""

from __future__ import annotations

import contextlib
from typing import Any

from cleanroom.integrations.ray import actor
from cleanroom.lifecycle.context import RunOptions


class Node:
    """A node as the scheduler sees it: its actor, its slots, what runs there now."""

    def __init__(self, slot: actor.NodeSlot, handle: Any, settings: tuple[str, ...]) -> None:
        self.slot, self.handle, self.settings = slot, handle, settings
        self.node_id, self.slots = slot.node_id, slot.slots
        self.running, self.alive = 0, True

    @property
    def load(self) -> float:
        return self.running / self.slots


# node id -> its one kept actor (it holds the node's slots: never two per node)
_KEPT: dict[str, Node] = {}


class NodePool:
    """The actors for one run's settings (driver, store, options, resource)."""

    def __init__(self, driver: str, url: str, options: RunOptions, resource: str, keep: bool):
        import ray

        self.driver, self.url, self.options, self.resource = driver, url, options, resource
        self.keep = keep
        job = ray.get_runtime_context().get_job_id()
        self.settings = (job, driver, url, repr(options), resource)
        self._kept = _KEPT  # a run that keeps none still replaces what an earlier run kept

    def nodes(self, slots: list[actor.NodeSlot]) -> list[Node]:
        """A ready-to-use ``Node`` per slot: a kept actor, or a new one."""
        alive = {s.node_id for s in slots}
        for gone in set(self._kept) - alive:
            self.drop(self._kept[gone])
        out = []
        for slot in slots:
            node = self._kept.get(slot.node_id)
            if not self.keep or node is None or (node.settings, node.slot) != (self.settings, slot):
                node = self.fresh(slot)
            node.running = 0
            out.append(node)
        return out

    def fresh(self, slot: actor.NodeSlot) -> Node:
        """A new actor on ``slot``'s node (the kept one, if any, is killed)."""
        old = self._kept.pop(slot.node_id, None)
        if old is not None:
            self.drop(old)
        handle = actor.start_actor(slot, self.resource, self.driver, self.url, self.options)
        node = Node(slot, handle, self.settings)
        if self.keep:
            self._kept[slot.node_id] = node
        return node

    def drop(self, node: Node) -> None:
        import ray

        self._kept.pop(node.node_id, None)
        with contextlib.suppress(Exception):
            ray.kill(node.handle, no_restart=True)

    def release(self, nodes: list[Node]) -> None:
        """After a run: dead nodes dropped; the rest killed unless kept."""
        for node in nodes:
            if not node.alive or not self.keep:
                self.drop(node)
