"""Per-episode secrets: resolved on the controller at launch, never stored anywhere.

A manifest names secrets (``"secrets": ["HF_TOKEN"]``); a ``SecretProvider`` chosen on the
controller resolves their values when the episode starts. Values reach the guest only over the
agent channel (entrypoint environment + files under ``/run/cleanroom/secrets/`` on tmpfs). Before
anything is exported, every occurrence of a value in logs, artifacts, artifact names, the parsed
result record and error messages is replaced by ``[REDACTED:NAME]`` and counted, in each form a
JSON or URL decoder (or base64) turns back into it; the ledger and the record carry names and
counts only.

Providers (``--secrets-from``): ``env`` (the controller's environment; ``env:PREFIX_`` reads
``PREFIX_NAME``), ``file:PATH`` (JSON object or ``NAME=value`` lines), ``cmd:PROGRAM`` (runs
``PROGRAM NAME``, the value is its stdout without the trailing newline).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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
    """Replaces secret values with ``[REDACTED:NAME]`` and counts each replacement.

    It redacts what a reader would decode into the secret, not only its raw bytes: each
    character of a value may also appear as a JSON escape (``\\u0068``, ``\\/``, either case)
    or URL-encoded (``%68``, per UTF-8 byte), in any mix, the whole value as base64
    (standard or URL-safe, at any of the three alignments inside a longer base64 text), and its
    bytes as hex, either case (``_hex_forms``: contiguous, ``xxd``, ``xxd -p``, ``od -t x1``,
    ``hexdump -C`` across their line breaks, and ``od -x``'s little-endian words). Parsed
    JSON is redacted key by key and value by value (``redact_json``); ``counts`` is the number
    of replacements really made.
    """

    def __init__(self, values: Mapping[str, str]) -> None:
        # longest first, so a secret containing another is replaced whole
        ordered = sorted(values.items(), key=lambda item: -len(item[1]))
        self._names = [name for name, _ in ordered]
        self._marks = [f"[REDACTED:{name}]".encode() for name in self._names]
        self.counts: dict[str, int] = dict.fromkeys(values, 0)
        self._forms = [_Forms(value) for _, value in ordered]
        self._compiled: dict[tuple[bytes, ...], re.Pattern[bytes] | None] = {}
        self._overlap = max((_MAX_HEX * len(v.encode()) for v in values.values()), default=1)

    def __bool__(self) -> bool:
        return bool(self._forms)

    def _regex(self, data: bytes) -> re.Pattern[bytes] | None:
        """The pattern for the forms that can occur in ``data`` (a regex of every form costs
        ~75x a plain search: most text holds no escape, no ``%`` and no base64 core)."""
        escapes = b"\\" in data or b"%" in data or b"+" in data
        lowered = data.lower()  # for the hex probes: a dump may be in either case
        wanted = tuple(forms.present(data, escapes, lowered) for forms in self._forms)
        if wanted not in self._compiled:
            groups = [b"(" + (alts or b"(?!)") + b")" for alts in wanted]  # one group per secret
            self._compiled[wanted] = (
                re.compile(b"|".join(groups), re.DOTALL) if any(wanted) else None
            )
        return self._compiled[wanted]

    def _mark(self, match: re.Match[bytes]) -> bytes:
        index = (match.lastindex or 1) - 1
        self.counts[self._names[index]] += 1
        return self._marks[index]

    def redact(self, data: bytes) -> bytes:
        return self._redact_until(data, len(data))[0]

    def redact_text(self, value: str) -> str:
        return self.redact(value.encode("utf-8", "surrogatepass")).decode(errors="replace")

    def redact_json(self, value: Any) -> Any:
        """A decoded JSON document with every key and string redacted (numbers too, as text,
        when their digits hold a secret); depth is bounded by the caller (``agent.wire``)."""
        if isinstance(value, str):
            return self.redact_text(value)
        if isinstance(value, dict):
            return {self.redact_text(k): self.redact_json(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.redact_json(v) for v in value]
        if isinstance(value, int | float) and not isinstance(value, bool):
            text = json.dumps(value)
            redacted = self.redact_text(text)
            return value if redacted == text else redacted
        return value

    def file(self, path: Path) -> None:
        """Redact a file in place, streamed; a secret split across chunks is still found."""
        if not self._forms:
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

        With ``safe = len(data) - overlap`` (``overlap``: the longest form of any secret) a match
        starting before ``safe`` is complete in ``data``; one starting later waits for the next.
        """
        regex = self._regex(data)
        out, i = [], 0
        for match, end in _spans(regex, data, safe) if regex is not None else ():
            if end is None:  # it waits for the next chunk, whole
                safe = match.start()
                break
            out += [data[i : match.start()], self._mark(match)]
            i = end
        cut = max(i, safe)
        out.append(data[i:cut])
        return b"".join(out), data[cut:]


def _spans(
    regex: re.Pattern[bytes], data: bytes, safe: int
) -> Iterator[tuple[re.Match[bytes], int | None]]:
    """Each match starting before ``safe`` and where its span ends, overlapping matches merged:
    base64 of a secret that repeats its own bytes can match at two alignments that overlap
    (``CQkJC`` and ``kJCQ`` in ``AAAACQkJCQg=``), and either one alone leaves some of it.
    A span that a match starting at ``safe`` or later would extend ends the scan (end None):
    that match may not be whole in ``data`` yet, so the span waits for the next chunk."""
    pos = 0
    while (match := regex.search(data, pos)) is not None and match.start() < safe:
        end, nxt = match.end(), match.start() + 1
        while (more := regex.search(data, nxt)) is not None and more.start() < end:
            if more.start() >= safe:
                yield match, None
                return
            end, nxt = max(end, more.end()), more.start() + 1
        if end > match.start():  # (no form is empty: secrets have a minimum length)
            yield match, end
        pos = max(end, nxt)


_MAX_FORM = 12  # bytes one character of a secret can take encoded (a surrogate pair of \\u)
_JSON_SHORT = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f",
               "\n": "\\n", "\r": "\\r", "\t": "\\t"}  # fmt: skip


