"""Interactive sessions on the one Episode lifecycle: a transcript as durable evidence, the env
confirmed absent before the block returns, an exception in the block ending only the session."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import RunFolderDriver
from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import ManifestError, NetworkPolicyError
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import session
from cleanroom.store import LocalStore
from tests.stored import evidence

from ..conftest import make_fake_baseline, with_network
from ..vmkit import assert_nothing_left

OPTIONS = RunOptions(cleanup_window_s=10)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[Ledger, LocalStore]]:
    with Ledger(tmp_path / "ledger.db") as ledger:
        yield ledger, LocalStore(tmp_path / "store")


def _transcript(store: LocalStore, run_id: str) -> list[dict[str, object]]:
    folder = Path(store.episode_uri(run_id, "session").removeprefix("file://"))
    lines = evidence(folder, "logs", "transcript.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


async def _session_round_trip(
    driver: RunFolderDriver,
    baseline: Baseline,
    ledger: Ledger,
    store: LocalStore,
    prefix_of: Callable[[str], str],
) -> None:
    async with session(
        baseline, driver=driver, ledger=ledger, store=store, run_id="s1", options=OPTIONS
    ) as sb:
        run, prefix = sb.episode.key.run_id, prefix_of(sb.episode.env_id)
        said = await sb.exec(["sh", "-c", "echo hello; echo oops >&2; exit 3"])
        assert (said.exit_code, said.stdout) == (3, b"hello\n")
        await sb.put(f"{prefix}/tmp/note.txt", b"abc")
        assert await sb.get(f"{prefix}/tmp/note.txt") == b"abc"
        sb.finish(reward=1.5, info={"steps": sb.steps})
        [env] = ledger.envs(run_id=run)
        assert env.ready_at is not None and env.confirmed_absent_at is None  # live in the block
    record = store.get_record("s1", "session")
    assert record is not None and record["outcome"] == "completed" and record["reward"] == 1.5
    steps = _transcript(store, "s1")
    assert [s["op"] for s in steps] == ["exec", "put", "get", "finish"]
    assert steps[0]["exit_code"] == 3 and steps[0]["stderr"] == "oops\n"
    assert steps[1]["sha256"] == steps[2]["sha256"] and steps[1]["size"] == 3
    assert_nothing_left(driver, ledger, "s1", store)  # destroyed before the block returned
    assert ledger.get_run("s1").status == "completed"  # type: ignore[union-attr]


async def test_a_session_on_the_fake_driver(
    tmp_path: Path, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects: a session is an episode: intent row, durable record with its transcript, the
    env confirmed absent when the block returns (fast, the real agent as a host process)."""
    driver = FakeDriver(run_root=tmp_path / "run")
    ledger, store = parts
    await _session_round_trip(
        driver, make_fake_baseline(tmp_path), ledger, store, driver.guest_prefix
    )


async def test_an_exception_in_the_block_ends_only_the_session(
    tmp_path: Path, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects: an exception in a session's block is raised to the caller, the session ends
    with one non-final outcome (no record; its transcript kept with the attempt) and its env is
    destroyed and confirmed absent first."""
    driver = FakeDriver(run_root=tmp_path / "run")
    ledger, store = parts
    with pytest.raises(KeyError):
        async with session(
            make_fake_baseline(tmp_path),
            driver=driver,
            ledger=ledger,
            store=store,
            run_id="s2",
            options=OPTIONS,
        ) as sb:
            await sb.exec(["true"])
            raise KeyError("the caller's bug")
    [row] = ledger.episodes("s2")
    assert row.outcome == "infra_error" and "KeyError" in (row.error or "")
    folder = Path(store.episode_uri("s2", "session").removeprefix("file://"))
    assert (folder / "attempts/1/logs/transcript.jsonl").read_text().count('"op": "exec"') == 1
    assert_nothing_left(driver, ledger, "s2", store)


async def test_a_session_without_finish_is_episode_error(
    tmp_path: Path, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects: a session that never said how it ended is final but not ``completed``."""
    driver = FakeDriver(run_root=tmp_path / "run")
    ledger, store = parts
    async with session(
        make_fake_baseline(tmp_path), driver=driver, ledger=ledger, store=store, run_id="s3"
    ):
        pass
    record = store.get_record("s3", "session")
    assert record is not None and record["outcome"] == "episode_error"
    assert "finish()" in record["error"]["message"]
    assert_nothing_left(driver, ledger, "s3", store)


@pytest.mark.vm
async def test_a_session_in_a_real_vm(
    tiny_baseline: Baseline, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects (real VM): commands and files in a session's microVM, the transcript durable,
    the VM confirmed absent before ``async with`` returns."""
    ledger, store = parts
    await _session_round_trip(QemuDriver(), tiny_baseline, ledger, store, lambda env_id: "")


async def test_a_session_can_turn_the_baselines_network_off(
    tmp_path: Path, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects: ``network=[]`` gives the session no egress even on a baseline that allows some
    (a caller's "no network", e.g. Harbor's ``no-network``, must not inherit the baseline's)."""
    driver = FakeDriver(run_root=tmp_path / "run")
    ledger, store = parts
    networked = with_network(make_fake_baseline(tmp_path), ["example.com:443"], tmp_path)
    async with session(
        networked, driver=driver, ledger=ledger, store=store, run_id="s4", network=[]
    ) as sb:
        assert sb.episode.manifest.network is not None
        assert sb.episode.manifest.network.allow == [] and sb.episode.egress is None
        sb.finish(reward=0.0)
    assert_nothing_left(driver, ledger, "s4", store)


async def test_a_session_asking_more_network_than_its_baseline_is_refused(
    tmp_path: Path, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects: a session's allowlist only narrows its baseline's: asking for a host the
    baseline does not allow is a NetworkPolicyError naming it, before any env is created; a bad
    entry is a ManifestError naming the field."""
    driver = FakeDriver(run_root=tmp_path / "run")
    ledger, store = parts
    baseline = make_fake_baseline(tmp_path)
    with pytest.raises(NetworkPolicyError) as refused:
        async with session(
            baseline,
            driver=driver,
            ledger=ledger,
            store=store,
            run_id="s5",
            network=["example.com:443"],
        ):
            pass
    assert "example.com:443" in str(refused.value) + " ".join(refused.value.problems)
    assert [e.created_at for e in ledger.envs(run_id="s5")] == [None]  # an intent, no VM
    assert_nothing_left(driver, ledger, "s5")
    with pytest.raises(ManifestError, match="network"):
        async with session(
            baseline, driver=driver, ledger=ledger, store=store, run_id="s6", network=["nope"]
        ):
            pass
