"""Cluster runs on a real local Ray cluster (``ray.cluster_utils.Cluster``) with the fake
driver: a head with no CPUs and nodes each with its own ``CLEANROOM_HOME`` and 2
``cleanroom_vm`` slots, loopback only, tuned health checks. Each test protects one promise:
slots, one record per episode after a node's death, first-writer-wins after a stall, S3."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.batch.result import RunResult
from cleanroom.checks.audit import verify_run
from cleanroom.core.states import Outcome
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence import keys
from cleanroom.host import hostproc
from cleanroom.integrations.ray import RayCluster
from cleanroom.integrations.ray.baseline_ref import BaselineRef
from cleanroom.integrations.ray.scheduler import run_on_cluster
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.lifecycle.reaper import reap
from cleanroom.store import open_store

from ..batch.test_controller import manifest
from ..conftest import make_fake_baseline, seed_agent_cache

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
        seed_agent_cache(home)  # no node waits for gcc inside a test's timing
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
        # "auto" (RayCluster's default) means this cluster, whatever other cluster this host
        # runs (another suite, a bench): RAY_ADDRESS comes first in Ray's own lookup
        os.environ["RAY_ADDRESS"] = local.cluster.address
        ray.init(address=local.cluster.address, log_to_driver=False)
        yield local
    finally:
        os.environ.pop("RAY_ADDRESS", None)
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
def shared_nodes_only(cluster: LocalCluster) -> Iterator[None]:
    """A node a test added is gone after it, whatever its end (a node left by a failed test
    took later tests' episodes: their own nodes' ledgers missed them)."""
    yield
    for name in [n for n in cluster.nodes if n not in ("a", "b")]:
        cluster.remove(name)


@pytest.fixture(autouse=True)
def driver_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's own state (its ledger: the run's aggregate), fresh for each test."""
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "driver"))


def _fake_run(
    ms: list[Any],
    baseline: Any,
    tmp_path: Path,
    run_id: str,
    config: RayCluster | None = None,
    store: str | Path | None = None,
    on_event: Any = None,
) -> Coroutine[Any, Any, RunResult]:
    """A cluster run of ``ms`` on the fake driver, its store a folder under ``tmp_path``."""
    return run_on_cluster(
        config or RayCluster(),
        ms,
        baseline,
        store=store or tmp_path / "store",
        run_id=run_id,
        driver="fake",
        options=OPTS,
        on_event=on_event,
    )


async def _run_until_node_busy(
    cluster: LocalCluster,
    name: str,
    tmp_path: Path,
    run_id: str,
    *,
    seconds: float,
    config: RayCluster | None = None,
    store: str | Path | None = None,
) -> tuple[asyncio.Future[RunResult], Ledger]:
    """A new node ``name``, then a 6-episode fake run (each sleeping ``seconds``) started in
    the background, returned once the node has an env ready (and the run is not done): the
    run and that node's ledger."""
    cluster.add(name)
    baseline = make_fake_baseline(tmp_path)
    ms = [manifest(f"{run_id}{i}", seed=i, mode="sleep", seconds=seconds) for i in range(6)]
    run = asyncio.ensure_future(_fake_run(ms, baseline, tmp_path, run_id, config, store))
    ledger = cluster.ledger(name)
    await _until(lambda: run.done() or any(e.ready_at for e in ledger.envs(run_id)), 30)
    assert not run.done(), run.result()
    return run, ledger


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
    node, one record per episode, and the driver's ledger holds the run's aggregate. The run
    audits clean with the driver's and the nodes' public keys: its chain names each node's
    sealed part, whose envs the audit checks; a node's part altered breaks the audit there."""
    baseline = make_fake_baseline(tmp_path)
    ms = [manifest(f"e{i}", seed=i, mode="sleep", seconds=0.5) for i in range(8)]
    result = await _fake_run(ms, baseline, tmp_path, "slots")
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
    homes = [Path(os.environ["CLEANROOM_HOME"]), *cluster.homes.values()]
    trusted = [keys.load_private(h / "keys" / keys.HOME_KEY).public_key() for h in homes]
    audit = verify_run(store, "slots", trusted)
    assert audit.ok and audit.records == 8 and audit.envs >= 8, audit.problems
    parts = sorted((tmp_path / "store" / "runs" / "slots" / "ledger" / "nodes").iterdir())
    assert len(parts) >= 2, parts  # a sealed part per node
    events = parts[0] / "events.jsonl"
    events.write_bytes(events.read_bytes().replace(b"env_destroyed", b"env_Destroyed", 1))
    audit = verify_run(store, "slots", trusted)
    assert not audit.ok and f"of node {parts[0].name}" in audit.problems[0], audit.problems


