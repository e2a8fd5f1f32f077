"""A connection to the cluster for one call: Ray's own if the caller made one, else ours."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cleanroom.errors import ConfigError
from cleanroom.integrations.ray.config import RayCluster


@contextmanager
def connected(cluster: RayCluster, what: str) -> Iterator[tuple[Any, bool]]:
    """``(ray, owned)``: the ``ray`` module, connected to ``cluster`` (``owned``: by this call,
    which then disconnects at its end); ConfigError naming ``what`` without the extra."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"{what} needs pip install 'cleanroom[ray]' ({exc})") from exc
    owned = not ray.is_initialized()
    if owned:
        ray.init(address=cluster.address, namespace=cluster.namespace, **dict(cluster.init))
    try:
        yield ray, owned
    finally:
        if owned:
            ray.shutdown()
