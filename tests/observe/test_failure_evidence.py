"""An infra error's evidence, without a VM: what an attempt that never ran keeps, the summary
hint that names it, and ``cleanroom inspect`` of an episode with no durable record (issue 30).

Protects: a guest that did not boot ended ``infra_error: launch failed: agent channel closed``
with nothing kept (the console tail only inside the error text), the hint named a
``stderr.log`` that did not exist, and ``cleanroom inspect`` said only "no durable record".
Now the launch's console is the attempt's ``logs/console.log``, the hint names only a file
the store holds (stderr, else console, else traceback, else ``attempt.json``, else none), and
inspect shows each attempt's summary. The real boot failure: ``test_bare_images_vm``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Env, EnvRequest
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import LaunchError
from cleanroom.ledger import Ledger
from cleanroom.observe.failures import Failure, attempts_kept, failures, report_lines
from cleanroom.store import LocalStore

from ..batch.test_controller import manifest
from ..conftest import make_fake_baseline
from ..test_cli import cli
from ..vmkit import assert_nothing_left

CONSOLE = b"[    1.5] Kernel panic - not syncing: Attempted to kill init! (a test)\r\n"


class NoBoot(FakeDriver):
    """A driver whose every env fails to start as a VM that panics does: a ``LaunchError``
    carrying the console (``console=None``: as the fake's own, which has no console)."""

    def __init__(self, run_root: Path, console: bytes | None) -> None:
        super().__init__(run_root=run_root)
        self.console = console

    async def create(self, request: EnvRequest) -> Env:
        raise LaunchError("agent channel closed; console:\n(tail)", self.console)


def _run(tmp: Path, console: bytes | None) -> tuple[Ledger, LocalStore]:
    ledger, store = Ledger(tmp / "ledger.db"), LocalStore(tmp / "store")
    driver = NoBoot(tmp / "run", console)
    options = RunOptions(parallel=1, cleanup_window_s=5, staging_dir=tmp / "staging")
    ctl = Controller(driver, ledger, store, options=options)
    result = asyncio.run(ctl.run([manifest("ep")], make_fake_baseline(tmp), run_id="r"))
    assert [e.outcome for e in result.episodes] == [Outcome.INFRA_ERROR]
    assert (result.episodes[0].error or "").startswith("launch failed: agent channel closed")
    assert_nothing_left(driver, ledger, "r")
    return ledger, store


def _path(uri: str) -> Path:
    return Path(unquote(urlparse(uri).path))


def _hinted(lines: list[str]) -> Path | None:
    """The file the summary's hint names (None: it names none)."""
    [hint] = [line for line in lines if line.startswith("hint:")]
    return _path(hint.rsplit(": ", 1)[1]) if " or its " in hint else None


def test_a_failed_launch_keeps_its_console_and_the_hint_and_inspect_name_it(
    tmp_path: Path,
) -> None:
    ledger, store = _run(tmp_path, CONSOLE)
    kept = store.get_bytes("r", "ep", "attempts/1/logs/console.log")
    assert kept == CONSOLE
    [failure] = failures("r", ledger, store)
    assert failure.log == "attempts/1/logs/console.log" and failure.stderr is None
    lines = report_lines("r", [failure], 1, store.run_uri("r"))
    assert "or its console.log: " in lines[-1]
    hinted = _hinted(lines)
    assert hinted is not None and hinted.read_bytes() == CONSOLE

    [attempt] = attempts_kept(store, ledger, "r", "ep")
    assert attempt["outcome"] == "infra_error" and attempt["attempt"] == 1
    assert [log["name"] for log in attempt["logs"]] == ["console.log"]
    assert _path(attempt["evidence"]) == hinted.parents[1]
    ledger.close()

    shown = cli(tmp_path, "inspect", "ep", "--run-id", "r", "--store", str(tmp_path / "store"))
    assert shown.returncode == 2 and "no durable record" in shown.stderr
    inspected = json.loads(shown.stdout)
    assert inspected["record"] is None and inspected["attempts"] == [attempt]


def test_without_a_console_the_hint_names_the_attempts_summary(tmp_path: Path) -> None:
    ledger, store = _run(tmp_path, None)
    assert store.get_bytes("r", "ep", "attempts/1/logs/console.log") is None
    [failure] = failures("r", ledger, store)
    assert failure.log == "attempts/1/attempt.json"
    hinted = _hinted(report_lines("r", [failure], 1, store.run_uri("r")))
    assert hinted is not None and json.loads(hinted.read_text())["outcome"] == "infra_error"
    ledger.close()


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ({"logs/stderr.log": b"boom\n", "logs/console.log": b"c"}, "logs/stderr.log"),
        ({"logs/traceback.txt": b"Traceback", "attempt.json": b"{}"}, "logs/traceback.txt"),
        ({"logs/console.log": b"", "logs/traceback.txt": b"T"}, "logs/console.log"),
        ({}, None),
    ],
)
def test_the_hint_names_only_a_file_the_store_holds(
    tmp_path: Path, files: dict[str, bytes], named: str | None
) -> None:
    store = LocalStore(tmp_path / "store")
    with Ledger(tmp_path / "ledger.db") as ledger:
        ledger.start_run(
            "r", controller_id="c", baseline="sha256:x", driver="fake", parallel=1, meta={}
        )
        ledger.episode_queued("r", "ep", 1)
        ledger.episode_finished("r", "ep", 1, outcome="infra_error", error="launch failed")
        for rel, data in files.items():
            store.put_bytes("r", "ep", f"attempts/1/{rel}", data)
        [failure] = failures("r", ledger, store)
        kept: list[dict[str, Any]] = attempts_kept(store, ledger, "r", "ep")
    expected = f"attempts/1/{named}" if named else None
    assert failure.log == expected
    hinted = _hinted(report_lines("r", [failure], 1, store.run_uri("r")))
    assert (hinted is None) == (named is None)
    assert hinted is None or hinted.is_file()
    if not files:  # nothing kept: inspect still shows what the ledger knows
        assert kept[0]["outcome"] == "infra_error" and kept[0]["logs"] == []


def test_a_failure_that_names_no_file_still_points_at_inspect() -> None:
    failure = Failure("ep", 1, "infra_error", "launch failed", None, None)
    [*_, hint] = report_lines("r", [failure], 1, "file:///store/runs/r")
    assert hint.endswith("`cleanroom inspect ep --run-id r`")
