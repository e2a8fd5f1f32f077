"""Test images made here from Debian packages, as real users' images are shaped.

- ``busybox_layer``: static busybox (``busybox-static``) and its applet links, optionally with an
  ``/etc/passwd`` naming a user ``app`` (uid 1000) and a group ``tools``.
- ``musl_layer``: an Alpine-like tree with no glibc at all: musl's dynamic loader
  (``/lib/ld-musl-x86_64.so.1``, from Debian's ``musl``) and a program linked against it by
  ``musl-gcc`` (``musl-tools``).
- ``distroless_layer``: one static program, ``/etc/passwd`` and ``/etc/group`` with the user
  ``nonroot`` (65532), and nothing else (no shell, no libc).
- Bare images, without the folders a guest mounts on (no ``/dev``, ``/proc``, ``/sys``,
  ``/run``, ``/tmp``): ``bare_busybox_layer`` (the static busybox alone, no applet links, no
  ``/etc``), ``scratch_layer`` (``FROM scratch``: one program built by ``gcc -static``, and not
  even a folder entry) and ``bare_distroless_layer`` (``distroless_layer`` without them).

The program (``ENTRY_C``) is a cleanroom entrypoint: it writes ``result.json`` (its uid, gid,
groups, HOME, cwd and libc) and an artifact. ``save(layers, config, folder, kind)`` writes an
OCI layout and converts it with ``skopeo`` to the form asked for.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cleanroom.baseline.initramfs import BUSYBOX
from tests.baseline.ociutil import Entry, layer_bytes, layout, tar_folder

MUSL_LOADER = Path("/lib/ld-musl-x86_64.so.1")
GUEST_DIRS = ("dev", "etc", "proc", "root", "run", "sys", "tmp", "var")
"""What the native init mounts on or the builder writes into (a real image has them too)."""
APPLETS = ("sh", "cat", "echo", "printf", "sleep", "mkdir", "ls", "true", "id", "head", "grep")
APPLETS += ("rm", "env", "wc", "tr", "sed", "kill", "ps", "sysctl", "hostname", "touch", "test")
PASSWD = b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:App:/home/app:/bin/sh\n"
GROUP = b"root:x:0:\napp:x:1000:\ntools:x:50:app\n"

ENTRY_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/types.h>

int main(void) {
    gid_t groups[32];
    int n = getgroups(32, groups);
    char cwd[512] = "?", list[256] = "";
    if (!getcwd(cwd, sizeof cwd)) strcpy(cwd, "?");
    for (int i = 0; i < n; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? " " : "", groups[i]);
#ifdef __GLIBC__
    const char *libc = "glibc";
#else
    const char *libc = "musl";
#endif
    const char *home = getenv("HOME");
    FILE *out = fopen("/run/cleanroom/out/who.txt", "w");
    if (!out) { perror("out/who.txt"); return 4; }
    fprintf(out, "uid %d\n", (int)getuid());
    fclose(out);
    FILE *r = fopen("/run/cleanroom/result.json", "w");
    if (!r) { perror("result.json"); return 5; }
    fprintf(r, "{\"reward\": 1, \"info\": {\"uid\": %d, \"gid\": %d, \"groups\": \"%s\", "
               "\"home\": \"%s\", \"cwd\": \"%s\", \"libc\": \"%s\"}}",
            (int)getuid(), (int)getgid(), list, home ? home : "", cwd, libc);
    fclose(r);
    printf("hello from %s\n", libc);
    return 0;
}
"""


def _dirs(*names: str, mode: int = 0o755) -> list[Entry]:
    return [Entry(d, "dir", mode=mode) for d in names]


def compile_entry(tmp: Path, *, static: bool, cc: str = "musl-gcc") -> bytes:
    """``ENTRY_C`` built by ``musl-gcc`` (dynamic against musl, or fully static), or by ``cc``
    ``gcc`` (glibc; ``static`` only: the images here have no libc to link against)."""
    if cc == "musl-gcc" and (shutil.which("musl-gcc") is None or not MUSL_LOADER.exists()):
        pytest.skip("musl-gcc not installed (make setup installs musl-tools)")
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} not installed")
    source = tmp / "entry.c"
    source.write_text(ENTRY_C)
    binary = tmp / f"entry-{cc}{'-static' if static else ''}"
    flags = ["-static"] if static else []
    subprocess.run([cc, *flags, "-O2", "-s", "-o", str(binary), str(source)], check=True)
    return binary.read_bytes()


