"""The ledger's hash chain: per run, every link checked, older ledgers migrated in place."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from cleanroom.ledger import SCHEMA_VERSION, Ledger, chain

OLD_SCHEMA = (  # the ledger as schema 2 made it: events without the chain's columns
    """CREATE TABLE runs (run_id TEXT PRIMARY KEY, created REAL NOT NULL, finished REAL,
    status TEXT NOT NULL, controller_id TEXT, host TEXT, pid INTEGER, baseline TEXT,
    driver TEXT, parallel INTEGER, meta TEXT NOT NULL DEFAULT '{}', locked_at REAL)""",
    """CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, run_id TEXT,
    episode_id TEXT, env_id TEXT, kind TEXT NOT NULL, data TEXT NOT NULL DEFAULT '{}')""",
)


def test_each_run_has_its_own_chain_and_every_link_holds(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as led:
        led.event("a", run_id="r1", n=1)
        led.event("b", run_id="r2")
        led.event("c", run_id="r1", episode_id="e", env_id="v", path=Path("/x"))
        led.event("home")
        r1 = led.chain("r1")
        assert [(e["seq"], e["kind"]) for e in r1] == [(1, "a"), (2, "c")]
        assert r1[0]["prev"] == chain.GENESIS and r1[1]["prev"] == r1[0]["hash"]
        assert [e["seq"] for e in led.chain("r2")] == [1]
        assert [e["kind"] for e in led.chain(None)] == ["home"]
        events = list(chain.parse(chain.exported(r1)))
    assert chain.broken_link(events) is None
    assert chain.broken_link(events[1:]) == (1, "event 1 is missing (found seq 2)")
    altered = [events[0], {**events[1], "data": '{"path":"/y"}'}]
    assert chain.broken_link(altered) == (2, "event 2 (c) was altered: its hash does not match")


def test_env_and_episode_ends_are_links_of_the_chain(tmp_path: Path) -> None:
    owner: dict[str, Any] = {"owner_controller": "c", "owner_pid": 1, "owner_host": "h"}
    with Ledger(tmp_path / "l.db") as led:
        led.start_run("r", controller_id="c", baseline="b", driver="fake", parallel=1, meta={})
        led.env_intent("v1", run_id="r", episode_id="e", attempt=1, driver="fake", **owner)
        led.env_created("v1", pid=5, run_dir="/d", accelerator="none")
        led.env_destroyed("v1", confirmed_absent=True, cleanup_ms=1.0, attempts=1)
        led.episode_queued("r", "e", 1)
        led.episode_finished("r", "e", 1, outcome="completed")
        led.finish_run("r", "completed")
        kinds = [(e["kind"], e["episode_id"], e["env_id"]) for e in led.chain("r")]
    assert kinds == [
        ("env_intent", "e", "v1"),
        ("env_created", "e", "v1"),
        ("env_destroyed", "e", "v1"),
        ("episode_finished", "e", None),
        ("run_finished", None, None),
    ]


def test_a_ledger_from_before_the_chain_is_migrated_without_losing_an_event(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    for ddl in OLD_SCHEMA:
        conn.execute(ddl)
    rows = [
        (1.5, "r", "e1", None, "export_failed", '{"error": "ENOSPC"}'),
        (2.5, None, None, "v", "reaped", "{}"),
        (3.5, "r", None, None, "run_resumed", '{"n": 2}'),
    ]
    conn.executemany(
        "INSERT INTO events (ts, run_id, episode_id, env_id, kind, data) VALUES (?,?,?,?,?,?)",
        rows,
    )
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    with Ledger(path) as led:
        kept = led.events("r")
        assert [(e.id, e.kind, e.data) for e in kept] == [
            (1, "export_failed", {"error": "ENOSPC"}),
            (3, "run_resumed", {"n": 2}),
        ]
        assert [e.seq for e in kept] == [1, 2]
        assert chain.broken_link(led.chain("r")) is None
        home = led.chain(None)
        assert [e["kind"] for e in home] == ["reaped", "ledger_chained"]
        assert chain.broken_link(home) is None
        led.event("after", run_id="r")  # the chain goes on from the migrated tip
        assert chain.broken_link(led.chain("r")) is None and led.chain("r")[-1]["seq"] == 3
    with Ledger(path) as led:  # opened again: nothing hashed twice
        assert [e["kind"] for e in led.chain(None)] == ["reaped", "ledger_chained"]
        version = led._rows("v", "PRAGMA user_version")[0][0]
    assert version == SCHEMA_VERSION


def test_every_kind_of_broken_link_is_named(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as led:
        for kind in ("a", "b", "c"):
            led.event(kind, run_id="r")
        events = list(chain.parse(chain.exported(led.chain("r"))))
    assert chain.broken_link([events[0], {**events[1], "prev": "f" * 64}, events[2]]) == (
        2,
        "event 2 does not follow event 1 (prev hash differs)",
    )
    assert chain.broken_link([events[1], events[0]]) == (1, "event 1 is missing (found seq 2)")
    torn = {k: v for k, v in events[0].items() if k != "kind"}
    assert chain.broken_link([torn]) == (1, "event 1 is malformed ('kind')")
    assert chain.broken_link([{**events[0], "ts": events[0]["ts"] + 1}]) == (
        1,
        "event 1 (a) was altered: its hash does not match",
    )
    assert chain.broken_link([]) is None
    try:
        list(chain.parse(b'{"seq": 1}\n[1, 2]\n'))
    except ValueError as exc:
        assert str(exc) == "line 2 is not an event"
    else:
        raise AssertionError("a line that is not an event parsed")


def test_the_link_is_sha256_of_the_compact_utf8_json_list() -> None:
    import hashlib

    body = '[3,"ab",1.5,"r","é",null,"k","{\\"n\\": 1}"]'.encode()
    assert chain.link(3, "ab", 1.5, "r", "é", None, "k", '{"n": 1}') == (
        hashlib.sha256(body).hexdigest()
    )
    odd = chain.link(1, chain.GENESIS, 1.0, "r", "bad\udc80name", None, "k", "{}")  # no raise
    assert len(odd) == 64
    event = {
        "seq": 1, "prev": chain.GENESIS, "hash": odd, "ts": 1.0, "run_id": "r",
        "episode_id": "é\udc80", "env_id": None, "kind": "k", "data": "{}",
    }  # fmt: skip
    raw = chain.exported([event])
    assert "é".encode() in raw and b"\\u00e9" not in raw  # UTF-8 as is, a lone surrogate kept
    assert list(chain.parse(raw)) == [event]
