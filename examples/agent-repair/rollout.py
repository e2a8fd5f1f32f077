"""agent-repair: a scripted agent fixes a small repository in a cleanroom session, a verifier
judges its patch in a fresh env of its own, and N such rollouts run in parallel.

    python examples/agent-repair/rollout.py --n 8            # from the repository root
    python examples/agent-repair/rollout.py --n 8 --branch 4 # and one rollout that branches

The agent stands in for an LLM policy outside the VM: it reads the buggy file, runs the public
tests, writes a patch, runs them again (each a step of the session's transcript). Its edit is
chosen by the rollout's seed from four plausible fixes, two right and two wrong-but-passing, so
the rewards differ. The verifier is a second session on the same pristine baseline: the patched
file and the hidden tests (``code-repair/tests/``, never in any rollout's env) go in, the
fraction of hidden tests passing comes out and becomes the rollout's reward.

With ``--branch K`` one more rollout (``tree-N``) shares its first steps and then branches: its
session (``forkable=True``) reads the file and runs the public tests once, ``sb.fork(K)``
restores K sessions from that exact state (tree search, GRPO from a shared prefix), and each
branch's agent (seed 0, 1, ...: each a different fix) patches, retests and is judged on its own.
The branches are episodes of the parent's run (``tree-N.b1`` ...), their records name the parent
and the step they branched at; the parent's reward is the best branch's.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import re
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import cleanroom as cr

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "baseline.toml"
HIDDEN = HERE.parent / "code-repair" / "tests" / "test_hidden.py"  # the batch example's repo
FILE = "/repo/calc/stats.py"
PUBLIC = "cd /repo && python3 -m unittest discover -s tests 2>&1"
BUG = "    s = sorted(xs)\n    return s[len(s) // 2]\n"
FIXES = {  # name -> the body an LLM might write (two right, two wrong but passing public tests)
    "sort-and-average": (
        '    if not xs:\n        raise ValueError("median of empty data")\n    s = sorted(xs)\n'
        "    mid = len(s) // 2\n    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2\n"
    ),
    "average-unsorted": (
        "    s = sorted(xs)\n    mid = len(s) // 2\n"
        "    return s[mid] if len(s) % 2 else (xs[mid - 1] + xs[mid]) / 2\n"
    ),
    "index-formula": (
        '    if not xs:\n        raise ValueError("median of empty data")\n    s = sorted(xs)\n'
        "    n = len(s)\n    return (s[(n - 1) // 2] + s[n // 2]) / 2\n"
    ),
    "sort-in-place": (
        "    xs.sort()\n    mid = len(xs) // 2\n"
        "    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2\n"
    ),
}


class ScriptedAgent:
    """The policy: given the file and the failing test output, an edited file."""

    def __init__(self, seed: int) -> None:
        self.fix = sorted(FIXES)[seed % len(FIXES)]

    def edit(self, source: str, test_output: str) -> str:
        assert "median" in test_output or "FAIL" in test_output, test_output
        return source.replace(BUG, FIXES[self.fix])


async def verify(rollout: str, patched: str, driver: str) -> tuple[float, str]:
    """The hidden tests on the patched file, in a fresh env: (fraction passed, their output)."""
    async with cr.session(
        BASELINE,
        episode_id=f"{rollout}-verifier",
        policy={"id": "verifier", "version": "1"},
        task={"judges": rollout},
        driver=driver,
    ) as v:
        await v.files.write(FILE, patched)
        await v.files.write("/repo/test_hidden.py", HIDDEN.read_text())
        r = await v.commands.run("cd /repo && python3 -m unittest -v test_hidden 2>&1")
        results = re.findall(r"\.\.\. (ok|FAIL|ERROR)$", r.stdout, re.MULTILINE)
        score = results.count("ok") / len(results) if results else 0.0
        v.finish(reward=score, info={"passed": results.count("ok"), "tests": len(results)})
    return score, r.stdout


async def repair(
    sb: Any, agent: ScriptedAgent, source: str, before: Any, driver: str
) -> dict[str, Any]:
    """The agent's steps after the first test run: patch, retest, judged by a verifier; the
    session finishes with the verifier's score as its reward."""
    name = sb.episode.key.episode_id
    patched = agent.edit(source, before.stdout)
    await sb.files.write(FILE, patched)
    diff = "".join(
        difflib.unified_diff(
            source.splitlines(True), patched.splitlines(True), "a" + FILE, "b" + FILE
        )
    )
    await sb.files.write("/repo/patch.diff", diff)
    after = await sb.commands.run(PUBLIC)
    score, _ = await verify(name, patched, driver)
    sb.finish(
        reward=score,
        info={"fix": agent.fix, "public_before": before.exit_code, "public": after.exit_code},
        artifacts=["/repo/patch.diff"],
    )
    return {
        "rollout": name,
        "fix": agent.fix,
        "public_tests_before": before.exit_code,
        "public_tests_after": after.exit_code,
        "reward": score,
    }