def _hex(value: int, digits: int) -> bytes:
    """``value`` as hex digits matching either case."""
    return b"".join(
        c.encode() if c.isdigit() else f"[{c}{c.upper()}]".encode() for c in f"{value:0{digits}x}"
    )


def _char_forms(char: str) -> bytes:
    """A regex for one character: its JSON escapes, its URL encoding, itself — escapes first,
    so a secret's last character that is a backslash takes its whole escape (``\\u005c``),
    not the backslash alone with ``u005c`` left behind."""
    raw = char.encode()
    forms = []
    if ord(char) > 0xFFFF:
        high, low = divmod(ord(char) - 0x10000, 0x400)
        forms.append(b"\\\\u" + _hex(0xD800 + high, 4) + b"\\\\u" + _hex(0xDC00 + low, 4))
    else:
        forms.append(b"\\\\u" + _hex(ord(char), 4))
    if char in _JSON_SHORT:
        forms.append(re.escape(_JSON_SHORT[char].encode()))
    forms.append(b"".join(b"%" + _hex(byte, 2) for byte in raw))
    if char == " ":
        forms.append(b"\\+")
    forms.append(re.escape(raw))
    return b"(?:" + b"|".join(forms) + b")"


_HEX_SEP = (
    rb"(?:[ ]{0,2}|[ ]{0,2}[^\n]{0,18}\n[0-9a-fA-F]{0,16}:?[ ]{0,2})"  # in a line, or across one
)
"""What may stand between two bytes of a hex dump: nothing (``xxd -p``), a space or two
(``xxd``'s groups, ``od -t x1``, ``hexdump -C``'s middle), or a line's end: the rest of the line
(``xxd``'s or ``hexdump -C``'s text column), a newline, the next line's offset."""
_MAX_HEX = 2 + 2 + 18 + 1 + 17 + 2  # bytes one byte of a secret can take in a hex dump


def _hex_forms(value: bytes) -> list[bytes]:
    """Regexes of ``value``'s bytes as hex (either case): in order, separated as ``_HEX_SEP``
    allows; and as ``od -x`` prints them, 16-bit little-endian words, at both alignments (the
    words made of the value's bytes only: a byte at either end may share its word)."""
    forms = [_HEX_SEP.join(_hex(byte, 2) for byte in value)]
    for skip in (0, 1):
        pairs = [value[i : i + 2] for i in range(skip, len(value) - 1, 2)]
        if pairs:
            forms.append(_HEX_SEP.join(_hex(hi, 2) + _hex(lo, 2) for lo, hi in pairs))
    return forms


def _hex_probes(value: bytes) -> set[bytes]:
    """Lower-case text one of which any ``_hex_forms`` match holds, lowered (a cheap test
    before the regex): of the value's first two byte pairs, one starts at an even offset, so is
    whole in a dump's group, word or line (groups, words and lines start at even offsets)."""
    probes = set()
    for i in range(min(2, len(value) - 1)):
        a, b = value[i : i + 2].hex(), value[i + 1 : i + 2].hex() + value[i : i + 1].hex()
        probes |= {a.encode(), (a[:2] + " " + a[2:]).encode(), b.encode()}
    return probes


def _base64_cores(value: bytes) -> list[bytes]:
    """The base64 text that encodes ``value`` whatever surrounds it: for each alignment, the
    characters whose six bits all come from ``value`` (standard and URL-safe alphabets)."""
    cores = set()
    for shift, skip in ((0, 0), (1, 2), (2, 3)):
        encoded = base64.b64encode(b"\0" * shift + value)
        core = encoded[skip : (8 * (shift + len(value))) // 6]
        cores |= {core, core.replace(b"+", b"-").replace(b"/", b"_")}
    return sorted(cores, key=len, reverse=True)


class _Forms:
    """Every form of one value that a JSON or URL decoder (or base64) turns back into it."""

    def __init__(self, value: str) -> None:
        self.raw = value.encode()
        self.decoded = b"".join(_char_forms(char) for char in value)  # raw, escaped, mixed
        self.cores = _base64_cores(self.raw)
        self.hex = b"|".join(_hex_forms(self.raw))
        self.hex_probes = _hex_probes(self.raw)

    def present(self, data: bytes, escapes: bool, lowered: bytes) -> bytes:
        """The regex of the forms that may match in ``data`` (b"" if none can; ``lowered``:
        ``data.lower()``)."""
        alts = [self.decoded] if escapes or self.raw in data else []
        alts += [re.escape(core) for core in self.cores if core in data]
        if any(probe in lowered for probe in self.hex_probes):
            alts.append(self.hex)
        return b"|".join(alts)
