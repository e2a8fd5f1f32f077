"""The folder of an env's unix sockets that need a path (fake and gvisor agent sockets).

It is ``<runtime folder>/<env_id>/`` (see ``paths.runtime_dir``), not the run folder: a socket's
path must fit in 108 bytes whatever the home's length. Made 0700 under the checked runtime
folder; removed with the env (and the runtime folder with its last env: nothing piles up in
/tmp), and an env whose folder is still there is not absent.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from cleanroom.errors import LaunchError
from cleanroom.host import hostproc, paths, private


def env_dir(env_id: str) -> Path:
    """Where ``env_id``'s sockets live (it may not exist)."""
    return paths.runtime_dir() / env_id


def make_env_dir(env_id: str) -> Path:
    """A fresh, private socket folder for ``env_id``."""
    for _ in range(3):
        folder = private.runtime_dir() / env_id
        try:
            folder.mkdir(mode=0o700)
            return folder
        except FileNotFoundError:  # another process removed the empty runtime folder meanwhile
            continue
    raise LaunchError(f"cannot make the socket folder {folder}: its parent keeps vanishing")


def remove_env_dir(env_id: str) -> None:
    """Remove ``env_id``'s socket folder, and the runtime folder if no env is left in it."""
    folder = env_dir(env_id)
    hostproc.remove_tree(folder)
    with contextlib.suppress(OSError):  # not empty: other envs of this home are alive
        folder.parent.rmdir()
