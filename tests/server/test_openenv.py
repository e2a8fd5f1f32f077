"""``cleanroom serve --openenv`` against the real ``openenv-core`` client (fake driver).

Protects issue 32's OpenEnv part: OpenEnv's ``EnvClient`` (``GenericEnvClient``, its WebSocket
session) resets, steps and reads the state of a Gym env served by cleanroom; the HTTP endpoints
answer bodies that OpenEnv's own response models accept; two sessions get separate VMs; a client
that vanishes leaves no env, and each session's episode has its durable record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

openenv_core = pytest.importorskip("openenv.core", reason="openenv-core not installed")

from openenv.core import GenericEnvClient  # noqa: E402
from openenv.core.env_server.types import (  # noqa: E402
    EnvironmentMetadata,
    HealthResponse,
    ResetResponse,
    SchemaResponse,
    State,
    StepResponse,
)
from websockets.asyncio.client import connect  # noqa: E402

from cleanroom.drivers.fake import FakeDriver  # noqa: E402
from cleanroom.ledger import Ledger  # noqa: E402
from cleanroom.store import open_store  # noqa: E402

from ..vmkit import assert_gone  # noqa: E402
from .kit import Server, new_key, stored_fake_baseline  # noqa: E402

CARTPOLE = "gymnasium.envs.classic_control.cartpole:CartPoleEnv"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("openenv")
    baseline = stored_fake_baseline(tmp)
    args = ["--driver", "fake", "--template", f"fake={baseline.digest}",
            "--openenv", f"cartpole={CARTPOLE}@fake", "--per-key", "3"]  # fmt: skip
    srv = Server(args, tmp / "serve.log")
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def base_url(server: Server, key: str) -> str:
    """What OpenEnv's client is given: the key as the URL's password (sent as Basic auth)."""
    return f"http://user:{key}@127.0.0.1:{server.port}/openenv/cartpole"


def episode_ended(run_id: str, episode_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The episode's durable record once its env is confirmed absent (ledger and host)."""
    end = time.monotonic() + timeout_s
    store = open_store(None)
    while True:
        with Ledger() as ledger:
            envs = [e for e in ledger.envs(run_id=run_id) if e.episode_id == episode_id]
        record = store.get_record(run_id, episode_id)
        if record is not None and envs and all(e.confirmed_absent_at for e in envs):
            for e in envs:
                assert_gone(FakeDriver(), e.env_id)
            return record
        if time.monotonic() > end:
            raise AssertionError(f"{run_id}/{episode_id}: not ended: {envs} {record}")
        time.sleep(0.05)


def test_the_real_client_resets_steps_and_reads_state_over_the_websocket(
    server: Server,
) -> None:
    key = new_key()
    with GenericEnvClient(base_url=base_url(server, key)).sync() as env:
        first = env.reset(seed=3)
        obs = first.observation
        assert len(obs["obs"]) == 4 and first.reward is None and first.done is False
        assert obs["episode_id"] == "ep-000001" and obs["info"]["run_id"].startswith("openenv-")
        total = 0.0
        for _ in range(3):
            result = env.step({"action": 1})
            total += result.reward or 0.0
            assert len(result.observation["obs"]) == 4
        state = env.state()
        assert state["step_count"] == 3 and state["cleanroom_episode_id"] == "ep-000001"
        State.model_validate(state)  # OpenEnv's own State model accepts it
        again = env.reset(seed=3)  # the same seed: the same start, on a fresh VM
        assert again.observation["obs"] == obs["obs"]
        assert again.observation["episode_id"] == "ep-000002"
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            env.step({"action": 7})  # not in Discrete(2): refused before the VM sees it
    first_record = episode_ended(state["run_id"], "ep-000001")
    assert first_record["outcome"] == "completed" and first_record["reward"] == total == 3.0
    assert first_record["info"]["length"] == 3
    second = episode_ended(state["run_id"], "ep-000002")
    assert second["info"]["ended"] == "close"  # the client's close ended it, said in its record


