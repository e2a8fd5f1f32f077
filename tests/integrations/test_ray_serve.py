"""``cleanroom serve --ray`` on a real local Ray cluster (``ray.cluster_utils.Cluster``, the same
set-up as ``test_ray_cluster``: a head with no CPUs, nodes each with their own
``CLEANROOM_HOME``) with the fake driver, driven by the real ``e2b`` SDK: sandboxes spread over
the nodes, every call routed to the node holding the sandbox, each one a session on its node
(env confirmed absent there after kill), and a node's raylet SIGKILLed: its sandbox ends
``env_crashed`` in the head's ledger while the other nodes' sandboxes keep serving."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.ledger import Ledger

from ..server.kit import Server, free_port, new_key, stored_fake_baseline, via_host
from ..server.test_ports import HERE, _through_the_proxy, serving
from ..waiting import until_sync
from .test_ray_cluster import LocalCluster

e2b = pytest.importorskip("e2b")
ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("serve-nodes"), "")
    try:
        local.add("a")
        local.add("b")
        yield local
    finally:
        local.cluster.shutdown()


@pytest.fixture
def serve(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Server]]:
    """``serve --ray`` on the cluster (started when called, after the test added its nodes;
    the fake driver unless given another and its baseline), the SDK pointed at it; stopped
    (every sandbox ended) at the test's end."""
    started: list[Server] = []

    def start(driver: str = "fake", baseline: Baseline | None = None) -> Server:
        baseline = baseline or stored_fake_baseline(tmp_path)
        args = ["--driver", driver, "--template", f"{driver}={baseline.digest}",
                "--ray", cluster.cluster.address]  # fmt: skip
        srv = Server(args, tmp_path / "serve.log", ready_s=120)
        started.append(srv)
        for name, value in srv.sdk_env(new_key()).items():
            monkeypatch.setenv(name, value)
        return srv

    yield start
    for srv in started:
        assert srv.stop() == 0, srv.log.read_text()


def _head(sid: str) -> tuple[str, str | None, str | None]:
    """Where the head placed the sandbox, and its outcome and error in the head's ledger."""
    with Ledger() as ledger:
        routed = ledger.events(f"ray-serve-{sid}", "sandbox_routed")
        assert routed, sid
        rows = ledger.episodes(f"ray-serve-{sid}")
        return routed[-1].data["node"], rows[0].outcome, rows[0].error


def _node_envs(cluster: LocalCluster, node_id: str, sid: str) -> list[Any]:
    home = cluster.homes[node_id]
    with Ledger(home / "ledger.db") as ledger:
        return ledger.envs(run_id=f"serve-{sid}")


def test_sdk_sandboxes_spread_over_two_nodes_each_a_session_there(
    cluster: LocalCluster, serve: Callable[..., Server], tmp_path: Path
) -> None:
    """Protects: create through the SDK places sandboxes on both nodes; commands (output, exit
    code, envs), file write and read are served by the node holding the sandbox; ``ps --ray``
    lists their envs on their nodes; kill ends each as a session there (``completed``, env
    confirmed absent in that node's ledger) and in the head's ledger."""
    from cleanroom.integrations.ray import RayCluster
    from cleanroom.integrations.ray.ps import cluster_envs

    serve()
    boxes = [e2b.Sandbox.create("fake", envs={"WHO": f"box{i}"}) for i in range(4)]
    nodes = {b.sandbox_id: _head(b.sandbox_id)[0] for b in boxes}
    assert len(set(nodes.values())) == 2, nodes
    for i, box in enumerate(boxes):
        r = box.commands.run("echo $WHO; echo err >&2")
        assert (r.exit_code, r.stdout, r.stderr) == (0, f"box{i}\n", "err\n")
        with pytest.raises(e2b.CommandExitException) as failed:
            box.commands.run("exit 3")
        assert failed.value.exit_code == 3
        path = str(tmp_path / f"f{i}.txt")
        box.files.write(path, f"hello {i}")
        assert box.files.read(path) == f"hello {i}"
        assert box.files.exists(path)  # a filesystem call: its command path, on the node
        envs = _node_envs(cluster, nodes[box.sandbox_id], box.sandbox_id)
        assert envs and envs[0].ready_at and not envs[0].destroyed_at, envs

    ray.init(address=cluster.cluster.address, log_to_driver=False)
    try:
        answers = {n.node: n for n in cluster_envs(RayCluster(), "fake")}
    finally:
        ray.shutdown()
    for box in boxes:
        node = nodes[box.sandbox_id]
        env_ids = {e.env_id for e in _node_envs(cluster, node, box.sandbox_id)}
        assert env_ids <= {e.env_id for e in answers[node].envs}, (env_ids, answers[node])

    for box in boxes:
        box.kill()  # returns once the session ended on its node
        node, outcome, _ = _head(box.sandbox_id)
        assert outcome == "completed"
        envs = _node_envs(cluster, node, box.sandbox_id)
        assert envs and all(e.confirmed_absent_at for e in envs), envs
        with Ledger(cluster.homes[node] / "ledger.db") as ledger:
            rows = ledger.episodes(f"serve-{box.sandbox_id}")
        assert rows[0].outcome == "completed", rows
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.connect(boxes[0].sandbox_id)


