"""Structured logs of a run (structlog over the stdlib ``logging`` logger ``cleanroom``).

``setup()`` installs up to two sinks: the terminal (stderr; structlog's ``ConsoleRenderer`` when
``fmt`` is ``console``, one JSON object per line when ``json``; ``auto`` picks console on a TTY
and JSON otherwise) and a JSON Lines file (``--log-file``). ``EventLogger`` is a controller event
hook that writes one line per lifecycle step with ``run_id``, ``episode_id`` and ``env_id`` bound,
so every line of an episode can be found by any of the three ids.

Nothing is configured globally: the package's loggers are plain structlog wrappers around the
``cleanroom`` stdlib logger, which does not propagate to the root logger once set up.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import structlog

from cleanroom.errors import ConfigError

LOGGER_NAME = "cleanroom"
FORMATS = ("auto", "console", "json")
_OURS = "_cleanroom_sink"  # marks the handlers setup() installed, so a second setup replaces them

_PRE_CHAIN: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


class _Stderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is *now* (a live rich progress bar redirects it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # pragma: no cover - logging must never break the run
            self.handleError(record)


def _tidy_for_terminal(
    logger: Any, method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Terminal only: short time, rounded numbers, and only what is worth a glance: no empty
    or as-expected keys (absent confirmed, one destroy attempt), no per-phase detail, and the
    run id on run lines only (the JSON sinks keep everything)."""
    ts = event.get("timestamp")
    if isinstance(ts, str) and "T" in ts:
        event["timestamp"] = ts.split("T", 1)[1][:8]
    msg = str(event.get("event", ""))
    usual = {"confirmed_absent": True, "destroy_attempts": 1, "skipped": 0, "attempt": 1}
    return {
        k: round(v, 3) if isinstance(v, float) else v
        for k, v in event.items()
        if v is not None
        and k != "timings"
        and (k not in usual or v != usual[k])
        and (k != "run_id" or msg.startswith("run "))
    }


def _lead_keys(
    logger: Any, method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """JSON only: time, level and message first, then the ids, then the rest."""
    lead = ("timestamp", "level", "event", "run_id", "episode_id", "env_id")
    return {**{k: event[k] for k in lead if k in event}, **event}


def _formatter(renderer: Any, *, terminal: bool = False) -> logging.Formatter:
    return structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _tidy_for_terminal if terminal else _lead_keys,
            structlog.processors.format_exc_info,
            renderer,
        ],
        foreign_pre_chain=_PRE_CHAIN,
    )


def _json() -> Any:
    return structlog.processors.JSONRenderer(default=str)


def resolve_format(fmt: str, is_tty: bool | None = None) -> str:
    """``auto`` -> ``console`` on a terminal, ``json`` otherwise; the others as they are."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown log format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "auto":
        tty = sys.stderr.isatty() if is_tty is None else is_tty
        return "console" if tty else "json"
    return fmt


def setup(
    fmt: str = "auto",
    *,
    stderr: bool = True,
    file: Path | None = None,
    level: str = "info",
) -> None:
    """Send cleanroom's logs to stderr (``fmt``) and/or a JSON Lines ``file``. Idempotent."""
    logger = logging.getLogger(LOGGER_NAME)
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"unknown log level {level!r}")
    for handler in [h for h in logger.handlers if getattr(h, _OURS, False)]:
        logger.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = []
    if stderr:
        handlers.append(_Stderr())
        if resolve_format(fmt) == "console":
            console = structlog.dev.ConsoleRenderer(
                colors=sys.stderr.isatty(), sort_keys=False, pad_event_to=18
            )
            handlers[-1].setFormatter(_formatter(console, terminal=True))
        else:
            handlers[-1].setFormatter(_formatter(_json()))
    if file is not None:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            handlers.append(logging.FileHandler(file, encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot open the log file {file}: {exc}") from exc
        handlers[-1].setFormatter(_formatter(_json()))
    for handler in handlers:
        setattr(handler, _OURS, True)
        logger.addHandler(handler)
    logger.setLevel(numeric)
    logger.propagate = False


def close() -> None:
    """Remove the sinks ``setup()`` installed (flushes and closes the log file); the
    ``cleanroom`` logger propagates to the root logger again."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if getattr(h, _OURS, False)]:
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = True


def get_logger(**bound: Any) -> structlog.stdlib.BoundLogger:
    """A structlog logger writing through the ``cleanroom`` stdlib logger, with ``bound`` keys."""
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(LOGGER_NAME),
        processors=[*_PRE_CHAIN, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    return logger.bind(**bound) if bound else logger


class EventLogger:
    """A controller event hook that logs each lifecycle step with its ids bound."""

    def __init__(self) -> None:
        self._log = get_logger()
        self._run_id: str | None = None
        self._lock = threading.Lock()

    def _episode(self, data: dict[str, Any]) -> structlog.stdlib.BoundLogger:
        return self._log.bind(
            run_id=self._run_id, episode_id=data.get("episode_id"), env_id=data.get("env_id")
        )

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        """Log one controller event."""
        with self._lock:
            self._handle(kind, data)

    def _handle(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "run_started":
            self._run_id = data["run_id"]
            self._log.info(
                "run started",
                run_id=self._run_id,
                episodes=data.get("total"),
                skipped=data.get("skipped"),
            )
        elif kind == "episode_started":
            self._episode(data).info("episode started", attempt=data.get("attempt"))
        elif kind == "env_ready":
            rest = {k: v for k, v in data.items() if k not in ("episode_id", "env_id")}
            self._episode(data).info("env ready", **rest)
        elif kind == "episode_finished":
            self._finished(data)
        elif kind == "alert":
            self._episode(data).error("alert", message=data.get("message"))
        elif kind == "reaped":
            self._log.warning("orphans reaped", run_id=self._run_id, **data)
        elif kind == "drift_refused":
            self._episode(data).error("baseline drift refused", **data)
        elif kind in ("template_building", "template_built", "template_failed"):
            self._log.info(kind.replace("_", " "), run_id=self._run_id, **data)
        elif kind == "run_finished":
            self._log.info("run finished", run_id=data.get("run_id"), status=data.get("status"))
        else:
            self._log.debug(kind, run_id=self._run_id, **data)

    def _finished(self, data: dict[str, Any]) -> None:
        log = self._episode(data)
        absent = data.get("confirmed_absent")
        if absent is False:
            log.error("env NOT confirmed absent after its cleanup window")
        outcome = data.get("outcome")
        (log.info if outcome in ("completed", "episode_error", "timeout") else log.warning)(
            "episode finished",
            attempt=data.get("attempt"),
            outcome=outcome,
            reward=data.get("reward"),
            error=data.get("error"),
            cleanup_ms=_round(data.get("cleanup_ms")),
            confirmed_absent=absent,
            destroy_attempts=data.get("destroy_attempts"),
            timings=data.get("timings"),
        )


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value
