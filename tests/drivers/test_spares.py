"""The qemu driver's spare bookkeeping without VMs: which spare fits a request, which id is
handed out, what is topped up and what ``release`` destroys (the real-VM side:
tests/drivers/qemu/test_spares.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers.base import DestroyReport, EnvRequest, Owner
from cleanroom.drivers.qemu.config import QemuConfig
from cleanroom.drivers.qemu.context import QemuContext
from cleanroom.drivers.qemu.spares import MAX_AGE_S, Spare, Spares

BASELINE: Any = SimpleNamespace(digest="sha256:base")
LIMITS = ResolvedLimits()
TEMPLATE: Any = SimpleNamespace(digest="sha256:template")


class Driver:
    """What ``Spares`` uses of its context: ``destroy`` (it records what was destroyed)."""

    def __init__(self) -> None:
        self.destroyed: list[str] = []

    async def destroy(self, env_id: str) -> DestroyReport:
        self.destroyed.append(env_id)
        return DestroyReport(env_id, True, 1, 0.1)


def spares_of(driver: Driver) -> Spares:
    """``Spares`` over a context whose only live part is ``driver.destroy`` (no VM)."""
    config = QemuConfig(boot_timeout_s=1, restore_timeout_s=1, start="snapshot", run_root=Path())
    ctx = QemuContext(config, {}, None, driver.destroy)  # type: ignore[arg-type]
    return Spares(ctx, None, None)  # type: ignore[arg-type]


def spare(env_id: str, *, age_s: float = 1.0, exited: int | None = None) -> Spare:
    now = time.monotonic()
    live: Any = SimpleNamespace(proc=SimpleNamespace(returncode=exited))
    monitor: Any = (None, SimpleNamespace(close=lambda: None))
    started = now - age_s
    session: Any = None  # run ahead: its agent said HELLO (never used here)
    shape = (BASELINE.digest, LIMITS)
    return Spare(env_id, shape, TEMPLATE, live, monitor, session, "none", started, now + 500)


def request(env_id: str = "env-x", **changes: Any) -> EnvRequest:
    fields: dict[str, Any] = {
        "env_id": env_id,
        "baseline": BASELINE,
        "limits": LIMITS,
        "owner": Owner("unit"),
        "hard_deadline_s": 100.0,
        **changes,
    }
    return EnvRequest(**fields)


def test_a_fresh_spare_of_the_same_shape_and_template_fits() -> None:
    assert spare("env-a").fits(request(), TEMPLATE, time.monotonic()) is None


@pytest.mark.parametrize(
    ("made", "asked", "template", "why"),
    [
        ({"exited": -9}, {}, TEMPLATE, "its QEMU exited (-9)"),
        ({}, {}, SimpleNamespace(digest="sha256:rebuilt"), "its template was replaced"),
        ({}, {"limits": ResolvedLimits(memory_mib=512)}, TEMPLATE, "another shape"),
        ({}, {"network": object()}, TEMPLATE, "another shape"),
        ({"age_s": MAX_AGE_S + 1}, {}, TEMPLATE, "older than"),
        ({}, {"hard_deadline_s": 1000.0}, TEMPLATE, "hard deadline is too close"),
    ],
)
def test_a_spare_that_does_not_fit_says_why(
    made: dict[str, Any], asked: dict[str, Any], template: Any, why: str
) -> None:
    reason = spare("env-a", **made).fits(request(**asked), template, time.monotonic())
    assert reason is not None and why in reason


async def test_take_id_hands_out_the_oldest_live_spare_and_destroys_stale_ones() -> None:
    driver = Driver()
    spares = spares_of(driver)
    shape = (BASELINE.digest, LIMITS)
    spares.ready[shape] = [
        spare("env-old", age_s=MAX_AGE_S + 5),
        spare("env-dead", exited=-9),
        spare("env-good", age_s=3),
        spare("env-young", age_s=1),
    ]
    assert spares.take_id(BASELINE, LIMITS) == "env-good"
    assert spares.claim("env-good") is not None and spares.claim("env-good") is None
    await asyncio.gather(*spares.chores)
    assert sorted(driver.destroyed) == ["env-dead", "env-old"]
    assert [s.env_id for s in spares.ready[shape]] == ["env-young"]
    assert spares.take_id(BASELINE, ResolvedLimits(vcpus=2)) is None  # no spare of that shape
    assert spares.wanted == {shape, (BASELINE.digest, ResolvedLimits(vcpus=2))}


async def test_top_up_starts_only_what_is_missing_of_a_shape_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[EnvRequest] = []

    async def start(self: Spares, req: EnvRequest, accel: Any, shape: Any) -> None:
        started.append(req)
        self.starting.pop(req.env_id, None)

    monkeypatch.setattr(Spares, "_start", start)
    spares = spares_of(Driver())
    spares.target = 3
    spares.top_up(request(), accel=None)  # type: ignore[arg-type]
    assert spares.starting == {}  # nobody asked for an id of this shape
    spares.take_id(BASELINE, LIMITS)
    spares.ready[(BASELINE.digest, LIMITS)] = [spare("env-ready")]
    spares.top_up(request(), accel=None)  # type: ignore[arg-type]
    assert len(spares.starting) == 2  # 3 wanted, 1 ready
    spares.top_up(request(network=object()), accel=None)  # type: ignore[arg-type]
    assert len(spares.starting) == 2  # a NIC: no spare can serve it
    await asyncio.gather(*(task for _, task in spares.starting.values()))
    assert len(started) == 2
    assert all(r.labels == {"spare": "true"} for r in started)
    assert all(r.hard_deadline_s == 100.0 + MAX_AGE_S for r in started)
    assert len({r.env_id for r in started}) == 2


async def test_release_destroys_every_ready_spare_and_stops_topping_up() -> None:
    driver = Driver()
    spares = spares_of(driver)
    spares.target = 2
    spares.take_id(BASELINE, LIMITS)
    spares.ready[(BASELINE.digest, LIMITS)] = [spare("env-1"), spare("env-2")]
    reports = await spares.release()
    assert sorted(r.env_id for r in reports) == ["env-1", "env-2"]
    assert all(r.confirmed_absent for r in reports)
    assert spares.target == 0 and spares.ready == {} and spares.wanted == set()


async def test_spares_wait_for_the_creates_in_flight() -> None:
    spares = spares_of(Driver())
    with spares.create_in_flight():
        with spares.create_in_flight():
            assert not spares.quiet.is_set()
        assert not spares.quiet.is_set()
    assert spares.quiet.is_set()
