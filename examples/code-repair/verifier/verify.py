"""The code-repair verifier: the episode's changed files against the hidden tests.

Runs in a fresh env of its own (the verifier baseline holds the pristine repository and the
hidden tests; the episode's baseline has neither the tests nor this script). It copies the
pristine ``repo/``, lays over it the episode's exported ``artifacts/files/`` -- only source
files that already exist outside ``tests/``: an episode cannot add or edit tests -- runs the
hidden ``unittest`` suite and writes ``$CLEANROOM_DIR/verdict.json``:
``{"pass": all tests pass, "score": fraction passed, "details": {...}}``. Deterministic: the
same files give the same verdict, byte for byte.
"""

import io
import json
import os
import shutil
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True  # leave no caches next to the tests

HOME = os.environ.get("VERIFIER_HOME", os.path.dirname(os.path.abspath(__file__)))
ROOT = os.environ.get("CLEANROOM_DIR", "/run/cleanroom")
INPUT = os.environ.get("CLEANROOM_VERIFIER_INPUT", os.path.join(ROOT, "input"))


def overlay(repo, files):
    """Copy allowed files from ``files`` into ``repo``; (applied, refused) relative names."""
    applied, refused = [], []
    for dirpath, _, filenames in os.walk(files):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), files)
            allowed = (
                rel.endswith(".py")
                and not rel.startswith(("tests/", "../"))
                and os.path.isfile(os.path.join(repo, rel))
            )
            if allowed:
                shutil.copyfile(os.path.join(dirpath, name), os.path.join(repo, rel))
            (applied if allowed else refused).append(rel)
    return sorted(applied), sorted(refused)


def main():
    work = tempfile.mkdtemp(prefix="verifier-")
    repo = os.path.join(work, "repo")
    shutil.copytree(os.path.join(HOME, "repo"), repo)
    applied, refused = overlay(repo, os.path.join(INPUT, "artifacts", "files"))
    candidate = None
    patch = os.path.join(INPUT, "artifacts", "patch.json")
    if os.path.isfile(patch):
        with open(patch) as f:
            candidate = json.load(f).get("name")
    sys.path.insert(0, repo)
    tests = os.path.join(HOME, "tests")
    suite = unittest.defaultTestLoader.discover(tests, top_level_dir=tests)
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
    failed = sorted(test.id() for test, _ in result.failures + result.errors)
    run = result.testsRun
    verdict = {
        "pass": bool(applied) and run > 0 and not failed,
        "score": (run - len(failed)) / run if run and applied else 0.0,
        "details": {
            "candidate": candidate,
            "tests": run,
            "failed": failed,
            "applied": applied,
            "refused": refused,
        },
    }
    with open(os.path.join(ROOT, "verdict.json"), "w") as f:
        json.dump(verdict, f, sort_keys=True)
    print(f"{candidate}: {run - len(failed)}/{run} hidden tests pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