def ended(row: dict[str, Any], sb: Any) -> dict[str, Any]:
    """A rollout's row once its session closed: its run and outcome."""
    return {**row, "run_id": sb.episode.key.run_id, "outcome": sb.episode.result.outcome.value}


def opened(seed: int, name: str, driver: str, **options: Any) -> Any:
    """A rollout's session (the agent's policy and task named in its record)."""
    return cr.session(
        BASELINE,
        seed=seed,
        episode_id=name,
        policy={"id": "scripted-agent", "version": "1"},
        task={"repo": "calc", "file": FILE},
        driver=driver,
        timeout_s=600,
        idle_timeout_s=300,
        **options,
    )


async def rollout(seed: int, driver: str) -> list[dict[str, Any]]:
    """One rollout: its own session (VM, run, record, transcript), judged by a verifier."""
    async with opened(seed, f"repair-{seed}", driver) as sb:
        source = (await sb.files.read(FILE)).decode()
        before = await sb.commands.run(PUBLIC)
        row = await repair(sb, ScriptedAgent(seed), source, before, driver)
    return [ended(row, sb)]


async def branched(seed: int, ways: int, driver: str) -> list[dict[str, Any]]:
    """A rollout that reads and tests once, then branches ``ways`` ways from that state; each
    branch (its own agent, a fix of its own) patches, retests and is judged. Its rows: the
    branches', then the parent's (reward: the best branch's)."""
    async with opened(seed, f"tree-{seed}", driver, forkable=True) as sb:
        source = (await sb.files.read(FILE)).decode()
        before = await sb.commands.run(PUBLIC)

        async def branch(session: Any, index: int) -> dict[str, Any]:
            async with session:
                row = await repair(session, ScriptedAgent(index), source, before, driver)
            return ended(row, session)

        rows = await asyncio.gather(*(branch(b, i) for i, b in enumerate(await sb.fork(ways))))
        best = max(rows, key=lambda row: row["reward"])
        sb.finish(reward=best["reward"], info={"branches": len(rows), "best": best["rollout"]})
    parent = {
        "rollout": sb.episode.key.episode_id,
        "fix": f"{ways} branches",
        "public_tests_before": before.exit_code,
        "public_tests_after": "-",  # the parent patched nothing: its branches did
        "reward": best["reward"],
    }
    return [*rows, ended(parent, sb)]


async def main(n: int, driver: str, parallel: int, ways: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(parallel)

    async def limited(job: Awaitable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        async with gate:
            return await job

    jobs = [rollout(seed, driver) for seed in range(n)]
    if ways:
        jobs.append(branched(n, ways, driver))
    return [row for rows in await asyncio.gather(*(limited(j) for j in jobs)) for row in rows]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="rollouts")
    parser.add_argument("--parallel", type=int, default=8, help="rollouts at once")
    parser.add_argument("--branch", type=int, default=0, help="one more rollout, branched K ways")
    parser.add_argument("--driver", default="qemu", help="qemu | gvisor (gvisor cannot branch)")
    args = parser.parse_args()
    started = time.monotonic()
    rows = asyncio.run(main(args.n, args.driver, args.parallel, args.branch))
    for row in rows:
        print(
            f"{row['rollout']:<10} {row['fix']:<17} public {row['public_tests_before']}->"
            f"{row['public_tests_after']}  reward {row['reward']:.3f}  {row['outcome']}  "
            f"(cleanroom inspect {row['rollout']} --run-id {row['run_id']})"
        )
    tree = f" and one branched {args.branch} ways" if args.branch else ""
    print(f"{args.n} rollouts{tree} in {time.monotonic() - started:.1f}s")