def test_http_endpoints_answer_what_openenv_models_accept(server: Server) -> None:
    key = new_key()
    url = f"{server.url}/openenv/cartpole"
    headers = {"X-API-Key": key}
    assert HealthResponse.model_validate(httpx.get(f"{url}/health").json()).status == "healthy"
    assert httpx.post(f"{url}/reset", json={}).status_code == 401  # no key
    bad = httpx.post(f"{url}/reset", json={}, headers={"Authorization": "Bearer e2b_nope"})
    assert bad.status_code == 401
    reset = httpx.post(f"{url}/reset", json={"seed": 5}, headers=headers, timeout=60)
    assert reset.status_code == 200, reset.text
    body = ResetResponse.model_validate(reset.json())
    assert len(body.observation["obs"]) == 4 and body.done is False
    step = httpx.post(f"{url}/step", json={"action": {"action": 0}}, headers=headers, timeout=60)
    assert step.status_code == 200, step.text
    assert StepResponse.model_validate(step.json()).reward == 1.0
    wrong = httpx.post(f"{url}/step", json={"action": {"action": "left"}}, headers=headers)
    assert wrong.status_code == 422 and "action" in wrong.json()["detail"]
    assert httpx.post(f"{url}/reset", json={"seed": -1}, headers=headers).status_code == 422
    State.model_validate(httpx.get(f"{url}/state", headers=headers).json())
    schema = SchemaResponse.model_validate(httpx.get(f"{url}/schema", headers=headers).json())
    assert schema.action["properties"]["action"] == {"type": "integer", "minimum": 0, "maximum": 1}
    meta = EnvironmentMetadata.model_validate(httpx.get(f"{url}/metadata", headers=headers).json())
    assert meta.name == "cartpole" and CARTPOLE in meta.description
    assert httpx.get(f"{server.url}/openenv/nope/health").status_code == 404
    # each stateless call was a one-episode run with its record, its env gone
    reset_run = body.observation["info"]["run_id"]
    assert episode_ended(reset_run, "ep-000001")["info"]["ended"] == "http"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'cleanroom_serve_openenv_sessions_total{transport="http"}' in metrics
    assert 'cleanroom_serve_openenv_refused_total{why="auth"}' in metrics


def test_two_concurrent_sessions_get_separate_vms(server: Server) -> None:
    key = new_key()

    async def both() -> list[dict[str, Any]]:
        a = GenericEnvClient(base_url=base_url(server, key))
        b = GenericEnvClient(base_url=base_url(server, key))
        async with a, b:
            await asyncio.gather(a.reset(seed=1), b.reset(seed=2))
            return list(await asyncio.gather(a.state(), b.state()))

    states = asyncio.run(both())
    runs = {s["run_id"] for s in states}
    assert len(runs) == 2
    with Ledger() as ledger:
        envs = [e.env_id for run in runs for e in ledger.envs(run_id=run)]
    assert len(envs) == len(set(envs)) == 2
    for run in runs:
        episode_ended(run, "ep-000001")


def test_a_client_that_vanishes_leaves_no_env(server: Server) -> None:
    key = new_key()
    ws_url = base_url(server, key).replace("http://", "ws://") + "/ws"

    async def vanish() -> dict[str, Any]:
        ws = await connect(ws_url)
        await ws.send('{"type": "reset", "data": {"seed": 4}}')
        await ws.recv()
        await ws.send('{"type": "state"}')
        import json

        state: dict[str, Any] = json.loads(await ws.recv())["data"]
        ws.transport.abort()  # no close message, no closing handshake: the client is gone
        return state

    state = asyncio.run(vanish())
    record = episode_ended(state["run_id"], state["cleanroom_episode_id"])
    assert record["info"]["ended"] == "disconnect"
    assert (
        'cleanroom_serve_openenv_ended_total{why="disconnect"}'
        in httpx.get(f"{server.url}/metrics").text
    )


def test_a_websocket_without_a_key_is_refused_at_the_handshake(server: Server) -> None:
    url = f"http://127.0.0.1:{server.port}/openenv/cartpole"
    with pytest.raises(ConnectionError, match="401"), GenericEnvClient(base_url=url).sync() as env:
        env.reset()


def test_sigterm_ends_a_live_session_with_its_record(tmp_path: Any) -> None:
    """Protects: the server's shutdown ends a live OpenEnv session's episode (``info.ended`` is
    ``shutdown``) with its durable record, its env confirmed absent, before the server exits 0;
    the client is told (a SESSION_ERROR, then the socket closes)."""
    baseline = stored_fake_baseline(tmp_path)
    args = ["--driver", "fake", "--template", f"b={baseline.digest}",
            "--openenv", f"cp={CARTPOLE}@b"]  # fmt: skip
    srv = Server(args, tmp_path / "log")
    key = new_key()
    url = f"ws://user:{key}@127.0.0.1:{srv.port}/openenv/cp/ws"

    async def live_then_stopped() -> tuple[dict[str, Any], str]:
        import json

        async with connect(url) as ws:
            await ws.send('{"type": "reset", "data": {}}')
            await ws.recv()
            await ws.send('{"type": "state"}')
            state: dict[str, Any] = json.loads(await ws.recv())["data"]
            assert await asyncio.to_thread(srv.stop) == 0, srv.log.read_text()
            last = str(await ws.recv())
            return state, last

    try:
        state, last = asyncio.run(live_then_stopped())
    finally:
        srv.stop()
    assert "SESSION_ERROR" in last
    record = episode_ended(state["run_id"], state["cleanroom_episode_id"], timeout_s=5)
    assert record["info"]["ended"] == "shutdown"


def test_the_example_plays_through_openenvs_client(server: Server) -> None:
    """examples/openenv/play.py, unchanged, against the served env: two episodes, each ending
    in its record."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "openenv" / "play.py"
    env = {**os.environ, "OPENENV_URL": base_url(server, new_key())}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["seed 1", "seed 2"]
    run, episode = lines[1].rsplit(" ", 1)[1].split("/")
    assert episode_ended(run, episode)["outcome"] == "completed"
