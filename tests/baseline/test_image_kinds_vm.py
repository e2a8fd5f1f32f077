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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.baseline.builder import build
from cleanroom.baseline.model import Baseline
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.record import Outcome
from cleanroom.sessions import session
from tests import vmkit
from tests.baseline import testimages
from tests.baseline.conftest import needs_root_tools
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


async def test_a_busybox_image_runs_as_its_user(tmp_path: Path, harness: Harness) -> None:
    needs_root_tools()
    config = {"Env": ["PATH=/bin"], "User": "app", "WorkingDir": "/opt/img"}
    config["Cmd"] = ["/bin/sh", "/opt/img/entry.sh"]
    layer = testimages.busybox_layer(ENTRY_SH, with_user=True)
    ref = testimages.save([layer], config, tmp_path, "oci-archive")
    baseline = build(testimages.spec(tmp_path, "busybox-user", ref))
    assert baseline.image is not None
    assert baseline.image["user"] == "app"
    assert baseline.image["run_as"] == {
        "user": "app",
        "uid": 1000,
        "gid": 1000,
        "groups": [1000, 50],
        "home": "/home/app",
    }

    record = await _completed(harness, baseline, "vm-user")
    _, ledger, store, driver = harness
    assert record["info"] == {
        "uid": 1000,
        "gid": 1000,
        "groups": "1000 50",
        "home": "/home/app",
        "cwd": "/opt/img",
    }
    assert store.get_bytes("vm-user", "ep", "artifacts/who.txt") == b"as 1000\n"
    assert_nothing_left(driver, ledger, "vm-user")

    async with session(
        baseline, driver=driver, ledger=ledger, store=store, run_id="vm-user-session"
    ) as sb:
        assert (await sb.exec(["id", "-u"])).check().stdout == b"1000\n"
        where = (await sb.exec(["sh", "-c", 'echo "$HOME $(pwd) $PATH"'])).check().stdout
        assert where == b"/home/app /opt/img /bin\n"  # docker exec: the image's Env, WorkingDir
        assert (await sb.exec(["id", "-u"], user="root")).check().stdout == b"0\n"
        touched = await sb.exec(["touch", "/etc/by-app"])
        assert touched.exit_code != 0  # the user really is not root
        sb.finish(reward=1.0)
    assert_nothing_left(driver, ledger, "vm-user-session")


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
    assert store.get_bytes("vm-musl", "ep", "logs/stdout.log") == b"hello from musl\n"
    assert record["provenance"]["image"]["layers"] == baseline.image["layers"]  # type: ignore[index]
    assert_nothing_left(driver, ledger, "vm-musl")


async def test_a_distroless_image_runs_its_program_as_nonroot(
    tmp_path: Path, harness: Harness
) -> None:
    needs_root_tools()
    config = {"Entrypoint": ["/app/entry"], "User": "nonroot", "WorkingDir": "/home/nonroot"}
    ref = testimages.save(
        [testimages.distroless_layer(tmp_path)], config, tmp_path, "docker-archive"
    )
    baseline = build(testimages.spec(tmp_path, "distroless", ref))
    record = await _completed(harness, baseline, "vm-distroless")
    _, ledger, store, driver = harness
    assert record["info"] == {
        "uid": 65532,
        "gid": 65532,
        "groups": "65532",
        "home": "/home/nonroot",
        "cwd": "/home/nonroot",
        "libc": "musl",
    }
    assert store.get_bytes("vm-distroless", "ep", "artifacts/who.txt") == b"uid 65532\n"
    assert_nothing_left(driver, ledger, "vm-distroless")

    async with session(
        baseline, driver=driver, ledger=ledger, store=store, run_id="vm-distroless-session"
    ) as sb:  # no shell in the image: the program itself, as nonroot, in its WorkingDir
        assert (await sb.exec(["/app/entry"])).check().stdout == b"hello from musl\n"
        raw = await sb.get("/run/cleanroom/result.json")
        assert b'"uid": 65532' in raw and b'"cwd": "/home/nonroot"' in raw
        sb.finish(reward=1.0)
    assert_nothing_left(driver, ledger, "vm-distroless-session")