def _store_at(where: str, tmp_path: Path, bucket: str) -> str | Path:
    """A folder store under ``tmp_path``, or an S3 bucket on the moto server."""
    if where == "folder":
        return tmp_path / "store"
    import s3fs

    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/cr"


@pytest.mark.parametrize("where", ["folder", "s3"])
async def test_a_killed_node_leaves_one_record_per_episode_and_nothing_running(
    cluster: LocalCluster, tmp_path: Path, where: str
) -> None:
    """A node's raylet SIGKILLed mid-run, on a folder store and on S3: its episodes are queued
    again elsewhere (attempt 2), each episode has exactly one record (a dying node's attempt
    may still get out first: then the retry is ``superseded``, and the result is the record's),
    no env process of that node is left, and its reaper leaves no unconfirmed ledger row."""
    at = _store_at(where, tmp_path, "kill-run")
    name = f"c-{where}"
    run, ledger_c = await _run_until_node_busy(cluster, name, tmp_path, "kill", seconds=2, store=at)
    pids = [e.pid for e in ledger_c.envs("kill") if e.pid]
    raylet = cluster.nodes[name].all_processes["raylet"][0].process
    os.kill(raylet.pid, signal.SIGKILL)
    result = await asyncio.wait_for(run, 90)
    assert result.counts() == {"completed": 6}, [e.error for e in result.episodes]
    store = open_store(at)
    assert len(store.list_records("kill")) == 6
    for e in result.episodes:  # whichever attempt got out first is the episode's result
        record = store.get_record("kill", e.episode_id)
        assert record is not None and record["attempt"] == e.attempt
    with Ledger() as ledger:
        attempts = [r.attempt for r in ledger.episodes("kill", all_attempts=True)]
    assert max(attempts) == 2, "no episode of the killed node was queued again"
    await _until(lambda: not any(_alive(p) for p in pids), 15)
    home = cluster.root / name
    report = await reap(FakeDriver(run_root=home / "run" / "fake"), ledger_c, store)
    assert not report.failed
    assert all(e.confirmed_absent_at for e in ledger_c.envs("kill"))
    ledger_c.close()
    cluster.remove(name)


@pytest.mark.parametrize("where", ["folder", "s3"])
async def test_a_stalled_node_finishes_late_and_is_superseded(
    cluster: LocalCluster, tmp_path: Path, where: str
) -> None:
    """A node SIGSTOPped until its episodes ran again elsewhere, then SIGCONTed, on a folder
    store and on S3 (moto on loopback): the durable record is the retry's, the late attempt
    ends ``superseded`` in that node's ledger, and every file the winner's record lists still
    holds the winner's bytes."""
    store = _store_at(where, tmp_path, "stall-run")
    run, ledger_d = await _run_until_node_busy(
        cluster, f"d-{where}", tmp_path, "stall", seconds=3, store=store
    )
    rows = [e for e in ledger_d.envs("stall") if e.ready_at]
    worker = rows[0].owner_pid
    raylet = cluster.nodes[f"d-{where}"].all_processes["raylet"][0].process
    stopped = [raylet.pid, worker] + [e.pid for e in ledger_d.envs("stall") if e.pid]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        result = await asyncio.wait_for(run, 90)
    finally:
        for pid in stopped[1:]:  # the node's controller and its envs; its raylet stays down
            os.kill(pid, signal.SIGCONT)
    assert result.counts() == {"completed": 6}, [e.error for e in result.episodes]
    opened = open_store(store)

    def late() -> list[Any]:
        rows = ledger_d.episodes("stall", all_attempts=True)
        return [r for r in rows if r.outcome == Outcome.SUPERSEDED.value]

    await _until(late, 30)
    for row in late():
        record = opened.get_record("stall", row.episode_id)
        assert record is not None and record["attempt"] != row.attempt
        listed = [*record["artifacts"], *record["logs"]]
        assert listed, "the winner's record lists no files"
        for entry in listed:  # under the winner's own folder, holding the winner's bytes
            rel = entry["path"]
            assert rel.startswith(f"attempts/{record['attempt']}/"), rel
            data = opened.get_bytes("stall", row.episode_id, rel)
            assert data is not None and hashlib.sha256(data).hexdigest() == entry["sha256"], rel
    os.kill(raylet.pid, signal.SIGKILL)
    ledger_d.close()
    cluster.remove(f"d-{where}")


