"""Cluster runs on a real local Ray cluster (``ray.cluster_utils.Cluster``) with the fake
driver: a head with no CPUs and nodes each with its own ``CLEANROOM_HOME`` and 2
``cleanroom_vm`` slots, loopback only, tuned health checks. Each test protects one promise:
slots, one record per episode after a node's death, first-writer-wins after a stall, S3."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.drivers.fake import FakeDriver
from cleanroom.integrations.ray import RayCluster
from cleanroom.integrations.ray.scheduler import run_on_cluster
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.reaper import reap
from cleanroom.record import Outcome
from cleanroom.store import open_store

from ..conftest import make_fake_baseline
from ..test_controller import manifest

RAY_ENV = {  # read when Ray is imported: set before
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # the same for head, nodes and driver
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep every address on loopback
}
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
moto_server = pytest.importorskip("moto.server")
pytestmark = pytest.mark.timeout(150)

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
HEALTH = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 500,
    "health_check_initial_delay_ms": 0,
}
OPTS = RunOptions(cleanup_window_s=5)


class LocalCluster:
    """The Ray cluster and where each node keeps its state."""

    def __init__(self, root: Path, endpoint: str) -> None:
        self.root, self.endpoint, self.homes = root, endpoint, {}
        self.cluster = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "node_ip_address": "127.0.0.1",
                "_system_config": HEALTH,
            },
        )
        self.nodes: dict[str, Any] = {}

    def add(self, name: str) -> Any:
        home = self.root / name
        home.mkdir()
        node = self.cluster.add_node(
            num_cpus=1,
            resources={"cleanroom_vm": 2},
            node_ip_address="127.0.0.1",
            env_vars={"CLEANROOM_HOME": str(home)},
        )
        self.homes[node.node_id] = home
        self.nodes[name] = node
        return node

    def ledger(self, name: str) -> Ledger:
        return Ledger(self.root / name / "ledger.db")

    def remove(self, name: str) -> None:
        node = self.nodes.pop(name)
        with contextlib.suppress(Exception):  # a node already killed by its test
            self.cluster.remove_node(node, allow_graceful=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
    local = LocalCluster(tmp_path_factory.mktemp("nodes"), f"http://{host}:{port}")
    try:
        local.add("a")
        local.add("b")
        ray.init(address=local.cluster.address, log_to_driver=False)
        yield local
    finally:
        ray.shutdown()
        local.cluster.shutdown()
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.environ.pop("AWS_ENDPOINT_URL", None)


@pytest.fixture(autouse=True)
def driver_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's own state (its ledger: the run's aggregate), fresh for each test."""
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "driver"))


def _intervals(ledger: Ledger, run_id: str) -> list[tuple[float, float]]:
    return [(e.intent_at, e.destroyed_at or time.time()) for e in ledger.envs(run_id)]


