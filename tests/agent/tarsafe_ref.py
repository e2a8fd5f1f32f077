"""The reference a folder's tar stream is compared with: how the removed Python agent
(``agent/tarsafe.py``) packed a folder for DOWNLOAD with ``"tar": true``, kept here so
``test_native_tar.py`` can check the native agent's ``tarpack.c`` against the same bytes."""

from __future__ import annotations

import os
import stat
import tarfile
from typing import Any


class Stopped(Exception):
    """The receiver of a packed stream went away."""


class _Sink:
    """A file-like ``write`` for tarfile onto a ``write(bytes) -> bool`` sink."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def write(self, data: bytes) -> int:
        if not self.sink.write(bytes(data)):
            raise Stopped
        return len(data)


def pack(src: str, sink: Any) -> None:
    """Write the folder ``src`` to ``sink`` as a tar stream (names relative to it, sorted);
    only regular files, folders and symbolic links. ``Stopped`` if the sink stops."""
    with tarfile.open(fileobj=_Sink(sink), mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(dirpath, name)
                mode = os.lstat(path).st_mode
                if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
                    tar.add(path, arcname=os.path.relpath(path, src), recursive=False)
