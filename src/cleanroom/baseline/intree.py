"""The build's steps over an image's tree, run inside the build sandbox (``confine.py``).

``python -m cleanroom.baseline.intree STEP`` reads its plan as JSON on stdin, works on
``/tree``, writes progress lines (``progress<TAB>step<TAB>detail``) to stderr and its result as
one JSON line on stdout. A ``CleanroomError`` is reported as ``{"error": {"type", "message"}}``
with exit status 3, and raised again on the host by ``run_step`` with the same type. Steps:

- ``unpack``: apply an image's layers within its limits (``oci.unpack``), then ``facts``.
- ``facts``: what the host needs to know of the tree: its Python version, its Debian packages.
- ``install``: pip's staged wheels, the spec's staged files, the user ``agent``, the guest
  agent's staged files, the image ``User`` (resolved, and its helper installed).
- ``scrub``: remove host- and time-dependent files; make the folders the guest needs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from cleanroom import errors
from cleanroom.baseline.inroot import InRoot
from cleanroom.errors import CleanroomError

TREE = Path("/tree")
STEP_FAILED = 3


def progress(step: str, detail: str) -> None:
    print(f"progress\t{step}\t{detail}", file=sys.stderr, flush=True)


def guest_python(tree: InRoot) -> str | None:
    """The guest's Python version (``"3.11"``) from ``/usr/bin/python3``'s link, if any."""
    link = tree.path("usr/bin/python3", follow_last=False)
    try:
        name = os.readlink(link)
    except OSError:
        return None
    version = Path(name).name.removeprefix("python")
    return version if version.replace(".", "").isdigit() and "." in version else None


def facts(tree: InRoot) -> dict[str, Any]:
    from cleanroom.baseline.lock import dpkg_packages

    status = tree.read("var/lib/dpkg/status", 64 << 20)
    packages = dpkg_packages(status.decode("utf-8", "replace")) if status else {}
    python3 = tree.path("usr/bin/python3")
    has_python = python3.is_file() and not python3.is_symlink()
    return {"python": guest_python(tree), "has_python": has_python, "packages": packages}


def unpack(plan: dict[str, Any], tree: InRoot) -> dict[str, Any]:
    from cleanroom.baseline import oci
    from cleanroom.baseline.layers import Blob, ImageLimits

    layers: list[tuple[str, Blob]] = [(str(digest), int(fd)) for digest, fd in plan["layers"]]
    oci.unpack(layers, tree.root, progress, ImageLimits(**plan.get("limits", {})))
    return facts(tree)


def install(plan: dict[str, Any], tree: InRoot) -> dict[str, Any]:
    from cleanroom.baseline import treefiles, users
    from cleanroom.baseline.image_user import resolve_user
    from cleanroom.core.run_as import RUNAS_PATH

    if plan.get("pip"):
        progress("pip", f"installing the staged wheels into {plan['site']}")
        treefiles.install_wheels(tree, Path(plan["pip"]), plan["site"])
    for item in plan.get("files", []):
        progress("files", f"{item['src']} -> {item['dest']}")
        source = Path(item["staged"])
        if item["folder"]:
            treefiles.copy_tree_in(tree, source, item["dest"])
        else:
            treefiles.copy_file_in(tree, source, item["dest"])
    agent_uid = users.add_agent_user(tree)
    treefiles.copy_tree_in(tree, Path(plan["agent"]), plan["agent_dest"])
    for folder in (plan["agent_dest"], f"{plan['agent_dest']}/agent"):
        tree.folder(folder).chmod(0o755)
    run_as = None
    if plan.get("user") is not None:
        found = resolve_user(tree.root, plan["user"], plan["source"])
        if found is not None:
            progress("files", f"User {found.user}: uid {found.uid}, gid {found.gid}")
            tree.copy_in(Path(plan["runas"]), RUNAS_PATH, 0o755)
            run_as = found.to_json()
    return {"agent_uid": agent_uid, "run_as": run_as}


def scrub(plan: dict[str, Any], tree: InRoot) -> dict[str, Any]:
    from cleanroom.baseline import treefiles

    apt_uid = 0
    for line in (tree.read("etc/passwd", 4 << 20) or b"").decode("utf-8", "replace").splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[0] == "_apt" and fields[2].isascii() and fields[2].isdigit():
            apt_uid = int(fields[2])
    treefiles.scrub(tree, apt_uid)
    tree.copy_in(Path(plan["agent"]), plan["agent_dest"], 0o755)  # last: nothing runs after it
    return {}


STEPS = {"unpack": unpack, "facts": lambda plan, tree: facts(tree), "install": install}
STEPS["scrub"] = scrub


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in STEPS:
        print(f"usage: python -m cleanroom.baseline.intree {{{','.join(STEPS)}}}", file=sys.stderr)
        return 2
    os.umask(0o022)
    plan = json.loads(sys.stdin.buffer.read() or b"{}")
    tree = InRoot(TREE, plan.get("source") or "the image")
    try:
        result = STEPS[argv[0]](plan, tree)
    except CleanroomError as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
        print(json.dumps({"error": error}), flush=True)
        return STEP_FAILED
    except OSError as exc:
        kind = "ImageError" if argv[0] == "unpack" else "BuildError"
        error = {"type": kind, "message": f"{argv[0]}: {exc}"}
        print(json.dumps({"error": error}), flush=True)
        return STEP_FAILED
    print(json.dumps(result), flush=True)
    return 0


def raise_reported(line: bytes, step: str) -> None:
    """On the host: raise again the error a step reported (its type from ``errors``)."""
    try:
        error = json.loads(line)["error"]
        kind = getattr(errors, str(error["type"]), errors.BuildError)
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        raise errors.BuildError(f"{step}: the build sandbox reported nothing readable") from None
    if not (isinstance(kind, type) and issubclass(kind, errors.BaselineError)):
        kind = errors.BuildError
    raise kind(message)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