def _peak(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


async def test_slots_are_respected_and_every_episode_has_one_record(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """8 episodes over 2 nodes of 2 slots: both nodes used, never more than 2 envs at once on a
    node, one record per episode, and the driver's ledger holds the run's aggregate."""
    baseline = make_fake_baseline(tmp_path)
    ms = [manifest(f"e{i}", seed=i, mode="sleep", seconds=0.5) for i in range(8)]
    result = await run_on_cluster(
        RayCluster(),
        ms,
        baseline,
        store=tmp_path / "store",
        run_id="slots",
        driver="fake",
        options=OPTS,
    )
    assert result.counts() == {"completed": 8}, [e.error for e in result.episodes]
    store = open_store(tmp_path / "store")
    assert sorted(r["episode_id"] for r in store.list_records("slots")) == sorted(
        m.episode_id for m in ms
    )
    for name in ("a", "b"):
        with cluster.ledger(name) as ledger:
            intervals = _intervals(ledger, "slots")
            assert intervals, f"node {name} ran nothing"
            assert _peak(intervals) <= 2
            assert all(e.confirmed_absent_at for e in ledger.envs("slots"))
    with Ledger() as ledger:
        run = ledger.get_run("slots")
        assert run is not None and run.driver == "ray:fake" and run.status == "completed"
        assert ledger.outcome_counts("slots") == {"completed": 8}


async def test_a_killed_node_leaves_one_record_per_episode_and_nothing_running(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A node's raylet SIGKILLed mid-run: its episodes are queued again elsewhere (attempt 2),
    each episode has exactly one record (a dying node's attempt may still get out first: then
    the retry is ``superseded``, and the result is the record's), no env process of that node is
    left, and its reaper leaves no unconfirmed ledger row."""
    cluster.add("c")
    baseline = make_fake_baseline(tmp_path)
    ms = [manifest(f"k{i}", seed=i, mode="sleep", seconds=2) for i in range(6)]
    run = asyncio.ensure_future(
        run_on_cluster(
            RayCluster(),
            ms,
            baseline,
            store=tmp_path / "store",
            run_id="kill",
            driver="fake",
            options=OPTS,
        )
    )
    ledger_c = cluster.ledger("c")
    await _until(lambda: run.done() or any(e.ready_at for e in ledger_c.envs("kill")), 30)
    assert not run.done(), run.result()
    pids = [e.pid for e in ledger_c.envs("kill") if e.pid]
    raylet = cluster.nodes["c"].all_processes["raylet"][0].process
    os.kill(raylet.pid, signal.SIGKILL)
    result = await asyncio.wait_for(run, 90)
    assert result.counts() == {"completed": 6}, [e.error for e in result.episodes]
    store = open_store(tmp_path / "store")
    assert len(store.list_records("kill")) == 6
    for e in result.episodes:  # whichever attempt got out first is the episode's result
        record = store.get_record("kill", e.episode_id)
        assert record is not None and record["attempt"] == e.attempt
    with Ledger() as ledger:
        attempts = [r.attempt for r in ledger.episodes("kill", all_attempts=True)]
    assert max(attempts) == 2, "no episode of the killed node was queued again"
    await _until(lambda: not any(_alive(p) for p in pids), 15)
    home = cluster.root / "c"
    report = await reap(FakeDriver(run_root=home / "run" / "fake"), ledger_c, store)
    assert not report.failed
    assert all(e.confirmed_absent_at for e in ledger_c.envs("kill"))
    ledger_c.close()
    cluster.remove("c")


async def test_a_stalled_node_finishes_late_and_is_superseded(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A node SIGSTOPped until its episodes ran again elsewhere, then SIGCONTed: the durable
    record is the retry's, the late attempt ends ``superseded`` in that node's ledger."""
    cluster.add("d")
    baseline = make_fake_baseline(tmp_path)
    ms = [manifest(f"s{i}", seed=i, mode="sleep", seconds=3) for i in range(6)]
    run = asyncio.ensure_future(
        run_on_cluster(
            RayCluster(),
            ms,
            baseline,
            store=tmp_path / "store",
            run_id="stall",
            driver="fake",
            options=OPTS,
        )
    )
    ledger_d = cluster.ledger("d")
    await _until(lambda: run.done() or any(e.ready_at for e in ledger_d.envs("stall")), 30)
    assert not run.done(), run.result()
    rows = [e for e in ledger_d.envs("stall") if e.ready_at]
    worker = rows[0].owner_pid
    raylet = cluster.nodes["d"].all_processes["raylet"][0].process
    stopped = [raylet.pid, worker] + [e.pid for e in ledger_d.envs("stall") if e.pid]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        result = await asyncio.wait_for(run, 90)
    finally:
        for pid in stopped[1:]:  # the node's controller and its envs; its raylet stays down
            os.kill(pid, signal.SIGCONT)
    assert result.counts() == {"completed": 6}, [e.error for e in result.episodes]
    store = open_store(tmp_path / "store")
    late = {(e.episode_id, e.attempt) for e in ledger_d.episodes("stall", all_attempts=True)}

    def superseded() -> bool:
        rows = ledger_d.episodes("stall", all_attempts=True)
        return any(r.outcome == Outcome.SUPERSEDED.value for r in rows)

    await _until(superseded, 30)
    for eid, attempt in late:
        record = store.get_record("stall", eid)
        assert record is not None
        row = [r for r in ledger_d.episodes("stall", all_attempts=True) if r.attempt == attempt]
        if any(r.outcome == Outcome.SUPERSEDED.value for r in row):
            assert record["attempt"] != attempt
    os.kill(raylet.pid, signal.SIGKILL)
    ledger_d.close()
    cluster.remove("d")


async def test_the_store_on_s3_takes_the_records(cluster: LocalCluster, tmp_path: Path) -> None:
    """The object-store path: every node writes its records to an S3-compatible server with
    the conditional create; the run's records are all there."""
    import s3fs

    s3fs.S3FileSystem().mkdir("cluster-run")
    baseline = make_fake_baseline(tmp_path)
    ms = [manifest(f"o{i}", seed=i) for i in range(4)]
    url = "s3://cluster-run/cr"
    result = await run_on_cluster(
        RayCluster(), ms, baseline, store=url, run_id="s3", driver="fake", options=OPTS
    )
    assert result.counts() == {"completed": 4}, [e.error for e in result.episodes]
    assert len(open_store(url).list_records("s3")) == 4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _until(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {check}")
        await asyncio.sleep(0.1)


def test_cli_run_on_the_cluster_then_status_report_inspect(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """``cleanroom run --ray ADDRESS``: the same manifests file and records as a local run, and
    ``status``, ``report`` and ``inspect`` read the cluster run from the driver's ledger."""
    import json

    from typer.testing import CliRunner

    from cleanroom.cli import app

    baseline = make_fake_baseline(tmp_path / "driver")  # in the driver's baseline store
    lines = [manifest(f"c{i}", seed=i).model_dump_json() for i in range(3)]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    store = str(tmp_path / "store")
    cli = CliRunner()
    args = ["run", str(tmp_path / "m.jsonl"), "--baseline", baseline.digest, "--driver", "fake"]
    args += ["--ray", cluster.cluster.address, "--parallel-per-node", "1", "--store", store]
    done = cli.invoke(app, [*args, "--run-id", "cli", "--cleanup-window", "5"])
    assert done.exit_code == 0, done.output
    assert len(open_store(store).list_records("cli")) == 3
    status = cli.invoke(app, ["status", "cli", "--store", store])
    assert status.exit_code == 0 and "c2" in status.output, status.output
    report = cli.invoke(app, ["report", "cli", "--store", store, "--json", str(tmp_path / "r")])
    assert report.exit_code == 0, report.output
    assert json.loads((tmp_path / "r").read_text())
    shown = cli.invoke(app, ["inspect", "c1", "--run-id", "cli", "--store", store])
    assert shown.exit_code == 0 and "completed" in shown.output, shown.output


@pytest.mark.vm
async def test_qemu_smoke_across_two_nodes(
    cluster: LocalCluster, tmp_path: Path, tiny_baseline: Any
) -> None:
    """Real microVMs: one episode on each node of the cluster, each durable, each VM confirmed
    gone in the ledger of the node that ran it."""
    ms = [manifest(f"q{i}", seed=i) for i in range(2)]
    result = await run_on_cluster(
        RayCluster(parallel_per_node=1),
        ms,
        tiny_baseline,
        store=tmp_path / "store",
        run_id="qemu",
        driver="qemu",
        options=RunOptions(parallel=1, spares=0),
    )
    assert result.counts() == {"completed": 2}, [e.error for e in result.episodes]
    for name in ("a", "b"):
        with cluster.ledger(name) as ledger:
            envs = ledger.envs("qemu")
            assert len(envs) == 1 and envs[0].confirmed_absent_at is not None


async def test_a_killed_driver_resumed_with_its_run_id_makes_no_duplicates(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The driver ``kill -9``'d mid-run (its node actors die with it), then the same run id
    resumed: the durable episodes are skipped, the rest run again with the next attempt number
    (never one the dead driver used), and every episode has exactly one record."""
    import subprocess
    import sys

    baseline = make_fake_baseline(tmp_path / "driver")
    ms = [manifest(f"r{i}", seed=i, mode="sleep", seconds=0.2 + 2 * (i % 2)) for i in range(6)]
    (tmp_path / "m.jsonl").write_text("".join(m.model_dump_json() + "\n" for m in ms))
    store = tmp_path / "store"
    argv = [sys.executable, "-m", "cleanroom", "run", str(tmp_path / "m.jsonl")]
    argv += ["--baseline", baseline.digest, "--driver", "fake", "--store", str(store)]
    argv += ["--ray", cluster.cluster.address, "--run-id", "resume", "--log-format", "json"]
    driver = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        opened = open_store(store)
        await _until(lambda: len(opened.list_records("resume")) >= 2, 60)
    finally:
        driver.kill()
        driver.wait()
    first = {r["episode_id"] for r in opened.list_records("resume")}
    assert len(first) < 6, "the driver finished before it was killed"
    with Ledger() as ledger:  # the dead driver's aggregate: which attempts it had started
        before = {r.episode_id: r.attempt for r in ledger.episodes("resume")}
    result = await run_on_cluster(
        RayCluster(), ms, baseline, store=store, run_id="resume", driver="fake", options=OPTS
    )
    assert set(result.skipped) >= first
    assert result.counts() == {"completed": 6 - len(result.skipped)}
    records = opened.list_records("resume")
    assert sorted(r["episode_id"] for r in records) == sorted(m.episode_id for m in ms)
    for e in result.episodes:  # an attempt number is never used twice
        assert e.attempt == before.get(e.episode_id, 0) + 1
    for name in ("a", "b"):  # the dead driver's envs: reaped by the next actor, or confirmed
        with cluster.ledger(name) as ledger:
            rows = ledger.envs("resume")
            assert all(e.confirmed_absent_at for e in rows), [e.env_id for e in rows]
            assert not any(e.pid and _alive(e.pid) for e in rows)


async def test_kept_node_actors_serve_the_next_run_and_are_replaced_after(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """``keep_nodes``: two runs reuse each node's actor (same pid); a following run that keeps
    none replaces them (they hold the nodes' slots: it would wait forever otherwise)."""
    baseline = make_fake_baseline(tmp_path)
    pids: list[set[int]] = []

    async def one(run_id: str, keep: bool) -> None:
        seen: set[int] = set()

        def hook(kind: str, data: dict[str, Any]) -> None:
            if kind == "node_ready":
                seen.add(data["pid"])

        result = await run_on_cluster(
            RayCluster(keep_nodes=keep),
            [manifest(f"{run_id}-{i}", seed=i) for i in range(2)],
            baseline,
            store=tmp_path / "store",
            run_id=run_id,
            driver="fake",
            options=OPTS,
            on_event=hook,
        )
        assert result.counts() == {"completed": 2}
        pids.append(seen)

    await one("keep1", True)
    await one("keep2", True)
    await asyncio.wait_for(one("nokeep", False), 60)
    assert pids[0] == pids[1] and len(pids[0]) == 2
    assert not pids[2] & pids[0]


async def test_a_nodes_reaper_confirms_what_its_dead_controller_left(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The node's controller actor SIGKILLed mid-episode (the node itself lives): its envs die
    with it, and the node's detached reaper, not any run, destroys and confirms their ledger
    rows and marks the lost attempts; the episodes run again elsewhere."""
    cluster.add("e")
    baseline = make_fake_baseline(tmp_path)
    ms = [manifest(f"p{i}", seed=i, mode="sleep", seconds=2) for i in range(6)]
    run = asyncio.ensure_future(
        run_on_cluster(
            RayCluster(reap_every_s=0.5),
            ms,
            baseline,
            store=tmp_path / "store",
            run_id="reaper",
            driver="fake",
            options=OPTS,
        )
    )
    ledger_e = cluster.ledger("e")
    await _until(lambda: run.done() or any(e.ready_at for e in ledger_e.envs("reaper")), 30)
    assert not run.done(), run.result()
    os.kill(ledger_e.envs("reaper")[0].owner_pid, signal.SIGKILL)  # the node's controller
    result = await asyncio.wait_for(run, 90)
    assert result.counts() == {"completed": 6}, [e.error for e in result.episodes]

    def confirmed() -> bool:
        rows = ledger_e.envs("reaper")
        return bool(rows) and all(e.confirmed_absent_at for e in rows)

    await _until(confirmed, 30)
    assert any(e.kind == "env_reaped" for e in ledger_e.events("reaper"))
    assert not any(e.pid and _alive(e.pid) for e in ledger_e.envs("reaper"))
    ledger_e.close()
    cluster.remove("e")
