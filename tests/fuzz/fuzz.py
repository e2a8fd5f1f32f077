"""Coverage-guided fuzzing of one target of ``targets.py`` with atheris (libFuzzer).

    python tests/fuzz/fuzz.py TARGET [libFuzzer flags] [CORPUS_DIR ...]
    python tests/fuzz/fuzz.py --list

An untyped exception (not in ``targets.ALLOWED``, nor in ``targets.KNOWN``: owned elsewhere)
is a crash: libFuzzer writes its input (``-artifact_prefix``) and exits non-zero. ``make fuzz``
runs every target for 1,000,000 inputs; ``test_fuzz.py`` runs each briefly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

with atheris.instrument_imports(include=["cleanroom", "targets"]):
    import targets


def main() -> None:
    if sys.argv[1:] == ["--list"]:
        print(" ".join(targets.TARGETS))
        return
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: fuzz.py {{{','.join(targets.TARGETS)}}} [libFuzzer flags] [CORPUS...]")
    name = sys.argv.pop(1)
    tolerated = targets.ALLOWED[name] + targets.KNOWN.get(name, ())

    def one_input(data: bytes) -> None:
        try:  # noqa: SIM105 - the hot path: cheaper than contextlib.suppress
            targets.TARGETS[name](data)
        except tolerated:
            pass

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
