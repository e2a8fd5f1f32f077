"""``cleanroom serve --ray``: the server's sandboxes placed on the nodes of a Ray cluster.

``RayPlacement`` is the server's ``Placement``: one ``ServeNode`` actor per alive node (pinned
to it, never restarted: its sandboxes' sessions live there), each sandbox created on the node
holding the fewest, and every later call on it (commands, files, timeout, kill) sent to that
node (``serve_remote.RemoteSession``). The head's own ledger keeps where each sandbox went and
how it ended, under run ``ray-serve-<sandbox id>`` (the node's session is ``serve-<id>`` in
the node's ledger and store). A watcher asks every node, twice a second, which of its sandboxes
ended there (a timeout, a guest that died); a node that no longer answers (its raylet died) is
lost: each of its sandboxes ends ``env_crashed`` in the head's ledger, its VMs killed by their
parent-death chain and reaped by the node's next start, and the other nodes keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from cleanroom.core.states import Outcome
from cleanroom.errors import ConfigError
from cleanroom.integrations.ray import actor
from cleanroom.integrations.ray.baseline_ref import BaselineRef
from cleanroom.integrations.ray.config import RayCluster
from cleanroom.integrations.ray.serve_node import ServeNode
from cleanroom.integrations.ray.serve_remote import RemoteSession, call
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.server.control import Sandbox, Sandboxes, ServerError

WATCH_S = 0.5  # how often each node is asked which of its sandboxes ended
ANSWER_S = 10.0  # a node silent this long is asked again; one whose actor died is lost
# why a sandbox ended on its node -> its outcome in the head's ledger (the node's record is the
# session's own); anything else (``failed: EnvCrashed``, ...) is its guest's failure
OUTCOMES = {"killed": Outcome.COMPLETED, "timeout": Outcome.TIMEOUT, "cancelled": Outcome.CANCELLED}


@dataclass
class Placed:
    """A node as the head sees it: its actor and the sandboxes it holds."""

    node_id: str
    handle: Any
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)  # ready ones (watched)
    starting: int = 0  # creates under way there
    alive: bool = True
    why: dict[str, str] = field(default_factory=dict)  # sandbox id -> why it ended there


class RayPlacement:
    """Sandboxes on the cluster's nodes (module docstring)."""

    def __init__(
        self,
        cluster: RayCluster,
        driver: str,
        *,
        store: str | None = None,
        options: RunOptions | None = None,
        per_node: int = 64,
    ) -> None:
        self.cluster, self.driver, self.store = cluster, driver, store
        self.options = options or RunOptions(spares=0)
        self.per_node = per_node
        self.nodes: list[Placed] = []
        self.controller_id = "serve-ray-" + secrets.token_hex(6)
        self._owned = False
        self._watch: asyncio.Task[None] | None = None
        self._ledger: Ledger | None = None

    async def start(self) -> list[Placed]:
        """Connect, start a ``ServeNode`` on every alive node (each reaps what a predecessor
        left there), and watch them."""
        try:
            import ray
        except ImportError as exc:
            raise ConfigError(f"serve --ray needs pip install 'cleanroom[ray]' ({exc})") from exc
        if not ray.is_initialized():
            cluster = self.cluster
            try:
                ray.init(address=cluster.address, namespace=cluster.namespace, **dict(cluster.init))
            except Exception as exc:  # Ray's own: no cluster there, a version mismatch, ...
                raise ConfigError(f"serve --ray {cluster.address}: {exc}") from exc
            self._owned = True
        self._ledger = Ledger()
        slots = actor.discover(self.cluster.resource, lambda _: self.per_node)
        if not slots:
            raise ConfigError("the Ray cluster has no alive node to serve sandboxes on")
        for slot in slots:
            handle = actor.start_actor(
                slot,
                self.cluster.resource,
                self.driver,
                self.store,
                self.options,
                ServeNode,
                max_sandboxes=self.per_node,
            )
            self.nodes.append(Placed(slot.node_id, handle))
        try:
            await asyncio.gather(*(n.handle.start.remote(None) for n in self.nodes))
        except ray.exceptions.RayError as exc:
            raise ConfigError(f"a node of the Ray cluster failed to start: {exc}") from exc
        self._watch = asyncio.get_running_loop().create_task(self._watcher())
        return self.nodes

    def _choose(self) -> Placed:
        alive = [n for n in self.nodes if n.alive]
        if not alive:
            raise ServerError("no alive node of the Ray cluster to place a sandbox on")
        return min(alive, key=lambda n: (len(n.sandboxes) + n.starting, n.node_id))

    # -- one sandbox's life on its node -------------------------------------------------------

    async def life(self, sandboxes: Sandboxes, sbx: Sandbox) -> None:
        """``Sandboxes._life`` for a sandbox on a node (see ``control.Placement``)."""
        assert sbx.ready is not None and self._ledger is not None
        run_id, sid = f"ray-serve-{sbx.sandbox_id}", sbx.sandbox_id
        outcome, error = Outcome.INFRA_ERROR, None
        self._begin(run_id, sbx)
        node: Placed | None = None
        try:
            node, made = await self._create(run_id, sbx)
            node.sandboxes[sid] = sbx
            sbx.sb = RemoteSession(node, sid)  # type: ignore[assignment]
            sbx.end_at = made["end_at"]
            sbx.ready.set_result(None)
            await sbx.stop.wait()  # a kill, the node's own end of it, or the node lost
            if not node.alive:  # the watcher found its actor dead
                sbx.ended, outcome = "env_crashed", Outcome.ENV_CRASHED
                error = f"node {node.node_id} lost: its sandboxes ended with it"
            elif sid in node.why:
                sbx.ended = node.why.pop(sid)
                outcome = OUTCOMES.get(sbx.ended.split(":")[0], Outcome.ENV_CRASHED)
            else:
                await call(node.handle.sbx_kill.remote(sid), node.node_id)
                sbx.ended, outcome = "killed", Outcome.COMPLETED
        except asyncio.CancelledError:
            sbx.ended, outcome = sbx.ended or "cancelled", Outcome.CANCELLED
            if node is not None and node.alive:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(node.handle.sbx_cancel.remote(sid), 60)
            raise
        except BaseException as exc:
            sbx.ended = sbx.ended or f"failed: {type(exc).__name__}"
            error = f"{type(exc).__name__}: {exc}"
            if not sbx.ready.done():
                sbx.ready.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            if node is not None:
                node.sandboxes.pop(sid, None)
                node.why.pop(sid, None)
            self._end(run_id, sid, outcome, error)
            sbx.sb = None
            sbx.ended = sbx.ended or "closed"
            sandboxes.ended[sbx.ended.split(":")[0]] += 1
            if not sbx.ready.done():
                sbx.ready.set_exception(ServerError(f"sandbox {sid} ended at start"))
            sandboxes.by_id.pop(sid, None)
            for proc in sbx.processes.values():
                proc.emit("gone", None)
            sbx.processes.clear()

    async def _create(self, run_id: str, sbx: Sandbox) -> tuple[Placed, dict[str, Any]]:
        """The sandbox made on the alive node holding the fewest (its env ready there); a node
        found dead on the way is lost, and the next one is tried."""
        import ray

        ref = BaselineRef.of(sbx.baseline)
        while True:
            node = self._choose()
            assert self._ledger is not None
            self._ledger.event(
                "sandbox_routed", run_id=run_id, episode_id=sbx.sandbox_id, node=node.node_id
            )
            node.starting += 1
            try:
                remote = node.handle.sbx_create.remote(
                    sbx.sandbox_id, sbx.template, ref, sbx.timeout_s, sbx.metadata, sbx.envs,
                    sbx.network,
                )  # fmt: skip
                try:
                    made: dict[str, Any] = await remote
                except ray.exceptions.RayActorError as exc:
                    self._lost(node, exc)
                    continue
                except ray.exceptions.RayTaskError:
                    await call(remote, node.node_id)  # the node's own error, raised
                    raise
                return node, made
            finally:
                node.starting -= 1

    def _begin(self, run_id: str, sbx: Sandbox) -> None:
        """The head's ledger: the sandbox's run and its one episode queued (each node it is
        sent to: an event ``sandbox_routed``)."""
        assert self._ledger is not None
        self._ledger.start_run(
            run_id,
            controller_id=self.controller_id,
            baseline=sbx.baseline.digest,
            driver=f"ray:{self.driver}",
            parallel=1,
            meta={"sandbox_id": sbx.sandbox_id, "served": True},
        )
        self._ledger.episode_queued(run_id, sbx.sandbox_id, 1)

    def _end(self, run_id: str, sid: str, outcome: Outcome, error: str | None) -> None:
        assert self._ledger is not None
        self._ledger.episode_finished(run_id, sid, 1, outcome=outcome.value, error=error)
        status = "cancelled" if outcome is Outcome.CANCELLED else "completed"
        self._ledger.finish_run(run_id, status)

    # -- the nodes ----------------------------------------------------------------------------

    async def _watcher(self) -> None:
        while True:
            asks = (self._ask(n) for n in self.nodes if n.alive and n.sandboxes)
            await asyncio.gather(*asks, return_exceptions=True)  # one node's trouble is its own
            await asyncio.sleep(WATCH_S)

    async def _ask(self, node: Placed) -> None:
        """Which of the node's sandboxes ended there; a node whose actor died is lost."""
        import ray

        try:
            ended = await asyncio.wait_for(
                node.handle.sbx_ended.remote(list(node.sandboxes)), ANSWER_S
            )
        except TimeoutError:
            return  # a busy or partitioned node: asked again; Ray says when its actor is dead
        except ray.exceptions.RayActorError as exc:
            self._lost(node, exc)
            return
        except ray.exceptions.RayError:
            return
        for sid, why in ended.items():
            sbx = node.sandboxes.get(sid)
            if sbx is not None:
                node.why[sid] = why
                sbx.stop.set()

    def _lost(self, node: Placed, exc: BaseException) -> None:
        assert self._ledger is not None
        node.alive = False
        self._ledger.event("node_lost", node=node.node_id, error=str(exc)[:500])
        for sbx in list(node.sandboxes.values()):
            sbx.stop.set()

    async def close(self) -> None:
        """After the server's sandboxes ended: stop watching, drop the actors, disconnect."""
        import ray

        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for node in self.nodes:
            with contextlib.suppress(Exception):
                if node.alive:
                    await asyncio.wait_for(node.handle.sbx_close.remote(), 60)
                ray.kill(node.handle, no_restart=True)
        self.nodes = []
        if self._ledger is not None:
            self._ledger.close()
        if self._owned:
            ray.shutdown()
