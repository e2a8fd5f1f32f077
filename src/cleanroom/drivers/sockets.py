"""The folder of an env's unix sockets that need a path (fake and gvisor agent sockets).

It is ``<runtime folder>/<env_id>/`` (see ``paths.runtime_dir``), not the run folder: a socket's
path must fit in 108 bytes whatever the home's length. Made 0700 under the checked runtime
folder; removed with the env, and an env whose folder is still there is not absent.
"""

from __future__ import annotations

from pathlib import Path

from cleanroom import paths, private
from cleanroom.drivers import hostproc


def env_dir(env_id: str) -> Path:
    """Where ``env_id``'s sockets live (it may not exist)."""
    return paths.runtime_dir() / env_id


def make_env_dir(env_id: str) -> Path:
    """A fresh, private socket folder for ``env_id``."""
    folder = private.runtime_dir() / env_id
    folder.mkdir(mode=0o700)
    return folder


def remove_env_dir(env_id: str) -> None:
    hostproc.remove_tree(env_dir(env_id))
