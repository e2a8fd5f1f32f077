"""A/B runs of a benchmark across two source trees, in one command.

``rounds(script_argv, ref_src, new_src, n)`` runs the benchmark script ``n`` times under each
tree (``PYTHONPATH`` set to that tree's ``src/``), alternating which goes first, so the load
of this shared machine hits both alike; each run writes its results as JSON to the file named
by the ``--json`` argument added here. Yields ``(label, results)``, label "ref" or "new".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def rounds(
    script_argv: list[str], ref_src: Path, new_src: Path, n: int
) -> Iterator[tuple[str, Any]]:
    trees = {"ref": str(ref_src), "new": str(new_src)}
    for i in range(n):
        for label, src in trees.items() if i % 2 == 0 else reversed(trees.items()):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                env = {**os.environ, "PYTHONPATH": src}
                subprocess.run([*script_argv, "--json", out.name], env=env, check=True)
                yield label, json.loads(Path(out.name).read_text())
            print(f"round {i + 1}/{n} {label} done", file=sys.stderr)
