"""The native agent in a root with no account files (a ``FROM scratch`` or distroless image).

The agent runs as a host process in a mount namespace of its own where ``/etc/passwd`` and
``/etc/group`` are empty files (bind mounts; the host's files are untouched): root, by name or
by uid, is still an account (uid 0, gid 0, HOME /root: as ``docker exec -u root`` in such an
image), and any other name is ``UnknownUser``. Protects: root needed a line in /etc/passwd, so
``exec(user="root")`` and ``cleanroom shell --user root`` failed in an image without one.
Skips without gcc, root or ``unshare``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.agent.test_native_agent import drive, pytestmark  # noqa: F401

from cleanroom.agent import native
from cleanroom.agent.connection import AgentConnection
from cleanroom.errors import UnknownUser

WRAPPER = """#!/bin/sh
# the agent with empty account files: a mount namespace of its own, the host's files untouched
exec unshare --mount --propagation private sh -c \\
  'mount --bind "$0" /etc/passwd && mount --bind "$0" /etc/group && exec "$1"' {empty} {agent}
"""


@pytest.fixture(scope="module")
def agent_without_accounts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent, started by a wrapper that hides the host's /etc/passwd and /etc/group."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a mount namespace")
    folder = tmp_path_factory.mktemp("native-no-passwd")
    agent = folder / native.BINARY
    subprocess.run(native.gcc_argv(agent), cwd=native.NATIVE_DIR, check=True)
    empty = folder / "empty"
    empty.write_bytes(b"")
    wrapper = folder / "agent-without-accounts"
    wrapper.write_text(WRAPPER.format(empty=empty, agent=agent))
    wrapper.chmod(0o755)
    return wrapper


def test_root_needs_no_line_in_etc_passwd(agent_without_accounts: Path, tmp_path: Path) -> None:
    async def body(session: AgentConnection) -> None:
        seen = await session.exec(["cat", "/etc/passwd"])
        assert seen.ok and seen.stdout == b""  # really no accounts in its view
        script = "id -u; id -g; echo $HOME; echo $USER"
        for user in ("root", "0"):
            who = await session.exec(["sh", "-c", script], user=user, cwd="/")
            assert who.stdout == b"0\n0\n/root\nroot\n", (user, who)
        with pytest.raises(UnknownUser):
            await session.exec(["true"], user="nobody")
        assert (await session.exec(["id", "-u"])).stdout == b"0\n"

    drive(agent_without_accounts, tmp_path, body)