async def test_ps_ray_lists_every_nodes_envs(cluster: LocalCluster, tmp_path: Path) -> None:
    """``cleanroom ps --ray``: each node's live envs as its own ledger and driver see them,
    with the node they are on (a task on each node; a busy node still answers)."""
    from typer.testing import CliRunner

    from cleanroom.cli import app
    from cleanroom.integrations.ray.ps import cluster_envs

    # 10 s episodes: still running when the nodes answer, however loaded the host
    run, ledger_f = await _run_until_node_busy(cluster, "f", tmp_path, "ps", seconds=10)
    busy = {e.env_id for e in ledger_f.envs("ps") if e.ready_at and not e.destroyed_at}
    node_f = cluster.nodes["f"].node_id
    answers = {n.node: n for n in await asyncio.to_thread(cluster_envs, RayCluster(), "fake")}
    assert set(answers) >= {node.node_id for node in cluster.nodes.values()}
    assert all(n.error is None for n in answers.values()), answers
    seen = {e.env_id: e for e in answers[node_f].envs}
    assert busy <= set(seen), (busy, seen)
    assert all(seen[i].node == node_f and seen[i].on_host for i in busy)
    shown = await asyncio.to_thread(
        CliRunner().invoke, app, ["ps", "--ray", cluster.cluster.address, "--driver", "fake"]
    )
    assert shown.exit_code == 0, shown.output
    assert node_f[:12] in shown.output and "live envs" in shown.output, shown.output
    result = await asyncio.wait_for(run, 90)
    assert result.counts() == {"completed": 6}
    ledger_f.close()
    cluster.remove("f")


def _hide_the_driver_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes are told of no folder and no spec (as on hosts that share no file system with the
    driver): they must get the baseline from the run's store."""
    from cleanroom.integrations.ray import scheduler

    def hidden(baseline: Any, source: str | None = None) -> BaselineRef:
        return BaselineRef(baseline.digest, folder=None, spec=None)

    monkeypatch.setattr(scheduler.BaselineRef, "of", hidden)


def _imported_on(cluster: LocalCluster, name: str, digest: str) -> bool:
    meta = cluster.root / name / "baselines" / digest.removeprefix("sha256:") / "baseline.json"
    return meta.is_file() and "imported" in json.loads(meta.read_text()).get("built", {})


