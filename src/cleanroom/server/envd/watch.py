"""Watching a guest folder for envd's ``WatchDir`` stream and its ``CreateWatcher`` /
``GetWatcherEvents`` / ``RemoveWatcher`` calls, by comparing listings.

A watch lists the folder (``depth`` 1, or ``RECURSIVE_DEPTH`` when recursive) through the
same agent request as ``ListDir``, then again every ``POLL_S`` on a stream, or at each
``GetWatcherEvents`` for a watcher; what differs is reported as envd's events, named relative
to the watched folder: an entry that appeared is ``CREATE``, one that went ``REMOVE``, a
file's changed size or mtime ``WRITE``, a changed mode ``CHMOD``. A rename is reported as the
``REMOVE`` of the old name and the ``CREATE`` of the new (no inotify cookie to pair them), and
changes that cancel out between two listings (a file made and removed in between) are not seen.

Limits: ``MAX_WATCHERS`` watchers per sandbox (``RESOURCE_EXHAUSTED`` beyond), a watcher of a
sandbox that ended is dropped, each listing is bounded as ``ListDir`` is.
"""

from __future__ import annotations

import posixpath
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb

POLL_S = 0.2  # a stream's listing interval
RECURSIVE_DEPTH = 32
MAX_WATCHERS = 16  # per sandbox

Listing = dict[str, pb.EntryInfo]
Lister = Callable[[], Awaitable[list[pb.EntryInfo]]]


def listing(top: str, entries: list[pb.EntryInfo]) -> Listing:
    """``entries`` by their path relative to the watched folder ``top``."""
    base = posixpath.normpath(top)
    return {posixpath.relpath(e.path, base): e for e in entries}


def _state(e: pb.EntryInfo) -> tuple[int, int, int, int]:
    """What a change is seen in: a folder's size and mtime move with its entries, which are
    reported themselves (or not watched), so only its kind and mode count."""
    if e.type == pb.FileType.DIRECTORY:
        return (int(e.type), 0, 0, e.mode)
    when = e.modified_time
    nanos = (when.seconds * 1_000_000_000 + when.nanos) if when is not None else 0
    return (int(e.type), e.size, nanos, e.mode)


def changes(before: Listing, after: Listing, include_entry: bool) -> list[pb.FilesystemEvent]:
    """What turned ``before`` into ``after``, as envd's events (module docstring)."""

    def event(name: str, kind: pb.EventType, entry: pb.EntryInfo | None) -> pb.FilesystemEvent:
        return pb.FilesystemEvent(name=name, type=kind, entry=entry if include_entry else None)

    out = [event(n, pb.EventType.REMOVE, None) for n in sorted(before.keys() - after.keys())]
    for name in sorted(before.keys() & after.keys()):
        old, new = _state(before[name]), _state(after[name])
        if old[0] != new[0]:  # replaced by another kind of entry
            out.append(event(name, pb.EventType.REMOVE, None))
            out.append(event(name, pb.EventType.CREATE, after[name]))
        elif old[1:3] != new[1:3]:
            out.append(event(name, pb.EventType.WRITE, after[name]))
        elif old[3] != new[3]:
            out.append(event(name, pb.EventType.CHMOD, after[name]))
    out += [event(n, pb.EventType.CREATE, after[n]) for n in sorted(after.keys() - before.keys())]
    return out


@dataclass
class Watch:
    """One watched folder: how to list it now, and its last listing."""

    top: str
    lister: Lister
    include_entry: bool
    last: Listing = field(default_factory=dict)

    async def start(self) -> None:
        self.last = await self._list()

    async def poll(self) -> list[pb.FilesystemEvent]:
        """The events since the last listing (or ``start``)."""
        now = await self._list()
        events = changes(self.last, now, self.include_entry)
        self.last = now
        return events

    async def _list(self) -> Listing:
        try:
            return listing(self.top, await self.lister())
        except ConnectError as exc:
            if exc.code != Code.NOT_FOUND:
                raise
            return {}  # the folder itself went: everything in it was removed


@dataclass
class Watchers:
    """The server's watchers (``CreateWatcher``), by id, each owned by one sandbox."""

    by_id: dict[str, tuple[str, Watch]] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)

    def room(self, sandbox_id: str, alive: Callable[[str], bool]) -> None:
        """Drop the watchers of sandboxes that ended; refuse a sandbox that has its most."""
        for wid, (sid, _) in list(self.by_id.items()):
            if not alive(sid):
                del self.by_id[wid]
        if sum(1 for sid, _ in self.by_id.values() if sid == sandbox_id) >= MAX_WATCHERS:
            self.counts["refused"] += 1
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED, f"a sandbox has at most {MAX_WATCHERS} watchers"
            )

    def add(self, sandbox_id: str, watch: Watch, alive: Callable[[str], bool]) -> str:
        self.room(sandbox_id, alive)
        wid = "w" + secrets.token_hex(8)
        self.by_id[wid] = (sandbox_id, watch)
        self.counts["created"] += 1
        return wid

    def get(self, sandbox_id: str, watcher_id: str) -> Watch:
        """The sandbox's watcher ``watcher_id``: another sandbox's is not found, as none is."""
        found = self.by_id.get(watcher_id)
        if found is None or found[0] != sandbox_id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id!r} not found")
        return found[1]

    def remove(self, sandbox_id: str, watcher_id: str) -> None:
        self.get(sandbox_id, watcher_id)
        del self.by_id[watcher_id]

    def lines(self) -> list[str]:
        """Prometheus lines: watchers held, made, refused, streams and events sent."""
        return [
            "# TYPE cleanroom_serve_watchers gauge",
            f"cleanroom_serve_watchers {len(self.by_id)}",
            "# TYPE cleanroom_serve_watch_total counter",
            *(
                f'cleanroom_serve_watch_total{{what="{k}"}} {n}'
                for k, n in sorted(self.counts.items())
            ),
        ]
