"""The chaos suite prints a fault x result table at the end of the session."""

from __future__ import annotations

from typing import Any

import pytest

FAULT_TABLE: list[tuple[str, str, str, str]] = []  # (fault, expected, observed, detail)


def record_fault(fault: str, expected: str, observed: str, detail: str = "") -> None:
    FAULT_TABLE.append((fault, expected, observed, detail))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FAULT_TABLE:
        return
    tr = terminalreporter
    tr.section("chaos: fault x result")
    width = max(len(row[0]) for row in FAULT_TABLE)
    tr.write_line(f"{'fault':<{width}}  {'expected':<24} {'observed':<24} ok?  detail")
    for fault, expected, observed, detail in FAULT_TABLE:
        mark = "ok " if expected == observed else "BAD"
        tr.write_line(f"{fault:<{width}}  {expected:<24} {observed:<24} {mark}  {detail}")


@pytest.fixture
def fault_table() -> Any:
    return record_fault
