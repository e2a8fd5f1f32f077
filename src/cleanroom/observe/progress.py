"""Live progress of a run (and of a baseline build) on the terminal.

On a TTY: a rich progress bar with done / running / queued / failed counts, envs alive and an
ETA. In CI (``CI=true``) or when stderr is not a terminal: nothing animated, one plain line per
event — or none at all with ``lines=False`` (when the structured logs already go to stderr).
"Envs alive" counts environments not yet confirmed absent: one per running episode, plus any that
outlived its cleanup window.
"""

from __future__ import annotations

import os
import time
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

FAILED = {"episode_error", "timeout", "cancelled", "env_crashed", "infra_error", "export_failed"}


class RunProgress:
    """Receives controller events; renders them live or as plain lines."""

    def __init__(self, console: Console, *, lines: bool = True) -> None:
        self.console = console
        self.live = console.is_terminal and os.environ.get("CI", "").lower() not in ("1", "true")
        self.lines = lines
        self.total = self.done = self.running = self.failed = self.alive = 0
        self._progress: Progress | None = None
        self._task: Any = None
        self._start = time.monotonic()

    def __enter__(self) -> RunProgress:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]episodes"),
                BarColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("starting", total=None)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def build_step(self, step: str, detail: str) -> None:
        """Progress callback of a baseline build."""
        self.console.print(f"[dim]baseline[/] {step}: {detail}", highlight=False)

    @property
    def queued(self) -> int:
        return max(self.total - self.done - self.running, 0)

    def describe(self) -> str:
        """The counts line: done, running, queued, failed, envs alive."""
        return (
            f"{self.done}/{self.total} done · {self.running} running · {self.queued} queued · "
            f"{self.failed} failed · {self.alive} envs alive"
        )

    def _say(self, text: str) -> None:
        """A line shown even with ``lines=False``: something the logs do not make plain."""
        console = self._progress.console if self._progress is not None else self.console
        console.print(text, highlight=False)

    def _line(self, text: str) -> None:
        if not self.lines:
            return
        elapsed = time.monotonic() - self._start
        self.console.print(f"[dim]{elapsed:7.1f}s[/] {text}", highlight=False)

    def _refresh(self) -> None:
        if self._progress is not None:
            self._progress.update(
                self._task, total=self.total, completed=self.done, description=self.describe()
            )

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "run_started":
            self.total = data["total"]
            skipped = f" ({data['skipped']} already durable, skipped)" if data["skipped"] else ""
            self._line(f"run {data['run_id']}: {self.total} episodes{skipped}")
        elif kind == "episode_started":
            self.running += 1
            self.alive += 1
            if not self.live:
                self._line(
                    f"start  {data['episode_id']} (attempt {data['attempt']}) on {data['env_id']}"
                )
        elif kind == "episode_finished":
            self.running -= 1
            self.done += 1
            self.failed += data["outcome"] in FAILED
            self.alive -= data.get("confirmed_absent") is not False
            reward = "" if data.get("reward") is None else f" reward={data['reward']:g}"
            cleanup = (
                ""
                if data.get("cleanup_ms") is None
                else f" destroyed in {data['cleanup_ms']:.0f} ms"
            )
            line = f"{data['outcome']:<13} {data['episode_id']}{reward}{cleanup}"
            if data.get("error") and data["outcome"] != "completed":
                line += f" [dim]({str(data['error'])[:120]})[/]"
            if self._progress is not None and self.lines:
                self._progress.console.print(line, highlight=False)
            else:
                self._line(line)
        elif kind == "alert":
            self._line(f"[bold red]ALERT[/] {data['message']}")
        elif kind == "template_building":
            self._say(
                f"building snapshot template for {data['baseline']} ({data['digest'][:19]}) "
                "(first run only; the first episodes wait for it)"
            )
        elif kind == "template_built":
            self._say(f"snapshot template for {data['baseline']} ready in {data['seconds']:.1f} s")
        elif kind == "template_failed":
            why = escape(str(data["error"]))
            self._say(f"[yellow]{why}[/] (with start=auto, envs of {data['baseline']} boot cold)")
        elif kind == "run_finished" and not self.live:
            self._line(self.describe())
        self._refresh()