def test_get_host_is_proxied_by_the_node_holding_the_sandbox(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    """Protects: ``get_host(port)`` under ``--ray``: HTTP to servers in the sandbox (a 1 MiB
    file down, a 1.4 MB body up, path, query and headers kept, tokens never passed on, bytes
    counted) goes through the port stream its node holds; a closed port is a clean 502."""
    server = serve()
    sbx = e2b.Sandbox.create("fake")
    blob = bytes(range(256)) * 4096
    (tmp_path / "blob.bin").write_bytes(blob)
    shutil.copy(HERE / "httpecho.py", tmp_path / "httpecho.py")
    with (
        serving([sys.executable, "-m", "http.server", "--bind", "127.0.0.1"], tmp_path) as files,
        serving([sys.executable, "httpecho.py"], tmp_path) as echo,
    ):
        _through_the_proxy(server, sbx, files, echo, blob)
    auth = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
    closed = via_host(server, sbx.get_host(free_port()), headers=auth)
    assert closed.status_code == 502 and closed.json()["code"] == 502, closed.text
    sbx.kill()


def test_a_timeout_ends_the_sandbox_on_its_node_and_the_head_learns_it(
    serve: Callable[..., Server],
) -> None:
    """Protects: E2B's timeout under ``--ray`` is the node's session clock, moved by
    ``set_timeout`` through the head: the sandbox ends ``timeout`` there and in the head's
    ledger, and the SDK finds it gone."""
    serve()
    sbx = e2b.Sandbox.create("fake", timeout=300)
    sbx.set_timeout(2)
    _, outcome, _ = until_sync(
        lambda: _head(sbx.sandbox_id)[1] and _head(sbx.sandbox_id), "its end in the head", 60
    )
    assert outcome == "timeout"
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.connect(sbx.sandbox_id)


def test_a_killed_raylet_ends_its_sandboxes_env_crashed_and_the_rest_serve_on(
    cluster: LocalCluster, serve: Callable[..., Server]
) -> None:
    """Protects: a node's raylet SIGKILLed under a served sandbox ends it ``env_crashed`` in
    the head's ledger (naming the node), its env process dies with the node, the SDK finds it
    gone, and the sandboxes on the other nodes keep running commands; new sandboxes go to the
    nodes left."""
    cluster.add("c")
    node_c = cluster.nodes["c"].node_id
    serve()
    boxes = [e2b.Sandbox.create("fake") for _ in range(3)]
    nodes = {b.sandbox_id: _head(b.sandbox_id)[0] for b in boxes}
    assert node_c in nodes.values() and len(set(nodes.values())) == 3, nodes
    doomed = next(b for b in boxes if nodes[b.sandbox_id] == node_c)
    pids = [e.pid for e in _node_envs(cluster, node_c, doomed.sandbox_id) if e.pid]
    assert pids
    raylet = cluster.nodes["c"].all_processes["raylet"][0].process
    os.kill(raylet.pid, signal.SIGKILL)

    _, outcome, error = until_sync(
        lambda: _head(doomed.sandbox_id)[1] and _head(doomed.sandbox_id), "env_crashed", 60
    )
    assert outcome == "env_crashed" and node_c in (error or ""), (outcome, error)
    until_sync(lambda: not any(_alive(p) for p in pids), "the dead node's env process gone", 30)
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.connect(doomed.sandbox_id)
    for box in boxes:
        if box is not doomed:
            assert box.commands.run("echo still").stdout == "still\n"
    fresh = e2b.Sandbox.create("fake")
    assert _head(fresh.sandbox_id)[0] != node_c
    assert fresh.commands.run("true").exit_code == 0
    for box in [*boxes, fresh]:
        if box is not doomed:
            box.kill()
    cluster.remove("c")


@pytest.mark.vm
@pytest.mark.timeout(600)  # two TCG boots on a loaded 2-core host: 3 minutes seen
def test_qemu_sandboxes_on_two_nodes(
    cluster: LocalCluster, serve: Callable[..., Server], tiny_baseline: Baseline
) -> None:
    """Protects, on real microVMs: the SDK's sandboxes through ``serve --ray`` land one on each
    node, run commands in their guests (their own kernel) and move files there; kill ends each
    ``completed`` with its VM confirmed absent in its node's ledger and no qemu left of it."""
    serve("qemu", tiny_baseline)
    boxes = [e2b.Sandbox.create("qemu", timeout=600) for _ in range(2)]
    nodes = {b.sandbox_id: _head(b.sandbox_id)[0] for b in boxes}
    assert len(set(nodes.values())) == 2, nodes
    for i, box in enumerate(boxes):
        r = box.commands.run(f"python3 -c 'print(6*{i})'; uname -r")
        assert r.stdout.splitlines()[0] == str(6 * i), r.stdout
        box.files.write("/srv/in.txt", f"in vm {i}")
        assert box.files.read("/srv/in.txt") == f"in vm {i}"
    for box in boxes:
        pids = [e.pid for e in _node_envs(cluster, nodes[box.sandbox_id], box.sandbox_id)]
        box.kill()
        assert _head(box.sandbox_id)[1] == "completed"
        envs = _node_envs(cluster, nodes[box.sandbox_id], box.sandbox_id)
        assert envs and all(e.confirmed_absent_at for e in envs), envs
        assert not any(p and _alive(p) for p in pids), pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))
