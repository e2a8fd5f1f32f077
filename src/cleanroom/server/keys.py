"""API keys of ``cleanroom serve`` and the limits each key is held to.

A key is shown once, when made (``cleanroom keys create``): ``e2b_`` and 40 hex digits, as
E2B's keys look. Only its sha256 is kept, with an id and a name, in ``<home>/server/keys.json``
(0600 in a 0700 folder). ``KeyRing.check`` turns a presented key into its id (constant-time
compare) or None; every sandbox belongs to the id that created it.

``Limits``: per key, at most ``max_sandboxes`` live at once and ``creates_per_s`` creates a
second (a token bucket of ``burst``); over either, ``retry_after`` says when to come back
(the server answers 429 with ``Retry-After``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.errors import ConfigError
from cleanroom.host import paths, private

PREFIX = "e2b_"


def keys_file() -> Path:
    """Where the home keeps its server keys (hashed)."""
    return paths.home() / "server" / "keys.json"


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyInfo:
    """One key as stored: its id, name, when made, and the sha256 of the key itself."""

    key_id: str
    name: str
    created: float
    sha256: str


class KeyRing:
    """The home's keys file: ``create``, ``list``, ``revoke``, ``check``."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or keys_file()

    def _load(self) -> list[KeyInfo]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.path}: unreadable keys file: {exc}") from exc
        try:
            return [KeyInfo(**row) for row in raw["keys"]]
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{self.path}: malformed keys file") from exc

    def _save(self, keys: list[KeyInfo]) -> None:
        private.private_dir(self.path.parent)
        body = json.dumps({"keys": [k.__dict__ for k in keys]}, indent=1).encode()
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def create(self, name: str = "") -> tuple[KeyInfo, str]:
        """A new key: its stored info and the key itself (shown once, never kept)."""
        key = PREFIX + secrets.token_hex(20)
        info = KeyInfo("key_" + secrets.token_hex(6), name, time.time(), _hash(key))
        self._save([*self._load(), info])
        return info, key

    def list(self) -> list[KeyInfo]:
        return self._load()

    def revoke(self, key_id: str) -> bool:
        """Remove the key ``key_id``; False if there was none."""
        keys = self._load()
        kept = [k for k in keys if k.key_id != key_id]
        if len(kept) == len(keys):
            return False
        self._save(kept)
        return True

    def check(self, key: str | None) -> str | None:
        """The id of ``key`` if it is one of ours (read fresh: a revoke applies at once)."""
        if not key:
            return None
        digest = _hash(key)
        found = None
        for info in self._load():
            if hmac.compare_digest(info.sha256, digest):
                found = info.key_id
        return found


@dataclass
class Limits:
    """Per-key limits (``cleanroom serve`` options)."""

    max_sandboxes: int = 16
    creates_per_s: float = 5.0
    burst: int = 10


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class Throttle:
    """The creates/s token bucket of every key."""

    limits: Limits
    buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, key_id: str, now: float | None = None) -> float:
        """0 if ``key_id`` may create now (a token taken), else seconds until it may."""
        now = time.monotonic() if now is None else now
        rate, burst = self.limits.creates_per_s, float(self.limits.burst)
        b = self.buckets.setdefault(key_id, _Bucket(burst, now))
        b.tokens = min(burst, b.tokens + (now - b.at) * rate)
        b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return 0.0
        return (1.0 - b.tokens) / rate if rate > 0 else math.inf


def public(info: KeyInfo) -> dict[str, Any]:
    """A key as ``keys list`` shows it (never its hash)."""
    return {"id": info.key_id, "name": info.name, "created": info.created}
