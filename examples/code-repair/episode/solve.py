"""Entrypoint of the code-repair episode: apply one candidate patch, run the public tests.

The stand-in for an agent: ``task.candidate`` (or ``seed % 4``) picks one of the candidate
edits in ``candidates/candidates.json`` -- some right, some wrong -- applies it to a copy of
``repo/``, runs the repository's public tests (``unittest``, standard library only) and
exports the changed files under ``out/files/`` and the edit as ``out/patch.json``. The reward is
the fraction of public tests that pass; whether the fix is right is the verifier's call, made
with tests this episode never sees.
"""

import io
import json
import os
import shutil
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True  # leave no caches next to the tests

HOME = os.environ.get("CODE_REPAIR_HOME", os.path.dirname(os.path.abspath(__file__)))
ROOT = os.environ.get("CLEANROOM_DIR", "/run/cleanroom")


def run_tests(repo, start):
    """Run the unittest suite under ``start`` against ``repo``; (tests run, failed test ids)."""
    sys.path.insert(0, repo)
    suite = unittest.defaultTestLoader.discover(start, top_level_dir=start)
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
    failed = sorted(test.id() for test, _ in result.failures + result.errors)
    return result.testsRun, failed


def main():
    with open(os.path.join(ROOT, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(HOME, "candidates", "candidates.json")) as f:
        candidates = json.load(f)
    task = manifest.get("task") or {}
    index = int(task.get("candidate", manifest["seed"] % len(candidates)))
    candidate = candidates[index]
    work = tempfile.mkdtemp(prefix="code-repair-")
    repo = os.path.join(work, "repo")
    shutil.copytree(os.path.join(HOME, "repo"), repo)
    target = os.path.join(repo, candidate["file"])
    with open(target) as f:
        source = f.read()
    if source.count(candidate["old"]) != 1:
        print(f"candidate {candidate['name']} does not apply", file=sys.stderr)
        return 3
    with open(target, "w") as f:
        f.write(source.replace(candidate["old"], candidate["new"]))
    run, failed = run_tests(repo, os.path.join(repo, "tests"))
    out = os.path.join(ROOT, "out")
    os.makedirs(os.path.join(out, "files", os.path.dirname(candidate["file"])), exist_ok=True)
    shutil.copyfile(target, os.path.join(out, "files", candidate["file"]))
    with open(os.path.join(out, "patch.json"), "w") as f:
        json.dump(candidate, f, indent=1, sort_keys=True)
    result = {
        "reward": (run - len(failed)) / run if run else 0.0,
        "terminated": True,
        "truncated": False,
        "info": {"candidate": candidate["name"], "index": index},
        "metrics": {"public_tests": run, "public_failed": failed},
    }
    with open(os.path.join(ROOT, "result.json"), "w") as f:
        json.dump(result, f, sort_keys=True)
    print(f"applied {candidate['name']}: {run - len(failed)}/{run} public tests pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