async def test_the_store_on_s3_takes_the_records_and_carries_the_baseline(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object-store path: nodes that cannot see the driver's baseline import its archive
    from the S3-compatible server (put there once, on their asking, and verified), then write
    their records with the conditional create; the run's records are all there."""
    import s3fs

    s3fs.S3FileSystem().mkdir("cluster-run")
    _hide_the_driver_folder(monkeypatch)
    baseline = make_fake_baseline(tmp_path / "driver")  # in the driver's baseline store
    ms = [manifest(f"o{i}", seed=i) for i in range(4)]
    url = "s3://cluster-run/cr"
    events: list[str] = []
    hook = lambda kind, _data: events.append(kind)  # noqa: E731
    result = await _fake_run(ms, baseline, tmp_path, "s3", store=url, on_event=hook)
    assert result.counts() == {"completed": 4}, [e.error for e in result.episodes]
    assert len(open_store(url).list_records("s3")) == 4
    assert events.count("baseline_shared") == 1
    tar = f"cluster-run/cr/baselines/{baseline.digest.removeprefix('sha256:')}.tar"
    assert s3fs.S3FileSystem().exists(tar)
    assert all(_imported_on(cluster, n, baseline.digest) for n in ("a", "b"))


async def test_a_group_goes_whole_to_one_node(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups on a cluster: each group's episodes all run on one node (where its warm parent
    and snapshot would be), singles spread beside them, one record per episode with its group;
    the baseline reaches nodes that cannot see it through the folder store."""
    import cleanroom.api as cr

    _hide_the_driver_folder(monkeypatch)
    baseline = make_fake_baseline(tmp_path / "driver")
    setup = {"command": ["true"], "timeout_s": 30}
    ms = []
    for gid in ("g1", "g2"):
        ms += cr.group(
            gid,
            setup,
            [
                {"episode_id": f"{gid}-{i}", "seed": i, "policy": {"id": "p"}, "task": {}}
                for i in range(3)
            ],
        )
    ms += [manifest(f"single{i}", seed=i) for i in range(2)]
    result = await _fake_run(ms, baseline, tmp_path, "groups")
    assert result.counts() == {"completed": 8}, [e.error for e in result.episodes]
    assert [e.episode_id for e in result.episodes] == [m.episode_id for m in ms]
    assert sorted(g.group_id for g in result.groups) == ["g1", "g2"]
    where: dict[str, set[str]] = {}
    for name in ("a", "b"):
        with cluster.ledger(name) as ledger:
            for env in ledger.envs("groups"):
                where.setdefault(env.episode_id or "", set()).add(name)
            assert all(e.confirmed_absent_at for e in ledger.envs("groups"))
    for gid in ("g1", "g2"):
        nodes = set().union(*(where[f"{gid}-{i}"] for i in range(3)))
        assert len(nodes) == 1, f"group {gid} ran on {nodes}"
    store = open_store(tmp_path / "store")
    for m in ms:
        record = store.get_record("groups", m.episode_id)
        assert record is not None
        assert record.get("group") == (m.group.id if m.group else None)
    assert all(_imported_on(cluster, n, baseline.digest) for n in ("a", "b"))


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
    ``status``, ``report`` and ``inspect`` read the cluster run from the driver's ledger.
    ``--secrets-from`` reaches the nodes (issue 30: the CLI repeated ``arun``'s cluster branch
    and the nodes were built without a provider): each node resolves it on its host."""
    import json

    from typer.testing import CliRunner

    from cleanroom.cli import app

    baseline = make_fake_baseline(tmp_path / "driver")  # in the driver's baseline store
    lines = [manifest(f"c{i}", seed=i).model_dump_json() for i in range(3)]
    leak = manifest("c3", mode="leak", secret="CLUSTER_TOKEN").model_dump(mode="json")
    lines.append(json.dumps({**leak, "secrets": ["CLUSTER_TOKEN"]}))
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "secrets.json").write_text(json.dumps({"CLUSTER_TOKEN": "cl-T0ken-from-a-file"}))
    store = str(tmp_path / "store")
    cli = CliRunner()
    args = ["run", str(tmp_path / "m.jsonl"), "--baseline", baseline.digest, "--driver", "fake"]
    args += ["--ray", cluster.cluster.address, "--parallel-per-node", "1", "--store", store]
    args += ["--secrets-from", f"file:{tmp_path / 'secrets.json'}"]
    done = cli.invoke(app, [*args, "--run-id", "cli", "--cleanup-window", "5"])
    assert done.exit_code == 0, done.output
    assert len(open_store(store).list_records("cli")) == 4
    leaked = open_store(store).get_record("cli", "c3")
    assert leaked is not None and leaked["outcome"] == "completed"
    assert leaked["info"] == {"leak": "[REDACTED:CLUSTER_TOKEN]", "file_matches": True}
    status = cli.invoke(app, ["status", "cli", "--store", store])
    assert status.exit_code == 0 and "c2" in status.output, status.output
    report = cli.invoke(app, ["report", "cli", "--store", store, "--json", str(tmp_path / "r")])
    assert report.exit_code == 0, report.output
    assert json.loads((tmp_path / "r").read_text())
    shown = cli.invoke(app, ["inspect", "c1", "--run-id", "cli", "--store", store])
    assert shown.exit_code == 0 and "completed" in shown.output, shown.output


def _qemu_run(
    ms: list[Any], baseline: Any, tmp_path: Path, run_id: str, per_node: int
) -> Coroutine[Any, Any, RunResult]:
    """A cluster run on real microVMs, ``per_node`` at once on each node, no spares."""
    return run_on_cluster(
        RayCluster(parallel_per_node=per_node),
        ms,
        baseline,
        store=tmp_path / "store",
        run_id=run_id,
        driver="qemu",
        options=RunOptions(parallel=per_node, spares=0),
    )


