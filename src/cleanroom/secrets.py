"""Per-episode secrets: resolved on the controller at launch, never stored anywhere.

A manifest names secrets (``"secrets": ["HF_TOKEN"]``); a ``SecretProvider`` chosen on the
controller resolves their values when the episode starts. Values reach the guest only over the
agent channel (entrypoint environment + files under ``/run/cleanroom/secrets/`` on tmpfs). Before
anything is exported, every occurrence of a value in logs, artifacts and the result record is
replaced by ``[REDACTED:NAME]`` and counted; the ledger and the record carry names and counts only.

Providers (``--secrets-from``): ``env`` (the controller's environment; ``env:PREFIX_`` reads
``PREFIX_NAME``), ``file:PATH`` (JSON object or ``NAME=value`` lines), ``cmd:PROGRAM`` (runs
``PROGRAM NAME``, the value is its stdout without the trailing newline).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cleanroom.errors import ConfigError

MIN_SECRET_LEN = 4  # shorter values would redact ordinary text; refuse them
CHUNK = 1 << 20


class SecretProvider(Protocol):
    def resolve(self, names: list[str]) -> dict[str, str]: ...


def _missing(names: list[str], found: Mapping[str, str], where: str) -> None:
    absent = [n for n in names if n not in found]
    if absent:
        raise ConfigError(f"secret(s) {', '.join(absent)} not found in {where}")


@dataclass(frozen=True)
class EnvSecrets:
    prefix: str = ""

    def resolve(self, names: list[str]) -> dict[str, str]:
        found = {n: os.environ[self.prefix + n] for n in names if self.prefix + n in os.environ}
        _missing(names, found, f"the controller's environment (prefix {self.prefix!r})")
        return found


@dataclass(frozen=True)
class FileSecrets:
    path: Path

    def resolve(self, names: list[str]) -> dict[str, str]:
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read secrets file {self.path}: {exc}") from exc
        try:
            data = json.loads(text)
            values = {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except ValueError:
            pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
            values = {k.strip(): v.strip() for k, v in pairs if not k.lstrip().startswith("#")}
        found = {n: values[n] for n in names if n in values}
        _missing(names, found, str(self.path))
        return found


@dataclass(frozen=True)
class CommandSecrets:
    argv: tuple[str, ...]

    def resolve(self, names: list[str]) -> dict[str, str]:
        found = {}
        for name in names:
            try:
                proc = subprocess.run(
                    [*self.argv, name], capture_output=True, text=True, timeout=30, check=True
                )
            except (OSError, subprocess.SubprocessError) as exc:
                raise ConfigError(f"secret command failed for {name}: {exc}") from exc
            found[name] = proc.stdout.removesuffix("\n")
        return found


def provider_from(spec: str | None) -> SecretProvider:
    """Parse a ``--secrets-from`` value."""
    if spec is None or spec == "env":
        return EnvSecrets()
    kind, _, arg = spec.partition(":")
    if kind == "env":
        return EnvSecrets(arg)
    if kind == "file" and arg:
        return FileSecrets(Path(arg))
    if kind == "cmd" and arg:
        return CommandSecrets(tuple(shlex.split(arg)))
    raise ConfigError(
        f"--secrets-from must be env, env:PREFIX, file:PATH or cmd:PROGRAM ({spec!r})"
    )


def resolve(provider: SecretProvider, names: list[str]) -> dict[str, str]:
    """Values for ``names``; refuses values too short to redact safely."""
    values = provider.resolve(sorted(set(names))) if names else {}
    short = [n for n, v in values.items() if len(v) < MIN_SECRET_LEN]
    if short:
        raise ConfigError(f"secret(s) {', '.join(short)} shorter than {MIN_SECRET_LEN} characters")
    return values


class Redactor:
    """Replaces secret values with ``[REDACTED:NAME]`` and counts each replacement."""

    def __init__(self, values: Mapping[str, str]) -> None:
        # longest first, so a secret containing another is replaced whole
        self._pairs = sorted(
            ((v.encode(), f"[REDACTED:{n}]".encode(), n) for n, v in values.items()),
            key=lambda p: -len(p[0]),
        )
        self.counts: dict[str, int] = dict.fromkeys(values, 0)
        self._overlap = max((len(p[0]) for p in self._pairs), default=1) - 1

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def redact(self, data: bytes) -> bytes:
        for secret, mark, name in self._pairs:
            found = data.count(secret)
            if found:
                self.counts[name] += found
                data = data.replace(secret, mark)
        return data

    def redact_text(self, value: str) -> str:
        return self.redact(value.encode()).decode(errors="replace")

    def file(self, path: Path) -> None:
        """Redact a file in place, streamed; a secret split across chunks is still found."""
        if not self._pairs:
            return
        tmp = path.with_name(path.name + ".redacting")
        with path.open("rb") as src, tmp.open("wb") as dst:
            carry = b""
            while True:
                chunk = src.read(CHUNK)
                data = carry + chunk
                safe = len(data) if not chunk else max(len(data) - self._overlap, 0)
                done, carry = self._redact_until(data, safe)
                dst.write(done)
                if not chunk:
                    break
        os.replace(tmp, path)

    def _redact_until(self, data: bytes, safe: int) -> tuple[bytes, bytes]:
        """Replace matches that start before ``safe`` (they end inside ``data``); keep the rest.

        With ``safe = len(data) - (longest secret - 1)`` a match starting before ``safe`` is
        complete in ``data``, and one starting at or after it is left for the next chunk.
        """
        out, i = [], 0
        while True:
            hits = [(data.find(s, i), -len(s), s, m, n) for s, m, n in self._pairs]
            hits = [h for h in hits if 0 <= h[0] < safe]
            if not hits:
                cut = max(i, safe)
                out.append(data[i:cut])
                return b"".join(out), data[cut:]
            start, _, secret, mark, name = min(hits)
            out += [data[i:start], mark]
            self.counts[name] += 1
            i = start + len(secret)
