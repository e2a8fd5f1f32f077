"""The store on a real S3-compatible server (moto's standalone server on 127.0.0.1).

The record is the one object two attempts of an episode can race for (a retry on another node
while the first still finishes). On S3 it is written with ``If-None-Match: *``: the first writer
wins, the second is refused by the server itself, never overwrites, and sees ``RecordConflict``
(or ``False`` for the same record).
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.errors import RecordConflict
from cleanroom.store import open_store
from cleanroom.store.remote import FsspecStore
from tests.evidence.test_export_attempts import race

S3FileSystem = pytest.importorskip("s3fs").S3FileSystem
moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """A fresh server: moto keeps its buckets in the process, not in the server, so a second
    session in one process (``make mutation`` runs the tests several times in its own process)
    would see the first one's buckets; reset them, and forget s3fs's cached clients of the
    old port."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    try:
        reset = urllib.request.Request(f"{url}/moto-api/reset", method="POST")
        urllib.request.urlopen(reset, timeout=10).close()
        S3FileSystem.clear_instance_cache()
        yield url
    finally:
        server.stop()


@pytest.fixture
def s3(
    endpoint: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> FsspecStore:
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    bucket = "cleanroom-" + request.node.name.replace("_", "-")[:40].strip("-")
    store = open_store(f"s3://{bucket}/prefix")
    assert isinstance(store, FsspecStore)
    store.fs.mkdir(bucket)
    return store


def _record(eid: str, reward: float) -> dict[str, object]:
    return {
        "episode_id": eid,
        "run_id": "r",
        "attempt": 1,
        "outcome": "completed",
        "reward": reward,
    }


def test_record_and_artifacts_round_trip(s3: FsspecStore, tmp_path: Path) -> None:
    src = tmp_path / "a.bin"
    src.write_bytes(b"x" * 300_000)
    stored = s3.put_file("r", "e1", "artifacts/a.bin", src)
    assert stored.size == 300_000
    assert s3.put_record("r", "e1", _record("e1", 1.0)) is True
    assert s3.put_record("r", "e1", _record("e1", 1.0)) is False  # the same record: a no-op
    assert s3.get_record("r", "e1") == _record("e1", 1.0)
    assert [r["episode_id"] for r in s3.list_records("r")] == ["e1"]


def test_second_writer_is_refused_by_the_server(
    s3: FsspecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both writers passed the existence check (the race the old check-then-write lost): the
    server's conditional create refuses the second; the first record stays whole."""
    assert s3.put_record("r", "e2", _record("e2", 1.0)) is True
    monkeypatch.setattr(s3, "_exists", lambda dest: False)
    dest = s3._where("r", "e2", "result.json")
    assert s3._put(dest, b'{"episode_id": "e2", "reward": 0.0}', exclusive=True) is None
    monkeypatch.undo()
    assert s3.get_record("r", "e2") == _record("e2", 1.0)
    with pytest.raises(RecordConflict):
        s3.put_record("r", "e2", _record("e2", 0.0))


def test_racing_writers_exactly_one_wins(s3: FsspecStore) -> None:
    winners: list[float] = []
    conflicts: list[float] = []

    def write(reward: float) -> None:
        try:
            if s3.put_record("r", "e3", _record("e3", reward)):
                winners.append(reward)
        except RecordConflict:
            conflicts.append(reward)

    threads = [threading.Thread(target=write, args=(float(i),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(winners) == 1 and len(conflicts) == 7
    record = s3.get_record("r", "e3")
    assert record is not None and record["reward"] == winners[0]


def test_a_late_attempt_never_replaces_the_winners_objects(s3: FsspecStore, tmp_path: Path) -> None:
    """Protects: on S3 too, two attempts exporting at once write under their own
    ``attempts/<n>/`` prefixes, the late attempt's objects (written after the winner's) never
    replace the winner's, and every object the durable record lists holds the winner's bytes
    (``race`` in ``test_export_attempts.py`` says what it checks)."""
    race(s3, tmp_path, winner=2)
