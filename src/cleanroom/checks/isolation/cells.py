"""The verdict side of the isolation check: cells, variants, the report, and ``evaluate``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cleanroom.checks.isolation import canary as guest
from cleanroom.checks.isolation.audit import Leftover

VARIANTS = ("sequential", "concurrent", "recovery")
PASS, FAIL, BLIND, SKIP, ERROR = "PASS", "FAIL", "BLIND", "SKIP", "ERROR"
CLEANUP = "cleanup:A and B confirmed absent"
ROWS = (*guest.NAMES, CLEANUP)


@dataclass(frozen=True)
class Cell:
    status: str
    detail: str


@dataclass
class Variant:
    name: str
    token: str
    cells: dict[str, Cell] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)  # role -> env_id
    error: str | None = None
    seconds: float = 0.0


@dataclass
class IsolationReport:
    check_id: str
    driver: dict[str, str]
    baseline: str
    variants: list[Variant]
    leftovers: list[Leftover]
    seconds: float

    @property
    def ok(self) -> bool:
        bad = {FAIL, BLIND, ERROR}
        cells_ok = all(c.status not in bad for v in self.variants for c in v.cells.values())
        return cells_ok and not self.leftovers and all(v.error is None for v in self.variants)

    def to_json(self) -> dict[str, Any]:
        return {"check": "isolation", "ok": self.ok, **asdict(self)}


def _leak(name: str, planted: dict[str, Any], probe: dict[str, Any]) -> str | None:
    seen = probe.get("seen", {}).get(name)
    if seen:
        return str(seen)
    if name in guest.SYSCTLS:
        mine, theirs = planted["observed"].get(name), probe["observed"].get(name)
        if mine is not None and mine == theirs:
            return f"reads {theirs!r}, the value A set"
    return None


def evaluate(
    planted: dict[str, Any], own: dict[str, Any], probe: dict[str, Any]
) -> dict[str, Cell]:
    """The cells of one variant from A's plant and self-probe and B's probe."""
    cells: dict[str, Cell] = {}
    for name in guest.NAMES:
        if name in (guest.RANDOM, guest.BOOT_ID):
            mine, theirs = planted["observed"].get(name), probe["observed"].get(name)
            if not mine or not theirs:
                cells[name] = Cell(SKIP, "not readable")
            elif mine == theirs:
                cells[name] = Cell(FAIL, f"A and B read the same: {mine[:16]}")
            else:
                cells[name] = Cell(PASS, f"A {mine[:8]}... != B {theirs[:8]}...")
        elif name in planted.get("skipped", {}):
            cells[name] = Cell(SKIP, str(planted["skipped"][name]))
        elif name not in planted.get("planted", {}):
            cells[name] = Cell(SKIP, "not planted")
        elif (leak := _leak(name, planted, probe)) is not None:
            cells[name] = Cell(FAIL, f"B sees it: {leak}")
        elif _leak(name, planted, own) is None:
            cells[name] = Cell(BLIND, "A cannot see its own canary: B's probe proves nothing")
        else:
            cells[name] = Cell(PASS, f"not visible to B ({planted['planted'][name]})")
    return cells


def cleanup_cell(gone: bool, how: str) -> Cell:
    return Cell(PASS, f"confirmed absent; {how}") if gone else Cell(FAIL, "an env is still present")
