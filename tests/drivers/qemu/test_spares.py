"""Spare clones on real QEMU microVMs: started ahead, run once (RESEED, ``touch.py``'s paths)
and paused again, handed out by id, resumed and reseeded by ``create``, destroyed and confirmed
gone when nobody takes them."""

from __future__ import annotations

import signal

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import EnvRequest, Owner
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.host import hostproc
from cleanroom.observe.report import run_report_json

from ... import vmkit
from ...vmkit import Harness, assert_gone, request

pytestmark = pytest.mark.vm


def request_for(env_id: str, baseline: Baseline) -> EnvRequest:
    shape = request(baseline)
    return EnvRequest(env_id, baseline, shape.limits, Owner("vm-tests"), hard_deadline_s=300)


async def run_state(driver: QemuDriver, env_id: str) -> str:
    qmp = await driver._live[env_id].open_qmp()  # kept open: the driver closes it with the env
    answer = await qmp.execute("query-status")
    return str(answer["status"])


async def test_spares_wait_paused_then_one_is_resumed_under_its_id(
    tiny_baseline: Baseline,
) -> None:
    driver = QemuDriver(start="snapshot")
    driver.keep_spares(2)
    limits = request(tiny_baseline).limits
    first_id = driver.next_env_id(tiny_baseline, limits)  # none ready: a fresh id
    assert not driver.spares.taken
    # the template is built, then 2 spares of this shape start
    first = await driver.create(request_for(first_id, tiny_baseline))
    await driver.spares.settled()
    spare_ids = [s.env_id for q in driver.spares.ready.values() for s in q]
    assert len(spare_ids) == 2, driver.spares.last_error
    for spare in [s for q in driver.spares.ready.values() for s in q]:
        assert await run_state(driver, spare.env_id) == "paused"  # run ahead, then stopped
        assert spare.session.hello["clone_id"] == spare.env_id  # its RESEED named it
        assert spare.warmed == "command"  # tiny's entrypoint is a command: touch.py's paths ran
        assert hostproc.pids_with_marker(spare.env_id)
    taken = driver.next_env_id(tiny_baseline, limits)
    assert taken == spare_ids[0]
    env = await driver.create(request_for(taken, tiny_baseline))
    others: list[str] = []
    try:
        assert env.env_id == taken and env.hello["clone_id"] == taken
        assert env.info.start_kind == "snapshot" and env.info.start_note is None
        assert env.info.spare_s is not None and env.info.spare_s > 0
        assert env.info.start_facts()["spare_s"] == env.info.spare_s
        shape = request(tiny_baseline)
        template, _ = await driver.templates.template_for(shape, await driver._accel(shape))
        touched = template.facts["touched"]  # its build VM ran them too: its caches are warm
        assert touched["sh"] == 0 and touched["put"] > 0 and touched["read"] > 0, touched
        listing = (await env.exec(["ls", "-a", "/tmp"], timeout_s=60)).check().stdout
        assert b"cleanroom-touch" not in listing  # the template's and the spare's file: gone
        a = (await env.exec(["head", "-c", "16", "/dev/urandom"], timeout_s=60)).check()
        b = (await first.exec(["head", "-c", "16", "/dev/urandom"], timeout_s=60)).check()
        assert a.stdout != b.stdout
        await driver.spares.settled()  # taking one started another
        others = [s.env_id for q in driver.spares.ready.values() for s in q]
        assert len(others) == 2 and taken not in others
    finally:
        reports = [await env.aclose(), await first.aclose()]
        released = await driver.release_spares()
    assert all(r.confirmed_absent for r in reports + released)
    assert sorted(r.env_id for r in released) == sorted(others)
    for env_id in [*spare_ids, *others, env.env_id, first.env_id]:
        assert_gone(driver, env_id)
    assert driver.list_owned() == []


async def reserved_spare(baseline: Baseline) -> tuple[QemuDriver, str]:
    """A driver keeping one spare, and that spare's id, reserved as the controller would."""
    driver = QemuDriver(start="snapshot")
    driver.keep_spares(1)
    limits = request(baseline).limits
    first = request_for(driver.next_env_id(baseline, limits), baseline)
    await (await driver.create(first)).aclose()
    await driver.spares.settled()
    taken = driver.next_env_id(baseline, limits)
    assert taken in driver.spares.taken
    return driver, taken


