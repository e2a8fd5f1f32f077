"""The command line, end to end with the fake driver (real agent, real controller, no VM)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cleanroom.host import hostproc
from cleanroom.ledger import Ledger

from .checks.test_repro import baseline_running
from .conftest import TINY_ENTRY, make_fake_baseline


def cli(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CLEANROOM_HOME": str(home), "CI": "true"}
    return subprocess.run(
        [sys.executable, "-m", "cleanroom", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def write(path: Path, *items: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


def ep(eid: str, seed: int = 1, **task: object) -> dict[str, object]:
    return {"episode_id": eid, "seed": seed, "policy": {"id": "p"}, "task": task}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path


def test_run_status_inspect(home: Path) -> None:
    baseline = make_fake_baseline(home)
    manifests = write(home / "m.jsonl", ep("a", 2), ep("b", 4, mode="fail"))
    proc = cli(
        home,
        "run",
        str(manifests),
        "--baseline",
        baseline.digest[:19],
        "--driver",
        "fake",
        "--run-id",
        "r1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "completed" in proc.stdout and "episode_error" in proc.stdout
    status = cli(home, "status", "r1")
    assert status.returncode == 0 and "episode_error" in status.stdout
    record = json.loads(cli(home, "inspect", "a", "--run-id", "r1").stdout)
    assert record["reward"] == 1.0 and record["provenance"]["baseline"] == baseline.digest
    assert cli(home, "status", "nope").returncode == 2


def test_bad_manifest_is_exit_2_and_nothing_runs(home: Path) -> None:
    baseline = make_fake_baseline(home)
    manifests = home / "m.jsonl"
    manifests.write_text('{"episode_id": "a", "seed": -3, "policy": {"id": "p"}}\n')
    proc = cli(home, "run", str(manifests), "--baseline", baseline.digest, "--driver", "fake")
    assert proc.returncode == 2
    assert "line 1: seed" in proc.stderr
    assert not (home / "ledger.db").exists() or Ledger(home / "ledger.db").list_runs() == []


def test_values_json_cannot_carry_are_exit_2_with_line_and_field(home: Path) -> None:
    """A 5000-digit seed and a 100k-deep task printed a raw traceback (exit 1); NaN in a task
    passed and failed every export. All are refused up front, nothing runs (issue 15 §9)."""
    baseline = make_fake_baseline(home)
    manifests = home / "m.jsonl"
    head = '{"episode_id": "e%d", "policy": {"id": "p"}, '
    manifests.write_text(
        head % 1 + '"seed": ' + "9" * 5000 + "}\n"
        + head % 2 + '"seed": 1, "task": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
        + head % 3 + '"seed": 1, "task": {"x": NaN}}\n'
    )  # fmt: skip
    proc = cli(home, "run", str(manifests), "--baseline", baseline.digest, "--driver", "fake")
    assert proc.returncode == 2, proc.stderr
    for problem in ("line 1: seed", "line 2: task: nested", "line 3: task.x: nan"):
        assert problem in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (home / "ledger.db").exists() or Ledger(home / "ledger.db").list_runs() == []


def test_unknown_baseline_is_a_clean_error(home: Path) -> None:
    manifests = write(home / "m.jsonl", ep("a"))
    proc = cli(home, "run", str(manifests), "--baseline", "sha256:" + "ab" * 32, "--driver", "fake")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "error" in proc.stderr


def test_ctrl_c_destroys_everything_and_exits_130(home: Path) -> None:
    baseline = make_fake_baseline(home)
    manifests = write(home / "m.jsonl", *[ep(f"s{i}", mode="sleep", seconds=120) for i in range(3)])
    env = {**os.environ, "CLEANROOM_HOME": str(home), "CI": "true"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cleanroom",
            "run",
            str(manifests),
            "--baseline",
            baseline.digest,
            "--driver",
            "fake",
            "--run-id",
            "rc",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if (home / "ledger.db").exists():
            with Ledger(home / "ledger.db") as ledger:
                if len([e for e in ledger.envs(run_id="rc") if e.ready_at]) == 2:
                    break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    with Ledger(home / "ledger.db") as ledger:
        envs = ledger.envs(run_id="rc")
        outcomes = [r.outcome for r in ledger.episodes("rc") if r.outcome]
    assert len(envs) == 2 and all(e.confirmed_absent_at for e in envs)
    assert outcomes == ["cancelled", "cancelled"]
    assert not any(hostproc.pids_with_marker(e.env_id) for e in envs)


def test_reap_with_nothing_to_do(home: Path) -> None:
    proc = cli(home, "reap", "--driver", "fake")
    assert proc.returncode == 0 and "nothing to reap" in proc.stdout


def test_secrets_from_a_file_are_delivered_and_redacted(home: Path) -> None:
    baseline = make_fake_baseline(home)
    value = "file-secret-0123456789"
    (home / "vault.env").write_text(f"API_KEY={value}\n")
    manifests = write(
        home / "m.jsonl", {**ep("a", mode="leak", secret="API_KEY"), "secrets": ["API_KEY"]}
    )
    proc = cli(
        home,
        "run",
        str(manifests),
        "--baseline",
        baseline.digest,
        "--driver",
        "fake",
        "--run-id",
        "rs",
        "--secrets-from",
        f"file:{home / 'vault.env'}",
    )
    assert proc.returncode == 0, proc.stderr
    assert value not in proc.stdout + proc.stderr
    record = json.loads(cli(home, "inspect", "a", "--run-id", "rs").stdout)
    assert record["info"]["file_matches"] is True
    assert record["secrets"]["redactions"]["API_KEY"] >= 4


LEAK_AND_FAIL = """
import os, sys
print("starting", file=sys.stderr)
print("\\x1b[31mfatal: key " + os.environ["API_KEY"] + " refused\\x1b[0m", file=sys.stderr)
sys.exit(4)
"""


def test_the_summary_says_why_each_episode_failed_and_fail_on_sets_the_exit(home: Path) -> None:
    """Protects the newcomer's first failed batch: each failed episode shows its last stderr
    line (redacted, control characters dropped); every episode failing adds a hint;
    ``--fail-on`` turns chosen outcomes into exit 1 (the default stays 0 for them)."""
    baseline = baseline_running(home, LEAK_AND_FAIL)
    value = "file-secret-0123456789"
    (home / "vault.env").write_text(f"API_KEY={value}\n")
    manifests = write(home / "m.jsonl", *[{**ep(e), "secrets": ["API_KEY"]} for e in "ab"])
    args = ["run", str(manifests), "--baseline", baseline.digest, "--driver", "fake"]
    args += ["--secrets-from", f"file:{home / 'vault.env'}"]
    proc = cli(home, *args, "--run-id", "rf")
    assert proc.returncode == 0, proc.stderr  # episode_error is final: not a failed run
    assert "failed episodes (2 of 2):" in proc.stdout
    assert "a  episode_error  entrypoint failed (exit code 4)" in proc.stdout, proc.stdout
    assert "stderr: [31mfatal: key [REDACTED:API_KEY] refused [0m" in proc.stdout
    assert value not in proc.stdout + proc.stderr and "\x1b" not in proc.stdout
    assert "hint: every episode failed; look at one with `cleanroom inspect a --run-id rf`" in (
        proc.stdout
    )
    assert "/episodes/a/attempts/1/logs/stderr.log" in proc.stdout
    failing = cli(home, *args, "--run-id", "rf2", "--fail-on", "timeout,episode_error")
    assert failing.returncode == 1, failing.stderr
    bad = cli(home, *args, "--fail-on", "episode-error")
    assert bad.returncode == 2 and "--fail-on: unknown outcome(s) episode-error" in bad.stderr


def test_a_partly_failed_batch_lists_the_failure_without_the_hint(home: Path) -> None:
    baseline = make_fake_baseline(home)
    manifests = write(home / "m.jsonl", ep("ok", 2), ep("bad", 4, mode="fail"))
    proc = cli(home, "run", str(manifests), "--baseline", baseline.digest, "--driver", "fake")
    assert proc.returncode == 0, proc.stderr
    assert "failed episodes (1 of 2):" in proc.stdout
    assert "stderr: tiny: failing on purpose (bad)" in proc.stdout
    assert "hint:" not in proc.stdout


def test_ps_lists_a_live_group_snapshot_and_whether_its_files_exist(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with Ledger(home / "ledger.db") as ledger:
        for sid in ("snap-with-files", "snap-files-gone", "snap-deleted"):
            ledger.snapshot_intent(
                sid,
                run_id="r1",
                group_id="g1",
                driver="qemu",
                setup_digest="sha256:s",
                owner_controller="c",
                owner_pid=os.getpid(),
                owner_host="h",
            )
        ledger.snapshot_deleted("snap-deleted", confirmed_absent=True)
    (home / "forks" / "snap-with-files").mkdir(parents=True)
    result = cli(home, "ps")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if "snap-" in line}
    assert set(lines) == {"snap-with-files", "snap-files-gone"}  # the deleted one is not live
    assert "yes" in lines["snap-with-files"] and "no" in lines["snap-files-gone"]
    assert "g1" in lines["snap-with-files"]


def test_ps_names_a_spare_vm_that_no_ledger_row_names_yet(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for env_id, labels in (("env-spare1", {"spare": "true"}), ("env-stray1", {})):
        folder = home / "run" / "qemu" / env_id
        folder.mkdir(parents=True)
        owner = {"env_id": env_id, "pid": 4242, "created_at": time.time() - 100, "labels": labels}
        (folder / "owner.json").write_text(json.dumps(owner))
    result = cli(home, "ps")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if "env-" in line}
    assert "(spare, not in ledger)" in lines["env-spare1"] and "4242" in lines["env-spare1"]
    assert "(not in ledger)" in lines["env-stray1"] and "spare" not in lines["env-stray1"]
    assert re.search(r" 1\d\ds ", lines["env-spare1"])  # its age, from its owner record


def test_run_prints_one_line_per_group(home: Path) -> None:
    baseline = make_fake_baseline(home)
    ok = {"id": "g1", "setup": {"command": [sys.executable, "-c", "pass"], "timeout_s": 30}}
    bad = {"id": "g2", "setup": {"command": [sys.executable, "-c", "raise SystemExit(4)"]}}
    manifests = write(
        home / "m.jsonl",
        {**ep("a", 1), "group": ok},
        {**ep("b", 2), "group": ok},
        {**ep("c", 3), "group": bad},
    )
    proc = cli(home, "run", str(manifests), "--baseline", baseline.digest, "--driver", "fake")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("group ")]
    assert lines[0].startswith("group g1: setup in each of its 2 episodes"), proc.stdout
    assert lines[0].endswith("2 completed"), proc.stdout
    assert lines[1].startswith("group g2: setup in each of its 1 episodes")
    assert lines[1].endswith("1 infra_error"), proc.stdout
    assert proc.returncode == 1  # g2's episode did not reach a final outcome


def test_resume_with_another_baseline_needs_the_flag(home: Path) -> None:
    """A resume on another baseline is refused (exit 2, naming both) unless
    ``--allow-baseline-change`` asks for it; then it runs and the ledger records the change."""
    first = make_fake_baseline(home)
    (home / "entry" / "entry.py").unlink()  # the first baseline keeps its own hard link
    other_script = home / "other_entry.py"
    other_script.write_text(TINY_ENTRY.read_text() + "\n# another baseline\n")
    second = make_fake_baseline(home, script=other_script)
    assert second.digest != first.digest
    manifests = write(home / "m.jsonl", ep("a"), ep("b", mode="fail"))
    args = ["run", str(manifests), "--driver", "fake", "--run-id", "rb"]
    assert cli(home, *args, "--baseline", first.digest).returncode == 0
    refused = cli(home, *args, "--baseline", second.digest)
    assert refused.returncode == 2 and "baseline" in refused.stderr.lower(), refused.stderr
    allowed = cli(home, *args, "--baseline", second.digest, "--allow-baseline-change")
    assert allowed.returncode == 0, allowed.stderr
    with Ledger(home / "ledger.db") as ledger:
        assert ledger.events("rb", "run_baseline_changed")
