"""``ServeNode``: a node's controller that also holds served sandboxes (``cleanroom serve --ray``).

The node's part of a served sandbox is exactly the local server's: a ``server.control``
``Sandboxes`` registry on this node's driver and ledger (each sandbox one ``session``: ledger
intent first, its record durable in this node's store, its env destroyed and confirmed absent),
so kill, timeout and a guest's failure end a sandbox here as they do in a local server. The
head (``serve_head``) calls the methods below; a command's output is read by long polls
(``sbx_output``), each returning what came since the caller's cursor. Plain Python (no Ray
here): ``serve_head`` makes it an actor pinned to its node.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
from dataclasses import dataclass, field
from typing import Any

from cleanroom.host import paths
from cleanroom.integrations.ray.baseline_ref import BaselineRef, resolve_on_node
from cleanroom.integrations.ray.node import NodeController
from cleanroom.integrations.ray.serve_ports import NodePorts
from cleanroom.lifecycle.context import RunOptions
from cleanroom.server.control import Sandbox, Sandboxes, SandboxNotFound, ServerConfig
from cleanroom.sessions import CommandHandle
from cleanroom.sessions.commands import CommandResult

POLL_S = 0.5  # the longest one ``sbx_output`` call waits for something new
KEY = "head"  # the head authenticated the caller; here every sandbox belongs to the head


@dataclass
class Started:
    """A command started here: its handle and its output so far, in order."""

    handle: CommandHandle
    chunks: list[tuple[str, bytes]] = field(default_factory=list)
    result: CommandResult | None = None
    error: BaseException | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, kind: str, data: bytes) -> None:
        self.chunks.append((kind, data))
        self.changed.set()


class ServeNode(NodeController):
    """A ``NodeController`` whose ``Sandboxes`` serve the head's sandboxes on this node."""

    def __init__(
        self, driver: str, store: str | None, options: RunOptions, *, node: str, max_sandboxes: int
    ) -> None:
        super().__init__(driver, store or str(paths.store_dir()), options, node=node)
        config = ServerConfig(
            templates={}, driver=self.ctx.driver, max_sandboxes=max_sandboxes, options=options
        )
        config.forkable = False  # pause and fork are not routed through Ray (docs/serve-ray.md)
        self.sandboxes = Sandboxes(config)
        self.started: dict[str, dict[str, Started]] = {}  # sandbox id -> command id -> it
        self.gone: dict[str, str] = {}  # sandbox id -> why it ended (until the head asked)
        self.ports = NodePorts()

    def _get(self, sandbox_id: str) -> Sandbox:
        return self.sandboxes.get(KEY, sandbox_id)

    async def sbx_create(
        self,
        sandbox_id: str,
        template: str,
        ref: BaselineRef,
        timeout_s: float,
        metadata: dict[str, str],
        envs: dict[str, str],
        network: list[str] | None,
    ) -> dict[str, Any]:
        """A new sandbox here (its env ready): its id and times."""
        self._alive()
        name = f"{template}@{ref.digest}"
        if name not in self.sandboxes.config.templates:
            self.sandboxes.config.templates[name] = functools.partial(
                resolve_on_node, ref, self.node, self.ctx.store
            )
        sbx = await self.sandboxes.create(
            KEY,
            name,
            timeout_s=timeout_s,
            metadata=metadata,
            envs=envs,
            network=network,
            max_per_key=self.sandboxes.config.max_sandboxes,
            sandbox_id=sandbox_id,
        )
        sbx.template = template
        assert sbx.task is not None
        sbx.task.add_done_callback(lambda _: self._ended(sbx))
        return {"sandbox_id": sbx.sandbox_id, "started_at": sbx.started_at, "end_at": sbx.end_at}

    def _ended(self, sbx: Sandbox) -> None:
        """Keep why a sandbox ended on its own (timeout, its guest) until the head asks."""
        if sbx.ended not in ("killed", "cancelled"):  # the head's own doing: it knows
            self.gone[sbx.sandbox_id] = sbx.ended or "closed"

    async def sbx_kill(self, sandbox_id: str) -> str | None:
        """End the sandbox (its session closed: record durable, env confirmed absent); why."""
        sbx = self.sandboxes.by_id.get(sandbox_id)
        with contextlib.suppress(SandboxNotFound):
            await self.sandboxes.kill(KEY, sandbox_id)
        self.started.pop(sandbox_id, None)
        self.gone.pop(sandbox_id, None)
        return sbx.ended if sbx is not None else None

    async def sbx_cancel(self, sandbox_id: str) -> None:
        """The head is shutting down: the sandbox ends ``cancelled`` (durable, confirmed)."""
        sbx = self.sandboxes.by_id.get(sandbox_id)
        self.started.pop(sandbox_id, None)
        if sbx is not None and sbx.task is not None and not sbx.task.done():
            sbx.task.cancel("cleanroom serve is shutting down")
            await asyncio.wait([sbx.task])

    async def sbx_set_timeout(self, sandbox_id: str, seconds: float) -> None:
        with contextlib.suppress(SandboxNotFound):
            self.sandboxes.set_timeout(KEY, sandbox_id, seconds)

    async def sbx_ended(self, sandbox_ids: list[str]) -> dict[str, str]:
        """Of ``sandbox_ids``, those that ended here on their own (timeout, guest died): why."""
        out = {}
        for sid in sandbox_ids:
            sbx = self.sandboxes.by_id.get(sid)
            if sbx is None or not sbx.live:
                out[sid] = self.gone.pop(sid, "") or "ended"
                self.started.pop(sid, None)
        return out

    async def sbx_start(
        self, sandbox_id: str, argv: list[str], cwd: str | None, user: str | None, env: Any
    ) -> str:
        """Start ``argv`` in the background; its command id (``sbx_output`` reads it)."""
        sbx = self._get(sandbox_id)
        assert sbx.sb is not None
        cid = secrets.token_hex(6)
        early: list[tuple[str, bytes]] = []  # what came before the handle did
        box: list[Started] = []

        def relay(kind: str) -> Any:
            return lambda data: box[0].add(kind, data) if box else early.append((kind, data))

        handle = await sbx.sb.commands.run(
            argv,
            cwd=cwd,
            user=user,
            env=env,
            on_stdout=relay("stdout"),
            on_stderr=relay("stderr"),
            background=True,
        )
        started = Started(handle, early)
        box.append(started)
        self.started.setdefault(sandbox_id, {})[cid] = started
        task = asyncio.get_running_loop().create_task(self._wait(started))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return cid

    @staticmethod
    async def _wait(started: Started) -> None:
        try:
            started.result = await started.handle.wait()
        except BaseException as exc:
            started.error = exc
            raise
        finally:
            started.changed.set()

    def _started(self, sandbox_id: str, cid: str) -> Started:
        found = self.started.get(sandbox_id, {}).get(cid)
        if found is None:
            raise SandboxNotFound(f"sandbox {sandbox_id}: no command {cid}")
        return found

    async def sbx_output(
        self, sandbox_id: str, cid: str, cursor: int
    ) -> tuple[list[tuple[str, bytes]], CommandResult | None, BaseException | None]:
        """The command's output since ``cursor`` (waits up to ``POLL_S`` for some), and its
        result or error once it ended (then it is forgotten here)."""
        started = self._started(sandbox_id, cid)
        if len(started.chunks) <= cursor and started.result is None and started.error is None:
            started.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(started.changed.wait(), POLL_S)
        chunks = started.chunks[cursor:]
        if started.result is not None or started.error is not None:
            self.started.get(sandbox_id, {}).pop(cid, None)
        return chunks, started.result, started.error

    async def sbx_input(self, sandbox_id: str, cid: str, data: bytes | None) -> None:
        """Bytes to the command's stdin; None closes it."""
        handle = self._started(sandbox_id, cid).handle
        await (handle.close_stdin() if data is None else handle.send_stdin(data))

    async def sbx_signal(self, sandbox_id: str, cid: str) -> None:
        await self._started(sandbox_id, cid).handle.kill()

    async def sbx_run(self, sandbox_id: str, argv: list[str], user: str | None) -> CommandResult:
        """``argv`` to its end (the envd filesystem calls that run a command)."""
        sbx = self._get(sandbox_id)
        assert sbx.sb is not None
        result: CommandResult = await sbx.sb.commands.run(argv, user=user)
        return result

    async def sbx_read(self, sandbox_id: str, path: str) -> bytes:
        sbx = self._get(sandbox_id)
        assert sbx.sb is not None
        return await sbx.sb.files.read(path)

    async def sbx_write(self, sandbox_id: str, path: str, data: bytes) -> None:
        sbx = self._get(sandbox_id)
        assert sbx.sb is not None
        await sbx.sb.files.write(path, data)

    async def port_open(self, sandbox_id: str, port: int) -> str:
        """A connection to the sandbox's guest ``port`` (``serve_ports``); its id."""
        sbx = self._get(sandbox_id)
        assert sbx.sb is not None
        return await self.ports.open(sbx.sb, port)

    async def port_read(self, sandbox_id: str, cid: str) -> bytes | None:
        return await self.ports.read(cid)

    async def port_write(self, sandbox_id: str, cid: str, data: bytes | None) -> None:
        await self.ports.write(cid, data)

    async def port_close(self, sandbox_id: str, cid: str) -> None:
        await self.ports.close(cid)

    async def sbx_close(self) -> None:
        """The head is shutting down: every sandbox here ends ``cancelled``, confirmed."""
        await self.sandboxes.close()
