"""Images of every shape a user brings, run as baselines in real QEMU VMs (native agent).

- busybox-only, config ``User: app``: the entrypoint and session commands run as uid 1000 with
  its groups and HOME, write result.json and artifacts as that user; ``user="root"`` is root.
- musl-only (Alpine-like, pulled from a real registry on 127.0.0.1): a program dynamically
  linked against musl, no glibc in the image, is the image's ``Entrypoint``.
- distroless-like (``docker save``-style archive made by skopeo): one static program and
  ``/etc/passwd``, ``User: nonroot``, no shell at all; a command episode and a session.

Protects: the image config's ``User`` (today ignored: every command ran as root), and that the
agent and the helpers cleanroom adds need nothing from the image's libc or shell.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cleanroom.baseline.builder import build
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.sessions import AsyncSession, session
from tests import vmkit
from tests.baseline import testimages
from tests.baseline.conftest import needs_root_tools
from tests.stored import evidence_bytes
from tests.vmkit import Harness, assert_nothing_left, manifest

pytestmark = [pytest.mark.vm, pytest.mark.build]

ENTRY_SH = b"""#!/bin/sh
echo "as $(id -u)" > /run/cleanroom/out/who.txt
printf '{"reward": 1, "info": {"uid": %s, "gid": %s, "groups": "%s", "home": "%s", "cwd": "%s"}}' \\
  "$(id -u)" "$(id -g)" "$(id -G)" "$HOME" "$(pwd)" > /run/cleanroom/result.json
"""


async def _completed(harness: Harness, baseline: Baseline, run_id: str) -> dict[str, Any]:
    """The durable record of one command episode ``ep`` of ``baseline``, which completed."""
    ctl, _, store, _ = harness
    result = await ctl.run([manifest("ep", 1)], baseline, run_id=run_id)
    assert result.episodes[0].outcome == Outcome.COMPLETED, result.episodes[0].error
    record = store.get_record(run_id, "ep")
    assert record is not None
    return record


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    yield from vmkit.harness(tmp_path, QemuDriver(start="cold"))


async def _busybox_session(sb: AsyncSession) -> None:
    assert (await sb.exec(["id", "-u"])).check().stdout == b"1000\n"
    where = (await sb.exec(["sh", "-c", 'echo "$HOME $(pwd) $PATH"'])).check().stdout
    assert where == b"/home/app /opt/img /bin\n"  # docker exec: the image's Env, WorkingDir
    assert (await sb.exec(["id", "-u"], user="root")).check().stdout == b"0\n"
    touched = await sb.exec(["touch", "/etc/by-app"])
    assert touched.exit_code != 0  # the user really is not root


async def _distroless_session(sb: AsyncSession) -> None:
    # no shell in the image: the program itself, as nonroot, in its WorkingDir
    assert (await sb.exec(["/app/entry"])).check().stdout == b"hello from musl\n"
    raw = await sb.get("/run/cleanroom/result.json")
    assert b'"uid": 65532' in raw and b'"cwd": "/home/nonroot"' in raw


@dataclass(frozen=True)
class UserImage:
    """An image whose config names a ``User``: how it is made, what its command episode
    records (``info``, the artifact ``who.txt``) and what a session on it sees."""

    name: str
    config: dict[str, Any]
    layer: Callable[[Path], bytes]
    kind: str  # how ``testimages.save`` stores it
    info: dict[str, Any]
    who: bytes
    session: Callable[[AsyncSession], Awaitable[None]]


BUSYBOX = UserImage(
    "busybox-user",
    {
        "Env": ["PATH=/bin"],
        "User": "app",
        "WorkingDir": "/opt/img",
        "Cmd": ["/bin/sh", "/opt/img/entry.sh"],
    },
    lambda tmp: testimages.busybox_layer(ENTRY_SH, with_user=True),
    "oci-archive",
    {"uid": 1000, "gid": 1000, "groups": "1000 50", "home": "/home/app", "cwd": "/opt/img"},
    b"as 1000\n",
    _busybox_session,
)
DISTROLESS = UserImage(
    "distroless",
    {"Entrypoint": ["/app/entry"], "User": "nonroot", "WorkingDir": "/home/nonroot"},
    testimages.distroless_layer,
    "docker-archive",
    {
        "uid": 65532,
        "gid": 65532,
        "groups": "65532",
        "home": "/home/nonroot",
        "cwd": "/home/nonroot",
        "libc": "musl",
    },
    b"uid 65532\n",
    _distroless_session,
)


@pytest.mark.parametrize("image", [BUSYBOX, DISTROLESS], ids=lambda image: image.name)
async def test_an_image_runs_as_its_user(
    tmp_path: Path, harness: Harness, image: UserImage
) -> None:
    """The baseline resolves the config's ``User`` (``run_as``: what the episode's ``id``
    then reports); the command episode and a session's commands run as that user."""
    needs_root_tools()
    ref = testimages.save([image.layer(tmp_path)], image.config, tmp_path, image.kind)
    baseline = build(testimages.spec(tmp_path, image.name, ref))
    assert baseline.image is not None
    assert baseline.image["user"] == image.config["User"]
    info = image.info
    assert baseline.image["run_as"] == {
        "user": image.config["User"],
        "uid": info["uid"],
        "gid": info["gid"],
        "groups": [int(g) for g in info["groups"].split()],
        "home": info["home"],
    }

    run_id = f"vm-{image.name}"
    record = await _completed(harness, baseline, run_id)
    _, ledger, store, driver = harness
    assert record["info"] == info
    assert evidence_bytes(store, run_id, "ep", "artifacts", "who.txt") == image.who
    assert_nothing_left(driver, ledger, run_id)

    async with session(
        baseline, driver=driver, ledger=ledger, store=store, run_id=f"{run_id}-session"
    ) as sb:
        await image.session(sb)
        sb.finish(reward=1.0)
    assert_nothing_left(driver, ledger, f"{run_id}-session")


async def test_a_musl_only_image_from_a_registry(
    tmp_path: Path, harness: Harness, registry: str
) -> None:
    needs_root_tools()
    config = {"Env": ["PATH=/app"], "Entrypoint": ["/app/entry"], "WorkingDir": "/app"}
    ref = testimages.save([testimages.musl_layer(tmp_path)], config, tmp_path, registry)
    baseline = build(testimages.spec(tmp_path, "musl-only", ref))
    assert baseline.entrypoint == ("/app/entry",)
    record = await _completed(harness, baseline, "vm-musl")
    _, ledger, store, driver = harness
    assert record["info"]["libc"] == "musl" and record["info"]["uid"] == 0
    assert record["info"]["cwd"] == "/app"
    assert evidence_bytes(store, "vm-musl", "ep", "logs", "stdout.log") == b"hello from musl\n"
    assert record["provenance"]["image"]["layers"] == baseline.image["layers"]  # type: ignore[index]
    assert_nothing_left(driver, ledger, "vm-musl")
