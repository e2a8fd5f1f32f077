"""envd's ``filesystem.Filesystem`` service (Connect RPC) on a sandbox's session.

``Stat``, ``ListDir`` (with ``depth``), ``MakeDir``, ``Move``, ``Remove``: by the native
agent's FS request (``agent/fs.py``, ``native/mux.c``: lstat, readdir, mkdir, rename, a tree
removed without following links) through the session's guard, a change recorded in its
transcript. An agent without "fs" (the Python agent, a baseline built before it) gets one guest
command with a fixed argv instead (``find``, ``mkdir``, ``mv``, ``rm``; no shell), its
NUL-separated listing parsed here within bounds (``LIST_MAX`` entries). Names are only
reported, never used as host paths. Watching a folder (``WatchDir``, ``CreateWatcher``,
``GetWatcherEvents``, ``RemoveWatcher``) compares its listings (``envd/watch.py``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import posixpath
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_connect
from e2b.envd.filesystem import filesystem_pb as pb
from protobuf import Oneof
from protobuf.wkt import Timestamp

from cleanroom.agent import fs
from cleanroom.errors import CleanroomError, GuestFileNotFound
from cleanroom.server.control import Sandbox, Sandboxes, ServerError
from cleanroom.server.envd.process import Ctx, _header, connect_error
from cleanroom.server.envd.routing import sandbox_of, user_of
from cleanroom.server.envd.watch import POLL_S, RECURSIVE_DEPTH, Watch, Watchers

LIST_MAX = 100_000  # entries one ListDir returns
FIND_FORMAT = "%p\\0%y\\0%s\\0%m\\0%u\\0%g\\0%T@\\0%l\\0"
FIELDS = 8
TYPES = {"f": pb.FileType.FILE, "d": pb.FileType.DIRECTORY, "l": pb.FileType.SYMLINK}


def _entry(fields: list[bytes]) -> pb.EntryInfo:
    path, kind, size, mode, owner, group, mtime, target = (
        f.decode("utf-8", "replace") for f in fields
    )
    perm = int(mode, 8) if mode.isdigit() else 0
    try:
        when = dt.datetime.fromtimestamp(float(mtime), dt.UTC)
    except ValueError:
        when = dt.datetime.fromtimestamp(0, dt.UTC)
    return pb.EntryInfo(
        name=posixpath.basename(path.rstrip("/")) or path,
        type=TYPES.get(kind, pb.FileType.UNSPECIFIED),
        path=path,
        size=int(size) if size.isdigit() else 0,
        mode=perm,
        permissions=_permissions(kind, perm),
        owner=owner,
        group=group,
        modified_time=Timestamp.from_datetime(when),
        symlink_target=target or None,
        is_symlink=kind == "l",
    )


def _permissions(kind: str, mode: int) -> str:
    bits = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return ("d" if kind == "d" else "l" if kind == "l" else "-") + bits


def parse_find(out: bytes) -> list[pb.EntryInfo]:
    """``find -printf FIND_FORMAT``'s output as entries (a short last record is dropped)."""
    parts = out.split(b"\0")
    entries = []
    for i in range(0, len(parts) - FIELDS + 1, FIELDS):
        entries.append(_entry(parts[i : i + FIELDS]))
        if len(entries) >= LIST_MAX:
            break
    return entries


