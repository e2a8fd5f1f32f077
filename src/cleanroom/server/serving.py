"""Run the server: hypercorn on one port (HTTP/1.1 and h2c, which the SDK speaks), signals.

At start, what a dead server left is reaped (``reap_at_start``: its VMs, which the deadman and
the parent-death path already ended, confirmed absent and their sessions marked).

SIGTERM / SIGINT: every OpenEnv session (``--openenv``: its episode's record durable, VM
confirmed absent) and every sandbox is ended first (``Sandboxes.close``: ``cancelled``, record
durable, env destroyed and confirmed absent), then hypercorn stops. Loopback unless told
otherwise; TLS when given a certificate and key.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Driver
from cleanroom.server.app import Served, build_app
from cleanroom.server.control import Sandboxes, ServerConfig
from cleanroom.server.keys import KeyRing, Limits

if TYPE_CHECKING:
    from cleanroom.server.openenv.hub import HubConfig

BASE_SPEC = Path(__file__).parent / "base" / "baseline.toml"
KEEP_ALIVE_S = 310.0  # past the SDK's 300 s idle expiry of a pooled connection


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 3000
    templates: dict[str, Callable[[], Baseline]] = field(default_factory=dict)
    driver: Driver | None = None
    max_sandboxes: int = 64
    limits: Limits = field(default_factory=Limits)
    max_body: int = 256 * 1024 * 1024
    certfile: str | None = None
    keyfile: str | None = None
    domain: str | None = None
    forkable: bool = True
    openenv: HubConfig | None = None  # Gym envs served as OpenEnv environments (server.openenv)
    ray: str | None = None  # sandboxes on this Ray cluster's nodes (auto | ADDRESS), else here
    ray_store: str | None = None  # the store the nodes' baselines come from (else each node's)


async def reap_at_start(driver: Driver) -> None:
    """Before serving: the envs a dead server (or any dead controller) left are destroyed and
    confirmed absent, their sessions marked (``cleanroom reap``'s work, on this driver)."""
    from cleanroom.ledger import Ledger
    from cleanroom.lifecycle.reaper import reap
    from cleanroom.store import open_store

    with Ledger() as ledger:
        report = await reap(driver, ledger, open_store(None))
    for env_id in report.destroyed:
        print(f"cleanroom serve: reaped {env_id} (confirmed absent)", file=sys.stderr)
    for run_id, eid, attempt in report.episodes_marked:
        print(
            f"cleanroom serve: marked {run_id}/{eid} attempt {attempt} (controller lost)",
            file=sys.stderr,
        )
    if report.failed:
        print(f"cleanroom serve: ALERT still present: {', '.join(report.failed)}", file=sys.stderr)


async def serve(opts: ServeOptions, ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGTERM / SIGINT, then end every sandbox and return."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    assert opts.driver is not None
    await reap_at_start(opts.driver)
    placement = None
    if opts.ray is not None:  # docs/serve-ray.md
        from cleanroom.integrations.ray.config import RayCluster
        from cleanroom.integrations.ray.serve_head import RayPlacement

        placement = RayPlacement(
            RayCluster(opts.ray),
            opts.driver.name,
            store=opts.ray_store,
            per_node=opts.max_sandboxes,
        )
        for node in await placement.start():
            print(f"cleanroom serve: node {node.node_id} serves sandboxes", file=sys.stderr)
    sandboxes = Sandboxes(
        ServerConfig(
            templates=opts.templates,
            driver=opts.driver,
            max_sandboxes=opts.max_sandboxes,
            domain=opts.domain,
            forkable=opts.forkable,
            placement=placement,
        )
    )
    served = Served(sandboxes, KeyRing(), opts.limits, opts.max_body)
    hub = None
    if opts.openenv is not None and opts.openenv.specs:
        from cleanroom.server.openenv.routes import attach

        hub = attach(served, opts.openenv)
    app = build_app(served)
    config = Config()
    config.bind = [f"{opts.host}:{opts.port}"]
    config.graceful_timeout = 5.0
    # The SDK keeps an idle connection 300 s (E2B_KEEPALIVE_EXPIRY) and reuses it: a server
    # that closes first (hypercorn: after 5 s, or after 1,000 requests) races that reuse, and
    # the request is reset (bench/load.py saw 5 in 4,000). The client closes first now.
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.keep_alive_max_requests = 1 << 30
    config.backlog = 1024  # 100 SDK clients opening at once
    config.accesslog = None
    config.errorlog = "-"
    config.loglevel = "WARNING"
    config.h11_max_incomplete_size = 64 * 1024  # request line + headers
    config.h2_max_inbound_frame_size = 1024 * 1024
    if opts.openenv is not None:  # only OpenEnv sessions speak WebSocket here
        config.websocket_max_message_size = opts.openenv.max_message
    if opts.certfile:
        config.certfile, config.keyfile = opts.certfile, opts.keyfile
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    ending: list[asyncio.Task[None]] = []

    async def shutdown() -> None:
        if hub is not None:
            await hub.close()
        await sandboxes.close()
        stop.set()

    def on_signal() -> None:
        if not ending:
            ending.append(loop.create_task(shutdown()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    scheme = "https" if opts.certfile else "http"
    url = f"{scheme}://{opts.host}:{opts.port}"
    if ready is not None:
        ready(url)
    try:
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    finally:
        if hub is not None:
            await hub.close()
        await sandboxes.close()
        if placement is not None:
            await placement.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    print("cleanroom serve: stopped; every sandbox ended", file=sys.stderr)
