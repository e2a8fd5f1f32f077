"""The short soak (``bench/soak.py`` with a fixed seed, the fake driver: a few minutes at most):
each kind of round at least once — batches of guests that behave and misbehave, sessions, env
SIGKILLs, a controller SIGKILLed and resumed, a store that fills up, the ledger's disk that fills
up mid-run, served sandboxes, a faulty S3 store, a Ray node SIGKILLed mid-batch; after every
round nothing is lost, doubled, disagreeing or left behind. A failure names the seed and the
command that reproduces it."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SEED = 11
EPISODES = 120


def soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "bench" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_short_soak_loses_nothing(tmp_path: Path) -> None:
    soak = soak_module()
    run = soak.Soak(SEED, EPISODES, "fake", tmp_path, every_kind=True)
    try:
        tally = asyncio.run(run.run(progress=False))
    except Exception as exc:  # the seed, whatever broke
        raise AssertionError(
            f"soak seed {SEED} failed in round {run.round}: {soak.reproduce(SEED, 'fake')}"
        ) from exc
    text = soak.report(tally, SEED, "fake")
    assert tally.episodes >= EPISODES
    assert set(tally.rounds) == {k for k, _ in soak.ROUNDS}, text  # every kind of round ran
    assert tally.faults.get("ledger ENOSPC"), text  # the ledger's disk filled mid-run
    assert tally.faults, text  # faults were injected
    assert (tally.lost, tally.duplicated, tally.disagreeing) == (0, 0, 0), text
    assert (tally.envs_left, tally.staging_left) == (0, 0), text
    assert tally.problems == [], text
