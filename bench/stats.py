"""The benchmarks' result tables (p50, p95, ... of timings, in ms) and their result files.

The scripts run as ``python bench/x.py``, which puts this folder on ``sys.path``: they import
it as ``from stats import ...``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cleanroom.observe.report import percentile

RESULTS = Path(__file__).resolve().parent / "results"

_STATS: dict[str, Callable[[list[float]], float]] = {
    "p50": lambda ms: percentile(ms, 50),
    "p95": lambda ms: percentile(ms, 95),
    "p99": lambda ms: percentile(ms, 99),
    "min": min,
    "max": max,
}


def _ms(seconds: Sequence[float]) -> list[float]:
    return [v * 1000 for v in seconds]


def p50_p95(seconds: Sequence[float]) -> tuple[float, float]:
    """p50 and p95 of timings in seconds, in ms."""
    ms = _ms(seconds)
    return percentile(ms, 50), percentile(ms, 95)


def parser(doc: str, result: str, runs: int) -> argparse.ArgumentParser:
    """A script's arguments: described by its docstring's first line, ``--runs`` (``runs``
    by default) and ``--out`` (``bench/results/<result>`` by default); add more to it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--out", type=Path, default=RESULTS / result)
    return parser


def p50(seconds: Sequence[float]) -> float:
    """The median of timings, in their own unit."""
    return percentile(seconds, 50)


def ratio(seconds: Sequence[float], reference: Sequence[float]) -> float:
    """p50 of ``seconds`` over p50 of ``reference`` (a same-run reference's timings)."""
    return p50(seconds) / p50(reference)


async def timed(step: Callable[[], Awaitable[object]]) -> float:
    """Seconds one awaited ``step()`` took."""
    start = time.perf_counter()
    await step()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Table:
    """Rows of a name, then ``columns`` ("n", "p50", "p95", "p99", "min", "max") in ms."""

    columns: tuple[str, ...]
    name_width: int
    width: int = 9  # of a statistic's column
    n_width: int = 3
    unit: str = ""  # after each row's numbers

    def _width(self, column: str) -> int:
        return self.n_width if column == "n" else self.width

    def header(self, title: str) -> str:
        return " ".join(
            [f"{title:<{self.name_width}}"] + [f"{c:>{self._width(c)}}" for c in self.columns]
        )

    def row(self, name: str, seconds: Sequence[float]) -> str:
        ms = _ms(seconds)
        cells = [f"{name:<{self.name_width}}"]
        for c in self.columns:
            value = f"{len(ms)}" if c == "n" else f"{_STATS[c](ms):.1f}"
            cells.append(f"{value:>{self._width(c)}}")
        if self.unit:
            cells.append(self.unit)
        return " ".join(cells)

    def ratio_row(self, name: str, seconds: Sequence[float], reference: Sequence[float]) -> str:
        """``name`` indented, then ``ratio(seconds, reference)``, aligned under the rows."""
        return f"  {name:<{self.name_width - 2}} {ratio(seconds, reference):.2f}"


def write(out: Path, lines: list[str]) -> None:
    """Print the result lines and save them to ``out``."""
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
