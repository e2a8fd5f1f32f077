"""What every durable result record must say about where it came from.

``REQUIRED`` lists dotted paths into a record (``provenance.baseline``,
``timings.phases.run.start``...); ``missing(record)`` names those absent or empty. The test suite
checks every record of a run against it, with the fake driver and on a real VM, and
``summary(record)`` gives the flat view ``cleanroom check provenance`` prints.
"""

from __future__ import annotations

from typing import Any

PHASES = ("queue", "provision", "run", "verify", "export")
"""Phases that end before the record is written, in order (``verify`` only with a verifier;
destroy comes after the record: see ``destroy.json``)."""

REQUIRED: tuple[str, ...] = (
    "episode_id",
    "run_id",
    "seed",
    "policy.id",
    "provenance.baseline",
    "provenance.spec_digest",
    "provenance.kernel",
    "provenance.agent_version",
    "provenance.cleanroom_version",
    "provenance.cleanroom_revision",
    "provenance.driver",
    "provenance.accelerator",
    "provenance.accelerator_version",
    "provenance.isolation",
    "provenance.host.hostname",
    "provenance.manifest_digest",
    "provenance.env_id",
    "timings.started_at",
    "timings.ended_at",
    *(f"timings.phases.{phase}.{end}" for phase in PHASES for end in ("start", "end")),
)
"""Every field a record must carry (``timings.phases.verify.*`` only when it has a verdict)."""
OPTIONAL = ("provenance.agent_sha256",)
"""Fields shown when present: the native agent binary's sha256 (a Python-agent baseline's
agent files are covered by its spec digest)."""

JAIL_REQUIRED = ("identity",)
QEMU_JAIL_REQUIRED = ("user", "seccomp", "limits", "enforced")
"""``provenance.jail``, where a driver records one: what names the env's processes; for qemu
also who QEMU ran as (``UID:GID``, or why it had no jail), its seccomp policy, its cgroup
limits and where they were enforced (``uid``, ``gid`` and ``chroot`` come with a jail)."""

GROUP_REQUIRED = ("id", "mode", "setup_digest")
GROUP_FORK_REQUIRED = ("snapshot", "digest", "snapshot_id", "parent_env")
"""A group episode's ``provenance.group`` fields (and, forked, which warm state it came from)."""


def lookup(record: dict[str, Any], path: str) -> Any:
    """The value at a dotted path, or None."""
    value: Any = record
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def phases(record: dict[str, Any]) -> list[str]:
    """The phases this record must have spans for, in order."""
    return [p for p in PHASES if p != "verify" or record.get("verdict") is not None]


def required(record: dict[str, Any]) -> list[str]:
    """``REQUIRED`` as it applies to this record (plus ``provenance.group`` in a group)."""
    skip = "" if "verify" in phases(record) else "timings.phases.verify."
    out = [p for p in REQUIRED if not (skip and p.startswith(skip))]
    if lookup(record, "provenance.jail") is not None:
        fields: tuple[str, ...] = JAIL_REQUIRED
        if lookup(record, "provenance.driver") == "qemu":
            fields += QEMU_JAIL_REQUIRED
        out += [f"provenance.jail.{name}" for name in fields]
    if record.get("group") is not None:
        forked = lookup(record, "provenance.group.mode") == "fork"
        fields = GROUP_REQUIRED + (GROUP_FORK_REQUIRED if forked else ())
        out += [f"provenance.group.{name}" for name in fields]
    return out


def missing(record: dict[str, Any]) -> list[str]:
    """The required fields that are absent, None or empty in ``record``."""
    return [p for p in required(record) if lookup(record, p) in (None, "", [], {})]


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """Every required field with its value (None when missing), in ``REQUIRED`` order, then
    the ``OPTIONAL`` ones the record has."""
    out = {path: lookup(record, path) for path in required(record)}
    out.update({path: lookup(record, path) for path in OPTIONAL if lookup(record, path)})
    return out