async def test_only_a_shape_asked_for_gets_spares(tiny_baseline: Baseline) -> None:
    """An env made with an id of its own (a verifier's, a test's) starts no spares."""
    driver = QemuDriver(start="snapshot")
    driver.keep_spares(2)
    await (await driver.create(request(tiny_baseline))).aclose()
    await driver.spares.settled()
    assert driver.spares.ready == {} and driver.list_owned() == []


async def test_a_spare_that_died_is_replaced_and_the_env_starts_anyway(
    tiny_baseline: Baseline,
) -> None:
    driver, taken = await reserved_spare(tiny_baseline)
    spare = driver.spares.taken[taken]
    hostproc.kill_group(spare.live.proc.pid, signal.SIGKILL)
    await spare.live.proc.wait()
    env = await driver.create(request_for(taken, tiny_baseline))
    try:
        assert env.env_id == taken and env.info.spare_s is None
        assert env.info.start_note is not None and "a spare was not used" in env.info.start_note
        assert (await env.exec(["true"], timeout_s=60)).exit_code == 0
    finally:
        report = await env.aclose()
        released = await driver.release_spares()
    assert report.confirmed_absent and all(r.confirmed_absent for r in released)
    assert_gone(driver, taken)
    assert driver.list_owned() == []


async def test_a_reserved_spare_nobody_creates_is_destroyed_by_its_id(
    tiny_baseline: Baseline,
) -> None:
    """The controller destroys an episode's env id whatever happened before create."""
    driver, taken = await reserved_spare(tiny_baseline)
    assert hostproc.pids_with_marker(taken)
    report = await driver.destroy(taken)
    assert report.confirmed_absent and taken not in driver.spares.taken
    assert_gone(driver, taken)
    await driver.release_spares()
    assert driver.list_owned() == []


async def test_a_run_uses_spares_and_leaves_none_behind(
    harness: Harness, tiny_baseline: Baseline
) -> None:
    ctl, ledger, store, driver = harness
    manifests = [vmkit.manifest(f"sp-{i}", i, policy="snap", mode="ok") for i in range(6)]
    result = await ctl.run(manifests, tiny_baseline, run_id="spares")
    assert [e.outcome for e in result.episodes] == [Outcome.COMPLETED] * 6
    assert result.leaked_envs == []
    records = [store.get_record("spares", m.episode_id) for m in manifests]
    provenance = [r["provenance"] for r in records if r is not None]
    assert len(provenance) == 6
    assert any(p.get("spare_s") for p in provenance), provenance  # later episodes took spares
    starts = run_report_json("spares", ledger, store)["summary"]["starts"]
    assert starts.get("spare") == sum(1 for p in provenance if p.get("spare_s") is not None)
    released = ledger.events("spares", "spare_destroyed")
    assert released, "the spares nobody took were destroyed and recorded"
    vmkit.assert_nothing_left(driver, ledger, "spares")
    for event in released:
        assert_gone(driver, str(event.env_id))
    assert driver.list_owned() == []


async def test_released_spares_leave_no_unclosed_stream(tiny_baseline: Baseline) -> None:
    """Protects issue 36 (``ResourceWarning: unclosed StreamWriter/socket`` after a Gym env's
    ``close``): a spare nobody took is destroyed with its load monitor's and its agent's
    streams closed, not left to the garbage collector."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        driver = QemuDriver(start="snapshot")
        driver.keep_spares(1)
        limits = request(tiny_baseline).limits
        first = request_for(driver.next_env_id(tiny_baseline, limits), tiny_baseline)
        await (await driver.create(first)).aclose()
        await driver.spares.settled()
        assert sum(len(queue) for queue in driver.spares.ready.values()) == 1
        released = await driver.release_spares()
        del driver
        gc.collect()
    assert len(released) == 1 and released[0].confirmed_absent
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks
