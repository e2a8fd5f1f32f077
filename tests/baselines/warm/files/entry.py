"""Function entrypoint of the ``warm`` test baseline: ``run(manifest)`` returns the result.

Imported once by the agent's warm worker (``IMPORTED_IN`` is that worker's pid); each episode
runs ``run`` in a forked child. ``manifest["task"]["mode"]``:

- ``ok`` (default): prints to stdout and stderr, writes the artifact ``out/hello.txt``, returns
  ``reward = seed * 0.5`` and facts about the process (pids, ``random.random()``, cwd, env).
- ``raise``: raises ``ValueError``.       - ``nondict``: returns a list.
- ``unjson``: returns a dict JSON cannot encode.   - ``exit``: ``sys.exit(task["code"])``.
- ``sleep``: starts ``sleep 600`` (its pid in ``$CLEANROOM_DIR/grandchild.pid``), then sleeps
  ``task["seconds"]``.
- ``leak``: prints the secret named ``task["secret"]`` everywhere, like the tiny baseline.
"""

import os
import random
import subprocess
import sys
import time

IMPORTED_IN = os.getpid()


def facts(manifest):
    return {
        "random": random.random(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "pgid": os.getpgid(0),
        "imported_in": IMPORTED_IN,
        "cwd": os.getcwd(),
        "env": sorted(os.environ),
        "episode_id": os.environ.get("CLEANROOM_EPISODE_ID"),
        "stdin": sys.stdin.read(),
    }


def run(manifest):
    root = os.environ["CLEANROOM_DIR"]
    task = manifest.get("task") or {}
    mode = task.get("mode", "ok")
    seed = manifest.get("seed", 0)
    if mode == "raise":
        raise ValueError(f"boom in {manifest['episode_id']}")
    if mode == "nondict":
        return [1, 2, 3]
    if mode == "unjson":
        return {"reward": 1.0, "info": {"when": object()}}
    if mode == "exit":
        sys.exit(task.get("code", 0))
    if mode == "sleep":
        grandchild = subprocess.Popen(["sleep", "600"])
        with open(root + "/grandchild.pid", "w") as f:
            f.write(str(grandchild.pid))
        time.sleep(float(task.get("seconds", 600)))
    if mode == "leak":
        value = os.environ.get(task["secret"], "")
        print(f"stdout leak {value}", flush=True)
        print(f"stderr leak {value}", file=sys.stderr)
        with open(root + "/out/leak.txt", "w") as f:
            f.write(f"artifact leak {value}\n")
        secret_file = root + "/secrets/" + task["secret"]
        file_value = None
        if os.path.exists(secret_file):
            with open(secret_file) as f:
                file_value = f.read()
        return {"reward": 1.0, "info": {"leak": value, "file_matches": file_value == value != ""}}
    os.makedirs(root + "/out", exist_ok=True)
    with open(root + "/out/hello.txt", "w") as f:
        f.write(f"hello from {manifest['episode_id']}\n")
    print(f"warm: stdout {manifest['episode_id']} seed={seed}")
    print(f"warm: stderr {manifest['episode_id']}", file=sys.stderr)
    return {"reward": seed * 0.5, "terminated": True, "info": facts(manifest)}
