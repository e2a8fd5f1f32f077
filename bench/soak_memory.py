"""Where the soak's controller memory goes: a shorter soak under ``tracemalloc``.

    python bench/soak_memory.py --seed 7 --episodes 2000 [--out bench/results/soak-memory.txt]

The soak (``bench/soak.py``, fake driver, each kind of round once first) runs with every
Python allocation traced. After each round, once every kind of round has run (the soak's
warm-up), this process's RSS and the bytes
Python holds (traced) are sampled; a snapshot is taken after the warm-up and one at the end,
and the report lists the source lines whose live bytes grew most between them. A leak (a dict
or list that grows per episode, a cache without bounds) shows as a line whose growth scales
with the episodes run; warm-up and allocator effects show as RSS growth the traced bytes do not
have. Each sample and snapshot follows a ``gc.collect()``: live bytes only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak

TOP = 15


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tracemalloc.start(1)
    traced: list[int] = []
    snaps: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="cleanroom-soak-mem-") as tmp:
        run = soak.Soak(args.seed, args.episodes, "fake", Path(tmp), every_kind=True)
        settle = run.settle

        async def sampled(run_id: str, items: list[dict[str, Any]]) -> None:
            await settle(run_id, items)
            gc.collect()  # live bytes, not cyclic garbage the collector has not reached yet
            traced.append(tracemalloc.get_traced_memory()[0])
            if not snaps and run.tally.rss:  # the first sample: warmed up
                snaps.append(tracemalloc.take_snapshot())

        run.settle = sampled  # type: ignore[method-assign,assignment]
        tally = asyncio.run(run.run(progress=True))
        gc.collect()
        snaps.append(tracemalloc.take_snapshot())
    lines = [soak.report(tally, args.seed, "fake").rstrip()]
    rss = soak.flat_growth(tally.rss)
    kept = traced[-len(tally.rss) :] if tally.rss else traced
    py = soak.flat_growth(kept)
    lines.append(
        f"  traced Python bytes: first {kept[0] if kept else 0}, last {kept[-1] if kept else 0}, "
        f"growth {py:+.1%}"
        if py is not None
        else "  traced Python bytes: n/a (few rounds)"
    )
    if rss is not None and py is not None:
        lines.append(f"  RSS growth {rss:+.1%} vs Python's own live bytes {py:+.1%}")
    filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
    diff = (
        snaps[-1].filter_traces(filters).compare_to(snaps[0].filter_traces(filters), "lineno")
        if len(snaps) == 2
        else []
    )
    lines.append(f"  top {TOP} lines by live bytes grown from the warm-up to the end:")
    lines += [f"    {stat}" for stat in diff[:TOP]]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
