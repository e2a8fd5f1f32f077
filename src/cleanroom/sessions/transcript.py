"""A session's transcript: one redacted JSON line per step, command output kept as a log.

``logs/transcript.jsonl`` holds every command (argv, cwd, user, variable *names*, start,
duration, exit status, a redacted tail of its output) and every file moved (path, size,
sha256). The full output of each command goes, redacted, into ``logs/commands.log``; the step
names its span there (``offset``, ``size``, ``sha256`` of the stored bytes), so a reader can
check what the transcript says against the log. The bytes of a file written into the env
(``put``, up to ``WRITE_KEEP``) are kept there too (``content_log``), unless redaction would
change them (a secret is never stored: ``content_withheld``), so ``cleanroom replay`` can write
them again. Both files are bounded by the episode's output quota: past it, output is dropped
(``truncated``), never the step itself.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from cleanroom.evidence.secrets import Redactor

TRANSCRIPT = "transcript.jsonl"
COMMANDS_LOG = "commands.log"
TAIL = 4096  # bytes of each stream kept inline in the step
WRITE_KEEP = 1 << 20  # the largest written file whose bytes the log keeps for replay


def digest(data: bytes) -> dict[str, Any]:
    """Size and sha256 of ``data`` (what a file step records)."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class Transcript:
    """Appends steps to ``folder/transcript.jsonl`` and output to ``folder/commands.log``.

    ``redactor`` is read at each write (a session learns its secrets at provision)."""

    def __init__(self, folder: Path, quota_bytes: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / TRANSCRIPT
        self.log_path = folder / COMMANDS_LOG
        for p in (self.path, self.log_path):
            p.touch(mode=0o600)
        self.redactor: Redactor | None = None
        self.steps = 0
        self._left = quota_bytes
        self._log_size = 0

    def _redact(self, value: Any) -> Any:
        return self.redactor.redact_json(value) if self.redactor else value

    def add(self, op: str, **fields: Any) -> dict[str, Any]:
        """Write one step (redacted) and return it."""
        self.steps += 1
        entry = self._redact({"step": self.steps, "op": op, "at": time.time(), **fields})
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        self._left -= len(line)
        with self.path.open("ab") as f:
            f.write(line)
        return dict(entry)

    def _keep(self, data: bytes) -> dict[str, Any]:
        """Append ``data`` to the log; its span."""
        span = {"log": COMMANDS_LOG, "offset": self._log_size, **digest(data)}
        if data:
            with self.log_path.open("ab") as f:
                f.write(data)
            self._log_size += len(data)
        self._left -= len(data)
        return span

    def content(self, data: bytes) -> dict[str, Any]:
        """What a ``put`` step records of the bytes written: their span in the log
        (``content_log``), or why they were not kept (``content_withheld``)."""
        if len(data) > WRITE_KEEP:
            return {"content_withheld": f"over {WRITE_KEEP} bytes"}
        if len(data) > self._left:
            return {"content_withheld": "over the output quota"}
        if self.redactor is not None and self.redactor.redact(data) != data:
            return {"content_withheld": "holds a secret"}
        return {"content_log": self._keep(data)}

    def output(self, stream: str, data: bytes) -> dict[str, Any]:
        """Keep one stream of a command in the log; what its step records about it."""
        clean = self.redactor.redact(data) if self.redactor else data
        kept = clean[: max(self._left, 0)]
        span = self._keep(kept)
        tail = clean[-TAIL:].decode(errors="replace")
        return {
            stream: tail,
            f"{stream}_log": span,
            **({f"{stream}_truncated": True} if len(kept) < len(clean) else {}),
        }

    def command(
        self,
        *,
        argv: list[str],
        cwd: str | None,
        user: str | None,
        env_names: list[str],
        started_at: float,
        background: bool = False,
        exit_code: int | None = None,
        signal: int | None = None,
        timed_out: bool = False,
        stdout: bytes = b"",
        stderr: bytes = b"",
        error: str | None = None,
    ) -> dict[str, Any]:
        """One command's step: how it was asked, how it ended, its output as log spans."""
        return self.add(
            "exec",
            argv=argv,
            cwd=cwd,
            user=user,
            env_names=env_names,  # names only, never values
            background=background,
            started_at=started_at,
            duration_s=round(time.time() - started_at, 6),
            exit_code=exit_code,
            signal=signal,
            timed_out=timed_out,
            **({"error": error} if error is not None else {}),
            **self.output("stdout", stdout),
            **self.output("stderr", stderr),
        )