def busybox_layer(entry_sh: bytes, *, with_user: bool = False) -> bytes:
    """Static busybox, its applets, ``/opt/img/entry.sh``; ``with_user``: app's passwd/group."""
    if not BUSYBOX.is_file():
        pytest.skip(f"{BUSYBOX} not found (install busybox-static)")
    entries = _dirs("bin", *GUEST_DIRS, "opt", "opt/img")
    entries.append(Entry("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755))
    entries += [Entry(f"bin/{a}", "symlink", link="busybox") for a in APPLETS]
    entries.append(Entry("opt/img/entry.sh", data=entry_sh, mode=0o755))
    if with_user:
        entries += [Entry("etc/passwd", data=PASSWD), Entry("etc/group", data=GROUP)]
        entries += [Entry("home", "dir", mode=0o755)]
        entries += [Entry("home/app", "dir", mode=0o750, uid=1000, gid=1000)]
    return layer_bytes(entries)


def musl_layer(tmp: Path) -> bytes:
    """An Alpine-like tree: musl's loader and a program linked against it; no glibc."""
    entries = _dirs(*GUEST_DIRS, "lib", "app")
    entries.append(Entry("lib/ld-musl-x86_64.so.1", data=MUSL_LOADER.read_bytes(), mode=0o755))
    entries.append(Entry("app/entry", data=compile_entry(tmp, static=False), mode=0o755))
    return layer_bytes(entries, gzip=True)


def distroless_layer(tmp: Path) -> bytes:
    """One static program and the passwd/group of ``nonroot``: nothing else."""
    entries = _dirs(*GUEST_DIRS, "app", "home")
    entries.append(Entry("home/nonroot", "dir", mode=0o700, uid=65532, gid=65532))
    entries.append(
        Entry(
            "etc/passwd",
            data=b"root:x:0:0:root:/root:/sbin/nologin\n"
            b"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
        )
    )
    entries.append(Entry("etc/group", data=b"root:x:0:\nnonroot:x:65532:\n"))
    entries.append(Entry("app/entry", data=compile_entry(tmp, static=True), mode=0o755))
    return layer_bytes(entries, gzip=True)


def bare_busybox_layer(*, squatted: bool = False) -> bytes:
    """``/bin/busybox`` and nothing else: no applet links, no ``/etc``, no folder the guest
    mounts on (the entrypoint calls ``/bin/busybox APPLET``). ``squatted``: what the guest
    mounts on taken by other things, as an image may have them: ``/proc`` a regular file,
    ``/dev`` a dangling symlink, ``/sys`` a symlink to ``/bin``."""
    if not BUSYBOX.is_file():
        pytest.skip(f"{BUSYBOX} not found (install busybox-static)")
    entries = [Entry("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755)]
    if squatted:
        entries.append(Entry("proc", data=b"not a folder\n"))
        entries.append(Entry("dev", "symlink", link="/nowhere"))
        entries.append(Entry("sys", "symlink", link="bin"))
    return layer_bytes(entries)


def scratch_layer(tmp: Path) -> bytes:
    """``FROM scratch`` + ``COPY entry /``: one program (``ENTRY_C``, ``gcc -static``, glibc),
    not even a folder entry."""
    return layer_bytes([Entry("entry", data=compile_entry(tmp, static=True, cc="gcc"), mode=0o755)])


def bare_distroless_layer(tmp: Path) -> bytes:
    """``distroless_layer`` without any of ``GUEST_DIRS``: one static program (musl), the
    passwd and group of ``nonroot`` and its home; no shell, no /dev, /proc, /sys, /run, /tmp."""
    entries = _dirs("app", "etc", "home")
    entries.append(Entry("home/nonroot", "dir", mode=0o700, uid=65532, gid=65532))
    entries.append(Entry("etc/passwd", data=b"nonroot:x:65532:65532::/home/nonroot:/nologin\n"))
    entries.append(Entry("etc/group", data=b"nonroot:x:65532:\n"))
    entries.append(Entry("app/entry", data=compile_entry(tmp, static=True), mode=0o755))
    return layer_bytes(entries, gzip=True)


def save(layers: list[bytes], config: dict[str, Any], folder: Path, kind: str) -> str:
    """The image as ``kind`` (``oci-archive``, ``docker-archive`` via skopeo, or ``docker://``
    a registry ``HOST:PORT``): the reference a spec names (archives relative to ``folder``)."""
    oci = layout(folder / "layout", layers, config)
    if kind == "oci-archive":
        tar_folder(oci, folder / "image.tar")
        return "oci-archive:image.tar"
    if shutil.which("skopeo") is None:
        pytest.skip("skopeo not installed (make setup installs it)")
    if kind == "docker-archive":
        target = f"docker-archive:{folder / 'image.tar'}:tests/image:1"
        ref = "docker-archive:image.tar"
    else:
        target = ref = f"docker://{kind}/tests/image:1"
    tls = ["--dest-tls-verify=false"] if target.startswith("docker://") else []
    subprocess.run(["skopeo", "copy", "--quiet", *tls, f"oci:{oci}:latest", target], check=True)
    return ref


def spec(folder: Path, name: str, ref: str, *, agent: str = "native") -> Path:
    path = folder / "baseline.toml"
    path.write_text(
        f'name = "{name}"\n[base]\nimage = "{ref}"\n[agent]\nkind = "{agent}"\n'
        "[limits]\ntimeout_s = 60\nmemory_mib = 256\n"
    )
    return path