@pytest.mark.vm
async def test_qemu_smoke_across_two_nodes(
    cluster: LocalCluster, tmp_path: Path, tiny_baseline: Any
) -> None:
    """Real microVMs: one episode on each node of the cluster, each durable, each VM confirmed
    gone in the ledger of the node that ran it."""
    ms = [manifest(f"q{i}", seed=i) for i in range(2)]
    result = await _qemu_run(ms, tiny_baseline, tmp_path, "qemu", per_node=1)
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
    run, ledger_e = await _run_until_node_busy(
        cluster, "e", tmp_path, "reaper", seconds=2, config=RayCluster(reap_every_s=0.5)
    )
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


@pytest.mark.vm
async def test_qemu_group_forks_on_one_node(
    cluster: LocalCluster, tmp_path: Path, tiny_baseline: Any
) -> None:
    """Real microVMs: a group of 2 on the cluster forks from one warm parent on one node (its
    setup ran once, in the parent: both clones see its file), and the node's ledger has the
    snapshot and every env confirmed gone."""
    import cleanroom.api as cr

    warm = "/root/warm.txt"
    setup = ["sh", "-c", f"head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > {warm}"]
    episodes = [
        {
            "episode_id": f"qg-{i}",
            "seed": i,
            "policy": {"id": "p"},
            "task": {"mode": "write", "paths": [], "probe": [warm]},
        }
        for i in range(2)
    ]
    ms = cr.group("qg", {"command": setup, "timeout_s": 120}, episodes)
    result = await _qemu_run(ms, tiny_baseline, tmp_path, "qemu-group", per_node=2)
    assert result.counts() == {"completed": 2}, [e.error for e in result.episodes]
    [report] = result.groups
    assert report.mode == "fork" and report.snapshot is not None, report
    seen = {e.record["info"]["seen"][warm] for e in result.episodes if e.record}
    assert len(seen) == 1 and len(seen.pop()) == 16  # the parent's file, in both clones
    ran = []
    for name in ("a", "b"):
        with cluster.ledger(name) as ledger:
            envs = ledger.envs("qemu-group")
            if envs:
                ran.append(name)
                assert all(e.confirmed_absent_at for e in envs)
                [snap] = ledger.snapshots(run_id="qemu-group")
                assert snap.state == "absent"
    assert len(ran) == 1, f"the group ran on {ran}"


def _qemu_of(home: Path) -> list[int]:
    """Live QEMU processes started under ``home`` (its run folder is in their command line)."""
    needle = str(home).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        head = cmd.split(b"\0")[0]
        if b"qemu-system" in head and needle in cmd and hostproc.pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.mark.vm
@pytest.mark.timeout(600)
async def test_a_killed_raylet_leaves_no_vm_running_and_its_node_starts_nothing(
    cluster: LocalCluster, tmp_path: Path, tiny_baseline: Any
) -> None:
    """Issue 36 on real microVMs: a node's raylet SIGKILLed while its VMs run (an episode's
    and a spare's, jailed, each with a deadline of minutes): every QEMU of that node is gone
    within 60 s, long before its deadline, the node's ledger shows no env started after the
    kill, and the run still completes every episode elsewhere."""
    name = "vmkill"
    cluster.add(name)
    home = cluster.root / name
    limits = {"timeout_s": 300}
    ms = [manifest(f"vk{i}", seed=i, mode="sleep", seconds=20, limits=limits) for i in range(6)]
    run = asyncio.ensure_future(
        run_on_cluster(
            RayCluster(parallel_per_node=1),
            ms,
            tiny_baseline,
            store=tmp_path / "store",
            run_id="vmkill",
            driver="qemu",
            options=RunOptions(parallel=1, spares=1, cleanup_window_s=5),
        )
    )
    ledger = cluster.ledger(name)
    await _until(lambda: run.done() or len(_qemu_of(home)) >= 2, 300)  # an episode + a spare
    assert not run.done(), run.result()
    raylet = cluster.nodes[name].all_processes["raylet"][0].process
    killed_at = time.time()
    os.kill(raylet.pid, signal.SIGKILL)
    await _until(lambda: not _qemu_of(home), 60)
    result = await asyncio.wait_for(run, 400)
    assert result.counts() == {"completed": 6}, [e.error for e in result.episodes]
    late = [e.env_id for e in ledger.envs("vmkill") if e.intent_at > killed_at]
    assert not late, f"the dead node started {late}"
    assert not _qemu_of(home)
    ledger.close()
    cluster.remove(name)
