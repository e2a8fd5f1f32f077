"""The warm Python worker without a VM: real worker processes on the host, driven by the
agent's ``warm.run`` as a RUN would drive them (the entry module is the warm baseline's)."""

from __future__ import annotations

import json
import os
import random
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.agent import guest, warm, worker
from cleanroom.agent.protocol import Kind

ENTRY_DIR = Path(__file__).resolve().parents[1] / "baselines" / "warm" / "files"
CONFIG = {"function": "entry:run", "preimport": ["json", "random"], "path": [str(ENTRY_DIR)]}


class Agent:
    """What ``warm.run`` needs of the agent: ``warm`` and ``send``."""

    def __init__(self) -> None:
        self.warm: warm.Worker | None = None
        self.frames: list[tuple[int, dict[str, Any], bytes]] = []

    def send(self, kind: int, header: dict[str, Any] | None = None, body: bytes = b"") -> None:
        self.frames.append((kind, header or {}, body))

    def output(self, kind: int) -> str:
        return b"".join(body for k, _, body in self.frames if k == kind).decode()


class Episode:
    """A guest root folder and an agent; ``run`` writes the manifest and runs one episode."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.agent = Agent()

    def run(
        self,
        config: dict[str, Any] = CONFIG,
        seed: bytes = b"",
        timeout_s: float = 30,
        **task: Any,
    ) -> dict[str, Any]:
        (self.root / "out").mkdir(parents=True, exist_ok=True)
        (self.root / "result.json").unlink(missing_ok=True)
        manifest = {"episode_id": "ep-1", "seed": 6, "task": task}
        (self.root / "manifest.json").write_text(json.dumps(manifest))
        env = {**guest.BASE_ENV, "CLEANROOM_DIR": str(self.root), "MY_SECRET": "hunter2"}
        header = {"function": config, "timeout_s": timeout_s, "cwd": str(self.root)}
        self.agent.frames.clear()
        return warm.run(self.agent, header, env, seed or os.urandom(32))

    def result(self) -> dict[str, Any] | None:
        path = self.root / "result.json"
        return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture
def episode(tmp_path: Path) -> Iterator[Episode]:
    ep = Episode(tmp_path / "run" / "cleanroom")
    yield ep
    if ep.agent.warm is not None:
        ep.agent.warm.stop()


def test_a_function_runs_in_a_fork_of_the_worker_that_imported_it(episode: Episode) -> None:
    first = episode.run()
    assert first["code"] == 0 and not first["timed_out"], episode.agent.output(Kind.STDERR)
    assert first["entry"] == "function" and first["worker"] == "started"
    assert "warm: stdout ep-1 seed=6" in episode.agent.output(Kind.STDOUT)
    assert "warm: stderr ep-1" in episode.agent.output(Kind.STDERR)
    result = episode.result()
    assert result is not None and result["reward"] == 3.0
    info = result["info"]
    assert episode.agent.warm is not None
    worker_pid = episode.agent.warm.proc.pid
    assert info["imported_in"] == worker_pid == info["ppid"] != info["pid"]
    assert info["pgid"] == info["pid"]  # its own process group: a timeout kills all of it
    assert info["cwd"] == str(episode.root) and info["stdin"] == ""
    assert info["env"] == sorted([*guest.BASE_ENV, "CLEANROOM_DIR", "MY_SECRET"])
    assert (episode.root / "out" / "hello.txt").read_text() == "hello from ep-1\n"

    second = episode.run()
    assert second["code"] == 0 and second["worker"] == "warm"
    again = episode.result()
    assert again is not None and again["info"]["imported_in"] == worker_pid
    assert again["info"]["pid"] != info["pid"]  # a new child; the worker never runs episodes


def test_a_child_waits_ahead_and_none_is_forked_after_an_episode(episode: Episode) -> None:
    worker = episode.agent.warm = warm.start(CONFIG, warm.env_for_worker(dict(guest.BASE_ENV)))
    assert worker.wait_ready(30), worker.error
    ahead = _children_soon(worker.proc.pid, 1)
    assert len(ahead) == 1  # forked before any job: a template saves it with the worker
    assert episode.run()["code"] == 0 and episode.agent.warm is worker
    result = episode.result()
    assert result is not None and result["info"]["pid"] == ahead[0]
    time.sleep(0.3)
    assert _children(worker.proc.pid) == []  # a VM runs one episode: no CPU spent on a next
    assert episode.run()["code"] == 0 and episode.agent.warm is worker  # asked for: forked
    again = episode.result()
    assert again is not None and again["info"]["pid"] not in (ahead[0], worker.proc.pid)


def _children_soon(pid: int, n: int, within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while len(found := _children(pid)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()]


@pytest.mark.parametrize(
    ("task", "code", "stderr"),
    [
        ({"mode": "raise"}, 1, "ValueError: boom in ep-1"),
        ({"mode": "nondict"}, 1, "entry:run returned list, not a dict"),
        ({"mode": "unjson"}, 1, "is not JSON serializable"),
        ({"mode": "exit", "code": 7}, 7, ""),
    ],
)
def test_a_failing_function_exits_non_zero_without_a_result(
    episode: Episode, task: dict[str, Any], code: int, stderr: str
) -> None:
    exit_header = episode.run(**task)
    assert exit_header["code"] == code and exit_header["signal"] is None
    assert stderr in episode.agent.output(Kind.STDERR)
    if code == 1:
        assert "Traceback (most recent call last)" in episode.agent.output(Kind.STDERR)
    assert episode.result() is None
    assert episode.run()["code"] == 0  # the worker serves the next episode all the same


def test_a_timeout_kills_the_functions_whole_process_group(episode: Episode) -> None:
    started = time.monotonic()
    exit_header = episode.run(timeout_s=1.5, mode="sleep")
    assert time.monotonic() - started < 10
    assert exit_header["timed_out"] is True and exit_header["signal"] == 9
    grandchild = int((episode.root / "grandchild.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(grandchild)
    assert episode.run()["code"] == 0  # the worker itself was not killed


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_child_reseeds_random_from_the_seed_it_is_given(episode: Episode) -> None:
    draws = []
    for seed in (b"a" * 32, b"a" * 32, b"b" * 32):
        assert episode.run(seed=seed)["code"] == 0
        result = episode.result()
        assert result is not None
        draws.append(result["info"]["random"])
    assert draws[0] == draws[1] != draws[2]  # not fork's own reseed (that one is random)
    expected = random.Random(b"a" * 32).random()
    assert draws[0] == expected


def test_reseed_covers_numpys_global_generator_when_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seeds: list[Any] = []
    fake = types.ModuleType("numpy.random")
    fake.seed = seeds.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "numpy.random", fake)
    state = random.getstate()
    try:
        worker.reseed(bytes(range(32)))
        assert random.random() == random.Random(bytes(range(32))).random()
    finally:
        random.setstate(state)
    assert seeds == [[int.from_bytes(bytes(range(i, i + 4)), "little") for i in range(0, 32, 4)]]


def test_a_worker_whose_imports_fail_fails_the_episode_with_the_traceback(
    episode: Episode,
) -> None:
    config = {**CONFIG, "preimport": ["json", "no_such_module_here"]}
    exit_header = episode.run(config=config)
    assert exit_header["code"] == 1 and exit_header["worker"] == "started"
    stderr = episode.agent.output(Kind.STDERR)
    assert "warm Python worker did not start" in stderr
    assert "No module named 'no_such_module_here'" in stderr
    assert episode.result() is None
    assert episode.agent.warm is not None and episode.agent.warm.proc.poll() is not None


def test_a_different_config_gets_a_new_worker(episode: Episode) -> None:
    assert episode.run()["code"] == 0
    first = episode.agent.warm
    assert first is not None
    assert episode.run(config={**CONFIG, "preimport": ["json"]})["worker"] == "started"
    assert first.proc.poll() is not None  # the old one was stopped
    assert episode.agent.warm is not first


def test_boot_config_reads_entry_json_and_ignores_anything_else(tmp_path: Path) -> None:
    path = tmp_path / "entry.json"
    assert warm.boot_config(str(path)) is None
    path.write_text(json.dumps(CONFIG))
    assert warm.boot_config(str(path)) == CONFIG
    path.write_text('{"function": ""}')
    assert warm.boot_config(str(path)) is None
    path.write_text("not json")
    assert warm.boot_config(str(path)) is None


def test_hello_reports_the_workers_state(tmp_path: Path) -> None:
    sent: list[tuple[int, dict[str, Any]]] = []
    agent = guest.Agent(None)
    agent.send = lambda kind, header=None, body=b"": sent.append((kind, header or {}))  # type: ignore[method-assign]
    agent.warm = warm.start(CONFIG, dict(guest.BASE_ENV))
    try:
        assert agent.warm.wait_ready(30)
        agent.hello()
    finally:
        agent.warm.stop()
    [(kind, header)] = sent
    assert kind == Kind.HELLO
    assert header["warm"]["ready"] is True and header["warm"]["pid"] == agent.warm.proc.pid
