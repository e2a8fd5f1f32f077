"""Every baseline has the unprivileged user ``agent`` (``baseline/users.py``, issue 16): added
to a Debian-like tree at uid 1000, to one whose uid 1000 is taken at the next free id, to one
without /etc/passwd beside a root entry, and left alone where it exists. On the old builder the
tree had no such user (``user="agent"`` was an unknown user)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cleanroom.baseline import users
from cleanroom.baseline.inroot import InRoot


def tree(tmp: Path, passwd: str, group: str = "", shadow: str | None = None) -> Path:
    (tmp / "etc").mkdir(parents=True)
    (tmp / "etc" / "passwd").write_text(passwd)
    (tmp / "etc" / "group").write_text(group)
    if shadow is not None:
        (tmp / "etc" / "shadow").write_text(shadow)
        (tmp / "etc" / "shadow").chmod(0o640)
    return tmp


@pytest.mark.skipif(os.geteuid() != 0, reason="chown of the home needs root (as the builder)")
def test_a_debian_tree_gets_agent_at_1000(tmp_path: Path) -> None:
    root = tree(tmp_path, "root:x:0:0:root:/root:/bin/bash\n", "root:x:0:\n", "root:*:1::::::\n")
    assert users.add_agent_user(InRoot(root)) == 1000
    assert (
        (root / "etc" / "passwd")
        .read_text()
        .splitlines()[-1]
        .startswith("agent:x:1000:1000:cleanroom agent:/home/agent:")
    )
    assert "agent:x:1000:" in (root / "etc" / "group").read_text()
    assert (root / "etc" / "shadow").read_text().endswith("agent:!:::::::\n")
    assert (root / "etc" / "shadow").stat().st_mode & 0o777 == 0o640
    home = (root / "home" / "agent").stat()
    assert (home.st_uid, home.st_gid, home.st_mode & 0o777) == (1000, 1000, 0o755)
    assert users.add_agent_user(InRoot(root)) == 1000  # again: nothing added
    lines = (root / "etc" / "passwd").read_text().splitlines()
    assert [line for line in lines if line.startswith("agent:")] == [lines[-1]]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown of the home needs root (as the builder)")
def test_a_taken_uid_moves_on_and_an_empty_tree_gets_root_too(tmp_path: Path) -> None:
    taken = tree(tmp_path / "a", "root:x:0:0::/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/sh")
    assert users.add_agent_user(InRoot(taken)) == 1001
    empty = tmp_path / "b"
    (empty / "etc").mkdir(parents=True)
    assert users.add_agent_user(InRoot(empty)) == 1000
    assert (empty / "etc" / "passwd").read_text().startswith("root:x:0:0:")


def test_an_existing_agent_is_kept(tmp_path: Path) -> None:
    root = tree(tmp_path, "root:x:0:0::/root:/bin/sh\nagent:x:2000:2000::/srv:/bin/sh\n")
    assert users.add_agent_user(InRoot(root)) == 2000
    assert not (root / "home").exists()


def test_links_the_image_planted_are_followed_inside_the_tree_only(tmp_path: Path) -> None:
    """A /home or /etc/passwd that is a symlink to a host path (absolute) resolves inside the
    tree, as the guest would see it: the host folder and file are never touched; a FIFO as
    /etc/group is replaced, not read (it would block)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_text("host:x:0:0::/:/bin/sh\n")
    root = tmp_path / "tree"
    (root / "etc").mkdir(parents=True)
    (root / "home").symlink_to(outside)
    (root / "etc" / "passwd").symlink_to(outside / "passwd")
    os.mkfifo(root / "etc" / "group")
    if os.geteuid() != 0:
        pytest.skip("chown of the home needs root (as the builder)")
    assert users.add_agent_user(InRoot(root)) == 1000
    assert sorted(p.name for p in outside.iterdir()) == ["passwd"]
    assert (outside / "passwd").read_text() == "host:x:0:0::/:/bin/sh\n"
    inside = root / str(outside).lstrip("/")
    assert (inside / "agent").is_dir()  # /home -> /…/outside, followed inside the tree
    assert (root / "etc" / "group").is_file()
    assert "agent:x:1000:" in (root / "etc" / "group").read_text()