class FilesystemService(filesystem_connect.Filesystem):
    """The ``filesystem.Filesystem`` handlers (the connectrpc ``Filesystem`` protocol)."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes
        self.watchers = Watchers()

    def _sandbox(self, ctx: Ctx) -> Sandbox:
        try:
            return sandbox_of(self.sandboxes, _header(ctx))
        except ServerError as exc:
            raise connect_error(exc) from exc

    async def _run(self, sbx: Sandbox, ctx: Ctx, argv: list[str]) -> Any:
        assert sbx.sb is not None
        if any(not isinstance(a, str) or "\0" in a for a in argv):
            raise ConnectError(Code.INVALID_ARGUMENT, "a path with a NUL byte")
        try:
            return await sbx.sb.commands.run(argv, user=user_of(_header(ctx)))
        except CleanroomError as exc:
            raise connect_error(exc) from exc

    async def _native(
        self, sbx: Sandbox, op: str, path: str, dest: str | None = None, depth: int = 1
    ) -> list[pb.EntryInfo] | None:
        """``op`` by the agent's own FS request; None where the agent has none (the argv
        path below is used). A change (mkdir, rename, remove) is a transcript step."""
        assert sbx.sb is not None
        try:
            async with sbx.sb.guard.call() as env:
                agent = getattr(env, "session", None)
                if agent is None or "fs" not in agent.features:
                    return None
                listing = await agent.fs(op, _abs(path), dest=dest and _abs(dest), depth=depth)
        except GuestFileNotFound as exc:
            raise ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist") from exc
        except CleanroomError as exc:
            raise connect_error(exc) from exc
        if op in ("mkdir", "rename", "remove"):
            sbx.sb.guard.transcript.add("fs", fs=op, path=path, dest=dest)
        return [_info(e) for e in listing.entries]

    async def _stat(self, sbx: Sandbox, ctx: Ctx, path: str) -> pb.EntryInfo:
        native = await self._native(sbx, "stat", path)
        if native is not None:
            if not native:
                raise ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
            return native[0]
        r = await self._run(
            sbx, ctx, ["find", _abs(path), "-maxdepth", "0", "-printf", FIND_FORMAT]
        )
        entries = parse_find(r.raw.stdout if r.raw is not None else b"")
        if r.exit_code != 0 or not entries:
            raise ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
        return entries[0]

    async def stat(self, request: pb.StatRequest, ctx: Ctx) -> pb.StatResponse:
        sbx = self._sandbox(ctx)
        return pb.StatResponse(entry=await self._stat(sbx, ctx, request.path))

    async def list_dir(self, request: pb.ListDirRequest, ctx: Ctx) -> pb.ListDirResponse:
        sbx = self._sandbox(ctx)
        entries = await self._list(sbx, ctx, request.path, max(1, int(request.depth or 1)))
        return pb.ListDirResponse(entries=entries)

    async def _list(self, sbx: Sandbox, ctx: Ctx, path: str, depth: int) -> list[pb.EntryInfo]:
        """The entries under the folder ``path``, ``depth`` levels down."""
        if sbx.sb is None:
            raise ConnectError(Code.UNAVAILABLE, f"sandbox {sbx.sandbox_id} ended")
        top = await self._stat(sbx, ctx, path)
        if top.type != pb.FileType.DIRECTORY:
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")
        native = await self._native(sbx, "list", path, depth=depth)
        if native is not None:
            return native
        argv = ["find", _abs(path), "-mindepth", "1", "-maxdepth", str(depth),
                "-printf", FIND_FORMAT]  # fmt: skip
        r = await self._run(sbx, ctx, argv)
        return parse_find(r.raw.stdout if r.raw is not None else b"")

    async def make_dir(self, request: pb.MakeDirRequest, ctx: Ctx) -> pb.MakeDirResponse:
        sbx = self._sandbox(ctx)
        try:
            await self._stat(sbx, ctx, request.path)
        except ConnectError as exc:
            if exc.code != Code.NOT_FOUND:
                raise
        else:
            raise ConnectError(Code.ALREADY_EXISTS, f"path '{request.path}' already exists")
        if await self._native(sbx, "mkdir", request.path) is not None:
            return pb.MakeDirResponse(entry=await self._stat(sbx, ctx, request.path))
        r = await self._run(sbx, ctx, ["mkdir", "-p", "--", _abs(request.path)])
        if r.exit_code != 0:
            raise ConnectError(Code.INVALID_ARGUMENT, r.stderr.strip() or "mkdir failed")
        return pb.MakeDirResponse(entry=await self._stat(sbx, ctx, request.path))

    async def move(self, request: pb.MoveRequest, ctx: Ctx) -> pb.MoveResponse:
        sbx = self._sandbox(ctx)
        await self._stat(sbx, ctx, request.source)
        if await self._native(sbx, "rename", request.source, request.destination) is not None:
            return pb.MoveResponse(entry=await self._stat(sbx, ctx, request.destination))
        argv = ["mv", "-T", "--", _abs(request.source), _abs(request.destination)]
        r = await self._run(sbx, ctx, argv)
        if r.exit_code != 0:
            raise ConnectError(Code.INVALID_ARGUMENT, r.stderr.strip() or "mv failed")
        return pb.MoveResponse(entry=await self._stat(sbx, ctx, request.destination))

    async def remove(self, request: pb.RemoveRequest, ctx: Ctx) -> pb.RemoveResponse:
        sbx = self._sandbox(ctx)
        await self._stat(sbx, ctx, request.path)
        if await self._native(sbx, "remove", request.path) is not None:
            return pb.RemoveResponse()
        r = await self._run(sbx, ctx, ["rm", "-rf", "--", _abs(request.path)])
        if r.exit_code != 0:
            raise ConnectError(Code.INVALID_ARGUMENT, r.stderr.strip() or "rm failed")
        return pb.RemoveResponse()

    # -- watching (envd/watch.py) ------------------------------------------------------------

    async def _watch(self, sbx: Sandbox, ctx: Ctx, request: Any) -> Watch:
        depth = RECURSIVE_DEPTH if request.recursive else 1

        async def lister() -> list[pb.EntryInfo]:
            return await self._list(sbx, ctx, request.path, depth)

        watch = Watch(_abs(request.path), lister, bool(request.include_entry))
        await watch.start()  # a path that is no folder is refused here
        return watch

    async def watch_dir(
        self, request: pb.WatchDirRequest, ctx: Ctx
    ) -> AsyncIterator[pb.WatchDirResponse]:
        sbx = self._sandbox(ctx)
        watch = await self._watch(sbx, ctx, request)
        loop = asyncio.get_running_loop()
        until = None if ctx.timeout_ms is None else loop.time() + ctx.timeout_ms / 1000
        ping = _keepalive_s(_header(ctx)("keepalive-ping-interval"))
        self.watchers.counts["streams"] += 1
        yield _watched("start", pb.WatchDirResponse.StartEvent())
        sent = loop.time()
        while sbx.live and (until is None or loop.time() < until):
            await asyncio.sleep(POLL_S)
            try:
                events = await watch.poll()
            except ConnectError as exc:
                if exc.code == Code.UNAVAILABLE:
                    return  # the sandbox ended: so does its watch
                raise
            for event in events:
                self.watchers.counts["events"] += 1
                yield _watched("filesystem", event)
                sent = loop.time()
            if loop.time() - sent >= ping:
                yield _watched("keepalive", pb.WatchDirResponse.KeepAlive())
                sent = loop.time()

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: Ctx
    ) -> pb.CreateWatcherResponse:
        sbx = self._sandbox(ctx)
        self.watchers.room(sbx.sandbox_id, self._alive)  # before its first listing
        watch = await self._watch(sbx, ctx, request)
        wid = self.watchers.add(sbx.sandbox_id, watch, self._alive)
        return pb.CreateWatcherResponse(watcher_id=wid)

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: Ctx
    ) -> pb.GetWatcherEventsResponse:
        sbx = self._sandbox(ctx)
        events = await self.watchers.get(sbx.sandbox_id, request.watcher_id).poll()
        self.watchers.counts["events"] += len(events)
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: Ctx
    ) -> pb.RemoveWatcherResponse:
        sbx = self._sandbox(ctx)
        self.watchers.remove(sbx.sandbox_id, request.watcher_id)
        return pb.RemoveWatcherResponse()

    def _alive(self, sandbox_id: str) -> bool:
        sbx = self.sandboxes.by_id.get(sandbox_id)
        return sbx is not None and sbx.live


def _watched(kind: str, value: Any) -> pb.WatchDirResponse:
    return pb.WatchDirResponse(event=Oneof(kind, value))  # type: ignore[arg-type]


def _keepalive_s(header: str | None) -> float:
    """The keepalive interval a client asks for (envd's header), within 1..60 s."""
    try:
        return min(60.0, max(1.0, float(header or 50)))
    except ValueError:
        return 50.0


def _info(e: fs.Entry) -> pb.EntryInfo:
    """An agent's entry as envd's ``EntryInfo``."""
    kind = {"file": "f", "dir": "d", "symlink": "l"}.get(e.type, "?")
    return pb.EntryInfo(
        name=posixpath.basename(e.path.rstrip("/")) or e.path,
        type=TYPES.get(kind, pb.FileType.UNSPECIFIED),
        path=e.path,
        size=e.size,
        mode=e.mode,
        permissions=_permissions(kind, e.mode),
        owner="root" if e.uid == 0 else str(e.uid),
        group="root" if e.gid == 0 else str(e.gid),
        modified_time=Timestamp.from_datetime(dt.datetime.fromtimestamp(e.mtime, dt.UTC)),
        symlink_target=e.target or None,
        is_symlink=kind == "l",
    )


def _abs(path: str) -> str:
    """A guest path as given, made absolute (relative to ``/``, as E2B's default home is)."""
    if not path:
        raise ConnectError(Code.INVALID_ARGUMENT, "an empty path")
    return path if path.startswith("/") else "/" + path
