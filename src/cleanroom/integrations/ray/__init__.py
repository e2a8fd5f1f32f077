"""Scale-out on Ray (``pip install 'cleanroom[ray]'``): the same manifests, baseline and records
as a local run, on every node of a Ray cluster.

    result = await cleanroom.arun("manifests.jsonl", baseline="b.toml", driver="qemu",
                                  store="s3://bucket/cr", cluster=cleanroom.RayCluster("auto"))

One controller actor per node (``node.NodeController``: its own driver, ledger and reaper, the
run's store shared) runs each episode it is sent as the local lifecycle does; the driver-side
``scheduler`` routes episodes to the least-loaded node, alone numbers attempts, and after a
node's death asks the store before it runs attempt n+1 elsewhere (``aggregate``: the run's
rows in the driver's ledger). Ray itself is imported only inside the calls that need it (in
``scheduler``, ``actor``, ``pool``, ``reaper``): a local run never imports it.
"""

from __future__ import annotations

from cleanroom.integrations.ray.config import RayCluster

__all__ = ["RayCluster"]  # the run itself: scheduler.run_on_cluster (imports Ray)
