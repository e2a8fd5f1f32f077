"""Keys and limits of ``cleanroom serve``: 401, another key's sandbox as 404, 429, 413."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import AuthenticationException, NotFoundException, RateLimitException

from cleanroom.server.keys import KeyRing, Limits, Throttle, keys_file

from .kit import Server, new_key


def test_no_key_or_a_wrong_or_revoked_key_is_401(server: Server, key: str) -> None:
    """Protects: the control API answers 401 without a key, with a wrong one, and with a
    revoked one (revocation applies to the running server at once); the SDK raises its
    ``AuthenticationException``."""
    r = httpx.post(server.url + "/sandboxes", json={"templateID": "fake"})
    assert r.status_code == 401 and r.json()["code"] == 401
    with pytest.raises(AuthenticationException):
        Sandbox.create("fake", api_key="e2b_" + "0" * 40)
    ring = KeyRing()
    info, revoked = ring.create("soon gone")
    assert ring.revoke(info.key_id)
    r = httpx.get(server.url + "/v2/sandboxes", headers={"X-API-Key": revoked})
    assert r.status_code == 401


def test_keys_are_kept_hashed_in_a_private_file(key: str) -> None:
    """Protects: the keys file is 0600 and holds no key, only its sha256."""
    assert os.stat(keys_file()).st_mode & 0o777 == 0o600
    text = keys_file().read_text()
    assert key not in text and "sha256" in json.loads(text)["keys"][0]


def test_another_keys_sandbox_is_exactly_an_unknown_one(server: Server, key: str) -> None:
    """Protects: a key sees and controls only its sandboxes: another key's id answers as an
    unknown id does (status and body) on info, kill, timeout and connect; not in its list;
    envd without the sandbox's access token is the same 404 as an unknown sandbox."""
    mine = Sandbox.create("fake")
    other = new_key("other")
    theirs = {"X-API-Key": other}
    unknown = "i" + "0" * 20
    for method, path, body in [
        ("GET", "/sandboxes/{}", None),
        ("DELETE", "/sandboxes/{}", None),
        ("POST", "/sandboxes/{}/timeout", {"timeout": 5}),
        ("POST", "/v2/sandboxes/{}/connect", {"timeout": 5}),
    ]:
        seen = [
            httpx.request(method, server.url + path.format(sid), headers=theirs, json=body)
            for sid in (mine.sandbox_id, unknown)
        ]
        assert seen[0].status_code == seen[1].status_code == 404
        assert seen[0].text.replace(mine.sandbox_id, unknown) == seen[1].text
    with pytest.raises(NotFoundException):
        Sandbox.get_info(mine.sandbox_id, api_key=other)
    assert Sandbox.kill(mine.sandbox_id, api_key=other) is False
    assert Sandbox.list(api_key=other).next_items() == []
    envd = [
        httpx.get(
            server.url + "/files", params={"path": "/etc/hostname"}, headers={"E2b-Sandbox-Id": sid}
        )
        for sid in (mine.sandbox_id, unknown)
    ]
    assert envd[0].status_code == envd[1].status_code == 404
    assert mine.commands.run("echo still mine").stdout == "still mine\n"  # untouched
    mine.kill()


def test_over_the_per_key_limit_is_429_with_retry_after(server: Server, key: str) -> None:
    """Protects: a key's 4th live sandbox (``--per-key 3``) is refused 429 with Retry-After
    (the SDK's ``RateLimitException``); another key is not affected; after a kill it may
    create again."""
    made = [Sandbox.create("fake") for _ in range(3)]
    with pytest.raises(RateLimitException):
        Sandbox.create("fake")
    r = httpx.post(
        server.url + "/sandboxes", headers={"X-API-Key": key}, json={"templateID": "fake"}
    )
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    other = Sandbox.create("fake", api_key=new_key("other"))
    made[0].kill()
    made.append(Sandbox.create("fake"))
    for sbx in [*made[1:], other]:
        sbx.kill()


def test_creates_per_second_are_throttled() -> None:
    """Protects: the creates/s bucket: ``burst`` at once, then one per 1/rate seconds, and the
    wait it reports is the time until the next token."""
    t = Throttle(Limits(creates_per_s=2.0, burst=3))
    assert [t.take("k", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert t.take("k", now=0.0) == pytest.approx(0.5)
    assert t.take("k", now=0.5) == 0.0
    assert t.take("other", now=0.5) == 0.0


def test_oversized_bodies_are_413(server: Server, key: str) -> None:
    """Protects: a control body over 1 MiB and a file upload over ``--max-body-mib`` (4) are
    refused 413 (declared or not), and a gzip upload that unpacks past it too; the sandbox
    still works after."""
    sbx = Sandbox.create("fake")
    r = httpx.post(
        server.url + "/sandboxes",
        headers={"X-API-Key": key},
        content=b"{" + b" " * (2 * 1024 * 1024) + b"}",
    )
    assert r.status_code == 413
    envd = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""}
    big = b"x" * (5 * 1024 * 1024)
    r = httpx.post(
        server.url + "/files",
        params={"path": "/tmp/cr-big"},
        content=big,
        headers={**envd, "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 413

    def chunks() -> Iterator[bytes]:
        for _ in range(5):
            yield b"y" * (1024 * 1024)

    r = httpx.post(
        server.url + "/files",
        params={"path": "/tmp/cr-big"},
        content=chunks(),
        headers={**envd, "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 413
    bomb = gzip.compress(b"\0" * (8 * 1024 * 1024))
    r = httpx.post(
        server.url + "/files",
        params={"path": "/tmp/cr-big"},
        content=bomb,
        headers={**envd, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 413
    assert sbx.commands.run("echo fine").stdout == "fine\n"
    sbx.kill()
