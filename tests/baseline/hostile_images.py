"""A corpus of hostile images, each one an attack on the build boundary that once worked.

Every case is an image made here (a busybox base so it builds in seconds, plus the hostile
layer) aimed at ``ring``: a folder of canary files outside the build, named by absolute path the
way an attacker who knows the host would. ``test_hostile_images.py`` builds each through the
real builder and then checks the ring byte for byte. Expectation ``refused``: an
``ImageError`` (or ``BuildError``) matching ``match``; ``built``: the build succeeds and
``check(root)`` sees in the built tree (extracted from the erofs) where the attack really went.

The cases (the attack, and what was hit before the boundary):

- ``whiteout-parent``: a whiteout ``.wh..`` (the folder's parent): deleted the build tree's
  parent recursively (``/dev/shm`` by default).
- ``whiteout-self``: a whiteout ``.wh.`` (the folder itself): deleted the tree.
- ``home-link``: ``/home`` a symlink to the ring: the builder made ``agent``'s home there and
  chowned it (host files chowned to uid 1000).
- ``etc-links``: ``/etc/environment``, ``/etc/hostname`` and ``/etc/passwd`` symlinks into the
  ring: the scrub truncated and overwrote the host files, the user was appended to a host file.
- ``apt-cache-link``: ``/var/cache/apt``, ``/var/lib/apt`` and ``/run`` symlinks to the ring:
  the scrub deleted the host folder's files.
- ``agent-dir-link``: ``/opt/cleanroom`` a symlink to the ring: the agent was written there.
- ``files-through-link``: a ``[[files]]`` destination under an image symlink to the ring: the
  spec's files were copied onto the host.
- ``passwd-fifo``: ``/etc/passwd`` a FIFO: the build hung forever reading it.
- ``python-escape``: the image's ``/usr/bin/python3`` is a script that, run for a function
  entrypoint's byte-compile and import check, tries to write the ring, climb out by ``chroot``,
  mount ``/proc`` and reach ``/proc/1/root``, and kill every process it can: it ran as host root
  in a ``chroot`` and could escape through ``/proc``.
- ``sparse-terabyte``: a sparse file of 1 TiB in a layer of a few KiB: wrote until the scratch
  (``/dev/shm``, RAM) was full, then failed untyped.
- ``uid-over-range``: a file owned by uid 4000000000: not representable in the build's ids.
- ``hardlink-out``: a hard link whose target climbs out with ``..``.
- ``long-name``: a member name of 5000 bytes.
- ``env-over-header``: an image config whose ``Env`` is 300 KB (under the 4 MiB config cap): it
  built, then every attempt ended ``env_crashed`` (the guest refuses a header that large).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cleanroom.baseline.initramfs import BUSYBOX
from tests.baseline.ociutil import Entry, layer_bytes

APPLETS = ("sh", "cat", "echo", "mkdir", "ls", "true", "chroot", "mount", "kill", "id", "touch")


@dataclass
class Case:
    name: str
    layers: Callable[[Path, Path], list[bytes]]  # (ring, scratch) -> hostile layers
    expect: str  # "refused" | "built"
    match: str = ""
    function: bool = False  # a function entrypoint: the image's python3 is run by the build
    files_dest: str = ""  # a [[files]] destination
    check: Callable[[Path, Path], None] | None = None  # (built root, ring)
    config: dict[str, object] = field(default_factory=dict)


def busybox_base() -> bytes:
    entries = [Entry(d, "dir", mode=0o755) for d in ("bin", "usr", "usr/bin", "etc", "opt")]
    entries.append(Entry("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755))
    entries += [Entry(f"bin/{a}", "symlink", link="busybox") for a in APPLETS]
    entries.append(Entry("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"))
    return layer_bytes(entries)


def _one(*entries: Entry) -> Callable[[Path, Path], list[bytes]]:
    return lambda ring, scratch: [busybox_base(), layer_bytes(list(entries))]


def _links(pairs: dict[str, str]) -> Callable[[Path, Path], list[bytes]]:
    def make(ring: Path, scratch: Path) -> list[bytes]:
        entries = [
            Entry(name, "symlink", link=target.format(ring=ring)) for name, target in pairs.items()
        ]
        return [busybox_base(), layer_bytes(entries)]

    return make


def _inside(root: Path, ring: Path) -> Path:
    """Where an absolute link to the ring lands in the built tree."""
    return root / str(ring).lstrip("/")


def _home_check(root: Path, ring: Path) -> None:
    assert (_inside(root, ring) / "agent").is_dir()


def _etc_check(root: Path, ring: Path) -> None:
    assert (root / "etc" / "hostname").read_text() == "cleanroom\n"
    assert not (root / "etc" / "environment").is_symlink()
    passwd = root / "etc" / "passwd"  # the link replaced by the image's own table
    assert not passwd.is_symlink() and "agent:x:" in passwd.read_text()


def _agent_check(root: Path, ring: Path) -> None:
    assert (_inside(root, ring) / "agent" / "agent").is_file()


def _files_check(root: Path, ring: Path) -> None:
    assert (_inside(root, ring) / "payload" / "entry.py").is_file()


def _fifo_check(root: Path, ring: Path) -> None:
    assert "agent:x:" in (root / "etc" / "passwd").read_text()


ESCAPE = """#!/bin/sh
# a hostile /usr/bin/python3: run by the build for byte-compiling and the entry check
mkdir -p {ring}; echo pwned > {ring}/canary-0
echo pwned > /proc/1/root{ring}/canary-0
mkdir -p /x /p; chroot /x /bin/sh -c 'cd ../../../..; echo pwned > {ring}/canary-1'
mount -t proc proc /p && echo pwned > /p/1/root{ring}/canary-1
id > /escape-id
kill -9 -1
exit 0
"""


def _python_escape(ring: Path, scratch: Path) -> list[bytes]:
    script = ESCAPE.format(ring=ring).encode()
    return [busybox_base(), layer_bytes([Entry("usr/bin/python3", data=script, mode=0o755)])]


def _escape_check(root: Path, ring: Path) -> None:
    assert (root / "escape-id").read_text().startswith("uid=0(root) gid=0(root)")  # its userns
    assert (_inside(root, ring) / "canary-0").read_text() == "pwned\n"  # its own tree only


def _sparse(ring: Path, scratch: Path) -> list[bytes]:
    if shutil.which("tar") is None:
        raise RuntimeError("GNU tar is needed to make a sparse layer")
    folder = scratch / "sparse"
    folder.mkdir()
    subprocess.run(["truncate", "-s", "1T", str(folder / "huge")], check=True)
    layer = scratch / "sparse.tar"
    subprocess.run(["tar", "--sparse", "-C", str(folder), "-cf", str(layer), "huge"], check=True)
    (folder / "huge").unlink()
    return [busybox_base(), layer.read_bytes()]


CASES = [
    Case("whiteout-parent", _one(Entry("opt/.wh.."), Entry("x", data=b"x")), "refused", "whiteout"),
    Case("whiteout-self", _one(Entry("opt/.wh.")), "refused", "whiteout"),
    Case("home-link", _links({"home": "{ring}"}), "built", check=_home_check),
    Case(
        "etc-links",
        _links(
            {
                "etc/environment": "{ring}/environment",
                "etc/hostname": "{ring}/hostname",
                "etc/passwd": "{ring}/passwd",
            }
        ),
        "built",
        check=_etc_check,
    ),
    Case(
        "apt-cache-link",
        _links({"var/cache/apt": "{ring}", "var/lib/apt": "{ring}", "run": "{ring}"}),
        "built",
    ),
    Case("agent-dir-link", _links({"opt/cleanroom": "{ring}"}), "built", check=_agent_check),
    Case(
        "files-through-link",
        _links({"srv": "{ring}"}),
        "built",
        files_dest="/srv/payload",
        check=_files_check,
    ),
    Case("passwd-fifo", _one(Entry("etc/passwd", "fifo")), "built", check=_fifo_check),
    Case("python-escape", _python_escape, "built", function=True, check=_escape_check),
    Case("sparse-terabyte", _sparse, "refused", "unpacks to over"),
    Case("uid-over-range", _one(Entry("big", data=b"x", uid=4_000_000_000)), "refused", "id limit"),
    Case(
        "hardlink-out", _one(Entry("h", "hardlink", link="../../etc/passwd")), "refused", "escapes"
    ),
    Case("long-name", _one(Entry("a/" * 2500 + "x", data=b"x")), "refused", "over 4096 bytes"),
    Case(
        "env-over-header",
        _one(Entry("x", data=b"x")),
        "refused",
        "Env are .* bytes as JSON",
        config={"Env": ["HUGE=" + "a" * 300_000]},
    ),
]
