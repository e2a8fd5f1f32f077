"""``RayCluster``: where a run scales out and how many episodes each node takes at once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cleanroom.errors import ConfigError

RESOURCE = "cleanroom_vm"  # a node started with --resources '{"cleanroom_vm": N}' takes N at once


@dataclass(frozen=True)
class RayCluster:
    """A Ray cluster to run on.

    ``address``: ``"auto"`` (the cluster this host belongs to), ``"HOST:PORT"`` or
    ``"ray://HOST:PORT"``; None starts a private local Ray (one node). ``parallel_per_node``:
    episodes at once on each node; a node that declares the ``resource`` (``cleanroom_vm=N``)
    takes N (capped by ``parallel_per_node`` when given), and then only such nodes are used;
    with no node declaring it every alive node takes ``parallel_per_node`` (default 2).
    ``max_attempts``: attempts of one episode across node deaths before it ends
    ``infra_error``. ``keep_nodes``: leave the node actors running for this process's next run
    (their templates and re-hashed baseline kept; they hold their nodes' slots meanwhile, so no
    other driver can run there) — only when the caller connected to Ray itself.
    ``reap_every_s``: the period of each node's detached reaper (``reaper``). ``init``: more
    ``ray.init`` keyword arguments."""

    address: str | None = "auto"
    parallel_per_node: int | None = None
    resource: str = RESOURCE
    max_attempts: int = 3
    namespace: str = "cleanroom"
    keep_nodes: bool = False
    reap_every_s: float | None = 30.0  # each node's detached reaper (None: none started)
    init: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.parallel_per_node is not None and not 1 <= self.parallel_per_node <= 256:
            raise ConfigError(
                f"RayCluster.parallel_per_node must be 1..256, not {self.parallel_per_node}"
            )
        if self.max_attempts < 1:
            raise ConfigError(f"RayCluster.max_attempts must be >= 1, not {self.max_attempts}")

    def slots(self, declared: float | None) -> int:
        """Episodes at once on a node that declares ``declared`` of the resource (or None)."""
        if declared is None:
            return self.parallel_per_node or 2
        n = int(declared)
        return min(n, self.parallel_per_node) if self.parallel_per_node else n
