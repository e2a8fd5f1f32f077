"""A forked group's run audits clean: its warm parent (an env with no episode) and every clone
are confirmed absent in the chain, and each clone's statement names its snapshot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.checks.audit import verify_run
from cleanroom.evidence import attest, keys
from cleanroom.evidence.manifest import Manifest
from tests.batch.test_groups import Harness, members
from tests.forking_fake import ForkingFake


@pytest.fixture
def forking(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path, ForkingFake(tmp_path), parallel=3)
    yield h
    h.ledger.close()


async def test_a_forked_group_audits_clean(forking: Harness) -> None:
    h = forking
    solo = Manifest.model_validate({"episode_id": "solo", "seed": 9, "policy": {"id": "p"}})
    await h.ctl.run([*members("g1", h.count_setup), solo], h.baseline, run_id="r1")
    trusted = [keys.signing_key().public_key()]
    report = verify_run(h.store, "r1", trusted)
    assert report.ok, report.problems
    assert report.records == 4 and report.envs == 5  # 3 clones, the solo, the warm parent
    record = h.store.get_record("r1", "g1-0")
    assert record is not None
    raw = h.store.get_bytes("r1", "g1-0", record["attestation"])
    assert raw is not None
    env = attest.open_envelope(raw, trusted, "g1-0")["predicate"]["env"]
    assert (
        env["start"] == "fork"
        and env["group"]["snapshot"] == record["provenance"]["group"]["snapshot"]
    )
