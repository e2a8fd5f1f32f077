"""``bench/stats.py``: the one place the benchmarks take a p50, a same-run ratio and a timing.

Protects: ``bench/mux.py`` and ``bench/native.py`` print their "row / reference" lines through
``Table.ratio_row`` (p50 over the reference's p50, the median of an even count interpolated as
``statistics.median`` did, two decimals, aligned under the table's names as their own loops
were), ``timed`` awaits the step it times, and ``parser`` gives a script its ``--runs`` and
``--out``. No timing is asserted.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _stats() -> ModuleType:
    """``bench/stats.py`` as the scripts import it (from its folder), without touching sys.path."""
    spec = importlib.util.spec_from_file_location("bench_stats", ROOT / "bench" / "stats.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_a_ratio_is_p50_over_the_references_p50() -> None:
    stats = _stats()
    assert stats.p50([0.4, 0.1, 0.2, 0.3]) == 0.25  # an even count: the middle two's mean
    assert stats.ratio([3.0, 1.0, 2.0], [4.0, 0.0]) == 1.0
    assert stats.ratio([9.0, 3.0, 6.0], [2.0]) == 3.0


def test_a_ratio_row_lines_up_under_the_table_names() -> None:
    stats = _stats()
    mux = stats.Table(("n", "p50"), name_width=34)  # as bench/mux.py's table
    assert mux.ratio_row("exec `true`", [0.3, 0.1, 0.2], [0.1]) == f"  {'exec `true`':<32} 2.00"
    native = stats.Table(("n", "p50"), name_width=40)  # as bench/native.py's
    assert native.ratio_row("command episode", [1.0], [3.0]) == f"  {'command episode':<38} 0.33"


def test_timed_awaits_its_step() -> None:
    stats = _stats()
    ran: list[bool] = []

    async def step() -> None:
        await asyncio.sleep(0)
        ran.append(True)

    seconds = asyncio.run(stats.timed(step))
    assert ran == [True] and isinstance(seconds, float) and seconds >= 0


def test_a_scripts_parser_has_its_runs_and_result_file() -> None:
    """Protects: ``stats.parser`` gives mux/native their ``--runs`` default and write their
    results under ``bench/results/`` unless ``--out`` says otherwise."""
    stats = _stats()
    parser = stats.parser("The bench.\n\nMore.", "mux.txt", runs=10)
    assert parser.description == "The bench."
    args = parser.parse_args([])
    assert (args.runs, args.out) == (10, ROOT / "bench" / "results" / "mux.txt")
    args = parser.parse_args(["--runs", "3", "--out", "/tmp/x.txt"])
    assert (args.runs, args.out) == (3, Path("/tmp/x.txt"))
