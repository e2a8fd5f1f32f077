"""An egress allowlist, enforced: a real VM reaches exactly the listed destinations through
the host's egress proxy, and every attempt (allowed or not) is in the ledger and the evidence.

Servers listen on 127.0.0.1 only; the proxy resolves ``allowed.test`` and ``other.test`` to
127.0.0.1 through ``RunOptions.egress_hosts``, so no real DNS is involved.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tests.conftest import with_network
from tests.stored import evidence

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.secrets import FileSecrets
from cleanroom.host import hostproc
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

pytestmark = pytest.mark.vm

SECRET = "exfilsecret42"


async def test_only_the_allowlist_gets_out_and_every_attempt_is_recorded(
    tmp_path: Path, tiny_baseline: Baseline
) -> None:
    hits: list[str] = []

    def server(name: str):  # type: ignore[no-untyped-def]
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            hits.append(name)
            writer.write(b"echo:" + await reader.read(4096))
            await writer.drain()
            writer.close()

        return serve

    allowed = await asyncio.start_server(server("allowed"), "127.0.0.1", 0)
    other = await asyncio.start_server(server("other"), "127.0.0.1", 0)
    a, b = (s.sockets[0].getsockname()[1] for s in (allowed, other))
    # the baseline allows three entries; the manifest narrows them to two
    baseline = with_network(
        tiny_baseline, [f"allowed.test:{a}", f"other.test:{b}", "*.wild.test:443"], tmp_path
    )
    probes = [
        {"kind": "connect", "target": f"allowed.test:{a}", "send": "via-connect"},
        {"kind": "tcp", "target": f"allowed.test:{a}", "send": "via-tcp"},
        {"kind": "http", "url": f"http://allowed.test:{a}/path"},
        {"kind": "connect", "target": f"denied.test:{a}"},
        {"kind": "connect", "target": f"other.test:{b}"},  # the baseline's, not the episode's
        {"kind": "connect", "target": f"127.0.0.1:{b}"},
        {"kind": "tcp", "target": f"10.0.2.2:{b}"},  # the host's loopback, through the gateway
        {"kind": "tcp", "target": f"10.0.2.2:{a}"},
        {"kind": "tcp", "target": f"127.0.0.1:{a}"},  # the guest's own loopback
        {"kind": "tcp", "target": "1.1.1.1:53"},
        {"kind": "tcp", "target": f"other.test:{b}"},
        {"kind": "resolve", "name": "denied.test"},
        {"kind": "resolve", "name": "a.wild.test"},
        {"kind": "resolve", "name": "exfil.test", "secret": "TOKEN"},
    ]
    manifest = Manifest.model_validate(
        {
            "episode_id": "egress",
            "seed": 1,
            "policy": {"id": "p"},
            "task": {"mode": "egress", "probes": probes},
            "secrets": ["TOKEN"],
            "network": {"allow": [f"allowed.test:{a}", "*.wild.test:443"]},
        }
    )
    (tmp_path / "secrets.json").write_text(json.dumps({"TOKEN": SECRET}))
    store = LocalStore(tmp_path / "store")
    options = RunOptions(
        parallel=1,
        staging_dir=tmp_path / "staging",
        egress_hosts={"allowed.test": "127.0.0.1", "other.test": "127.0.0.1"},
    )
    driver = QemuDriver()
    try:
        with Ledger(tmp_path / "ledger.db") as ledger:
            ctl = Controller(
                driver,
                ledger,
                store,
                options=options,
                secret_provider=FileSecrets(tmp_path / "secrets.json"),
            )
            result = await ctl.run([manifest], baseline, run_id="egress")
            events = ledger.events("egress", "egress")
    finally:
        allowed.close()
        other.close()
    episode = result.episodes[0]
    record = episode.record
    assert record is not None, episode.error
    out = record["info"]["results"]
    assert len(out) == len(probes)

    # reached: through CONNECT, as plain TCP (DNS gave a synthetic address), as absolute HTTP
    assert out[0] == "HTTP/1.1 200 Connection established | echo:via-connect"
    assert out[1] == "reply echo:via-tcp"
    assert out[2].startswith("echo:GET /path HTTP/1.1\r\n")
    assert hits.count("allowed") == 3 and "other" not in hits  # nothing else got through
    # refused by the proxy: an unlisted name, the baseline-only entry, a raw loopback address
    for i in (3, 4, 5):
        assert out[i].startswith("HTTP/1.1 403 Forbidden"), (probes[i], out[i])
    # no route at all: the host through the gateway, a raw IP, a name the episode may not use
    for i in (6, 7, 8, 9):
        assert out[i].startswith("ConnectionRefusedError"), (probes[i], out[i])
    assert out[10].startswith("gaierror")  # other.test is not the episode's: NXDOMAIN
    assert out[11].startswith("gaierror") and "not known" in out[11]  # NXDOMAIN
    assert out[12].startswith("gaierror")  # allowed, but through the HTTP proxy only
    assert out[13].startswith("gaierror")
    info = record["info"]
    assert info["interfaces"] == ["eth0", "lo"] and info["proxy"] == "http://10.0.2.100:3128"
    assert "options use-vc" in info["resolv"]

    # provenance: the effective allowlist and counts; a networked env boots cold, and says why
    prov = record["provenance"]
    assert prov["network"]["allow"] == [f"allowed.test:{a}", "*.wild.test:443"]
    assert prov["start"] == "cold" and "egress needs a NIC" in prov["start_note"]
    assert prov["network"]["denied"] == sum(not e.data["allowed"] for e in events) >= 5

    # the ledger has every attempt, with why; the store has the same, as logs/network.jsonl
    seen = {(e.data["via"], e.data["dest"], e.data["allowed"]) for e in events}
    assert ("connect", f"allowed.test:{a}", True) in seen
    assert ("tcp", f"allowed.test:{a}", True) in seen
    assert ("http", f"allowed.test:{a}", True) in seen
    assert ("dns", "allowed.test A", True) in seen
    assert ("connect", f"denied.test:{a}", False) in seen
    assert ("connect", f"other.test:{b}", False) in seen
    assert ("connect", f"127.0.0.1:{b}", False) in seen
    assert ("dns", "denied.test A", False) in seen
    assert ("dns", "[REDACTED:TOKEN].exfil.test A", False) in seen
    denied = [e.data for e in events if not e.data["allowed"]]
    assert all(d["reason"] for d in denied)
    allowed_event = next(e.data for e in events if e.data["via"] == "connect" and e.data["allowed"])
    assert allowed_event["bytes_up"] == len("via-connect")
    assert allowed_event["bytes_down"] == len("echo:via-connect")
    folder = tmp_path / "store" / "runs" / "egress" / "episodes" / "egress"
    log = evidence(folder, "logs", "network.jsonl").read_text()
    assert [json.loads(line) for line in log.splitlines()] == [e.data for e in events]
    assert "network.jsonl" in {entry["name"] for entry in record["logs"]}
    assert SECRET not in log and SECRET not in json.dumps([e.data for e in events])

    # gone: the VM, any helper QEMU started, the proxy's (abstract) socket
    assert episode.destroy is not None and episode.destroy.confirmed_absent
    env_id = prov["env_id"]
    assert hostproc.pids_with_marker(env_id) == []
    assert hostproc.marker(env_id) not in Path("/proc/net/unix").read_text()
