"""The static C canary (``canary.c``) for guests without Python: the same check as canary.py.

Protects: ``cleanroom check isolation`` on a busybox-only or distroless baseline (its canary
needed python3). On the host, with a ``--prefix``, the C canary plants and reports the same
rows with the same evidence as ``canary.py`` and its JSON crosses the host's boundary; run by
the whole check on the fake driver, it gives the Python canary's verdicts, failures included
(one boot id, the reusing driver's shared files). The VM run is in
``tests/checks/isolation/test_isolation_vm.py``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cleanroom.agent import wire
from cleanroom.checks.isolation import CLEANUP, IsolationCheck, plant
from cleanroom.checks.isolation import canary as guest
from cleanroom.checks.isolation.audit import token_processes
from cleanroom.checks.isolation.native_canary import canary_binary
from cleanroom.drivers.fake import FakeDriver
from cleanroom.ledger import Ledger

from ...conftest import make_fake_baseline
from .reusing_driver import ReusingDriver


def _run(argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run(argv, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = wire.decode_json(proc.stdout, wire.JsonLimits(len(proc.stdout)), "canary")
    assert isinstance(data, dict)
    return data


def _relative(report: dict[str, Any], prefix: Path, token: str) -> dict[str, Any]:
    text = json.dumps(report).replace(str(prefix), "PREFIX").replace(token, "TOKEN")
    return dict(json.loads(text))


@pytest.fixture
def tokens() -> list[str]:
    made: list[str] = []
    yield made
    for pid in token_processes(made):  # the lingering canaries of both kinds
        os.kill(pid, signal.SIGKILL)


def test_the_c_canary_reports_what_the_python_one_does(tmp_path: Path, tokens: list[str]) -> None:
    reports = {}
    for kind in ("python", "native"):
        token = plant.new_token()
        tokens.append(token)
        prefix = tmp_path / kind
        prefix.mkdir()
        argv = [sys.executable, guest.__file__] if kind == "python" else [str(canary_binary())]
        tail = ["--token", token, "--prefix", str(prefix)]
        planted = _run([*argv, "plant", *tail])
        own = _run([*argv, "probe", *tail])
        fresh = tmp_path / f"{kind}-fresh"
        fresh.mkdir()
        other = _run([*argv, "probe", "--token", token, "--prefix", str(fresh)])
        reports[kind] = {
            "planted": _relative(planted["planted"], prefix, token),
            "skipped": sorted(planted["skipped"]),
            "observed": sorted(planted["observed"]),
            "own": sorted(own["seen"]),
            "other": sorted(other["seen"]),
        }
        assert (prefix / token).read_text() == token
        assert f"127.0.0.9 {token}\n" in (prefix / "etc" / "hosts").read_text()
    python, native = reports["python"], reports["native"]
    process = native["planted"].pop(guest.PROCESS)
    assert process.startswith("pids [") and python["planted"].pop(guest.PROCESS)
    assert native == python
    hostname = "sysctl:kernel.hostname"  # swappiness is compared by value, not "seen"
    assert set(native["own"]) == {*guest.FILES, *guest.APPENDS, hostname, guest.PROCESS}
    assert native["other"] == [guest.PROCESS]  # a host process: nothing isolates it here


def test_the_c_canary_refuses_bad_arguments() -> None:
    binary = str(canary_binary())
    for argv in ([binary], [binary, "dig", "--token", "t"], [binary, "plant", "--tok", "t"]):
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 2


async def _check(tmp_path: Path, driver: Any, **kwargs: Any) -> dict[str, dict[str, str]]:
    baseline = make_fake_baseline(tmp_path)
    with Ledger(tmp_path / "ledger.db") as ledger:
        report = await IsolationCheck(driver, baseline, ledger, **kwargs).run()
    assert not token_processes([v.token for v in report.variants])
    for v in report.variants:
        assert v.error is None, v.error
    return {v.name: {n: c.status for n, c in v.cells.items()} for v in report.variants}


async def test_the_check_with_the_c_canary_gives_the_same_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake driver: files and sysctls PASS, one boot id FAILs; the reusing driver: every
    file FAILs. Exactly what the Python canary finds (tests/checks/isolation/test_isolation.py)."""
    monkeypatch.setattr(plant, "canary_kind", lambda env: "native")
    driver = FakeDriver(run_root=tmp_path / "run")
    fake = await _check(tmp_path / "a", driver, variants=("sequential",))
    cells = fake["sequential"]
    for name in (*guest.FILES, *guest.APPENDS, *guest.SYSCTLS, guest.RANDOM, CLEANUP):
        assert cells[name] == "PASS", (name, cells)
    assert cells[guest.PROCESS] == "PASS" and cells[guest.BOOT_ID] == "FAIL"
    assert cells[guest.LOGIN] == "SKIP"
    factory = functools.partial(ReusingDriver, run_root=tmp_path / "shared")
    reusing = await _check(
        tmp_path / "b", factory(), driver_factory=factory, variants=("sequential", "concurrent")
    )
    for variant, cells in reusing.items():
        for name in (*guest.FILES, *guest.APPENDS, *guest.SYSCTLS, guest.BOOT_ID):
            assert cells[name] == "FAIL", (variant, name, cells)
