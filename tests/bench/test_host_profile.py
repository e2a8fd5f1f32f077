"""``bench/host_profile.py``: how a ``perf report`` row is counted (no perf, no VM here).

Protects the split docs/performance.md quotes ("half of a function episode's host CPU is TCG
translation"): a QEMU sample in a translator symbol counts as translation, and so does one in a
static function that lies next to a translator symbol (Debian's QEMU names only exported
symbols); one next to other symbols, in translated guest code (perf's ``[JIT]``, or
``[unknown]`` where it missed the mapping: QEMU has no other anonymous code), in QEMU's libraries
or kernel time, and the other processes each land in their own part; ``idle`` is kept apart,
and a row the parser cannot read is counted, not dropped.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

# exported symbols of a made-up QEMU: a device function, then the x86 front end's statics
# (no symbol) up to tcg_x86_init, then tcg_gen_code, then cpu_exec's loop
ADDRS = [0x1000, 0x2000, 0x3000, 0x4000, 0x5000]
NAMES = [
    "virtio_queue_notify",
    "do_interrupt_x86_hardirq",
    "tcg_x86_init",
    "tcg_gen_code",
    "cpu_exec",
]
REPORT = """\
    20.00%  2000  qemu-system-x86  qemu-system-x86_64  [.] tcg_gen_code
    10.00%  1000  qemu-system-x86  qemu-system-x86_64  [.] 0x0000000000002800
     5.00%   500  qemu-system-x86  qemu-system-x86_64  [.] 0x0000000000001800
     4.00%   400  qemu-system-x86  qemu-system-x86_64  [.] tcg_flush_softmmu_tlb
     6.00%   600  qemu-system-x86  [JIT] tid 4242      [.] 0x00007f0000001234
     2.00%   200  qemu-system-x86  [unknown]           [.] 0x00007f0000005678
     7.00%   700  qemu-system-x86  [kernel.kallsyms]   [k] clear_page_erms
     3.00%   300  qemu-system-x86  libglib-2.0.so.0.7400.6  [.] g_hash_table_lookup
    15.00%  1500  swapper          [kernel.kallsyms]   [k] pv_native_safe_halt
     9.00%   900  python           libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault
     2.00%   200  timeout          [kernel.kallsyms]   [k] exc_page_fault
     1.00%   100  kworker/1:2-cgr  [kernel.kallsyms]   [k] mas_walk
    16.00%  1600  perf             [kernel.kallsyms]   [k] perf_event_task_output
not a row: the header perf prints with -q off
"""


@pytest.fixture
def profile(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/host_profile.py as the bench loads it (``stats`` from bench/, for the test only)."""
    for name in ("stats", "host_profile"):
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
    return sys.modules["host_profile"]


def test_each_row_lands_in_its_part(profile: ModuleType) -> None:
    """The counts add up to 10,000 samples, so each part's percent is its count / 100."""
    parts = profile.classify(REPORT, ADDRS, NAMES)
    assert parts[profile.TRANSLATION] == pytest.approx(30.0)  # named, and before tcg_x86_init
    assert parts[profile.NAMED] == pytest.approx(20.0)
    assert parts[profile.QEMU_OTHER] == pytest.approx(9.0)  # a device static; the softmmu flush
    assert parts["QEMU: guest code running (translated)"] == pytest.approx(8.0)  # with [unknown]
    assert parts["QEMU: host kernel (page faults, exit, scheduling)"] == pytest.approx(7.0)
    assert parts["QEMU: libraries (glib, libc, dynamic loader)"] == pytest.approx(3.0)
    assert parts["controller (Python)"] == pytest.approx(9.0)
    assert parts["launch chain (setpriv, sh, timeout)"] == pytest.approx(2.0)
    assert parts["other processes"] == pytest.approx(17.0)
    assert parts["idle"] == pytest.approx(15.0)
    assert set(parts) <= {*profile.ORDER, "idle"}


def test_a_static_is_translation_only_beside_a_translator_symbol(profile: ModuleType) -> None:
    assert profile.is_translation("tcg_optimize", ADDRS, NAMES) == (True, True)
    assert profile.is_translation("0x2800", ADDRS, NAMES) == (False, True)  # next: tcg_x86_init
    assert profile.is_translation("0x1800", ADDRS, NAMES) == (False, False)
    assert profile.is_translation("0x5800", ADDRS, NAMES) == (False, False)  # after cpu_exec
    assert profile.is_translation("0x0800", ADDRS, NAMES) == (False, False)  # before any symbol


def test_a_row_it_cannot_read_is_counted_apart(profile: ModuleType) -> None:
    report = (
        "     4.50%    45  a comm with spaces\n"
        "     1.00%    10  swapper  [kernel.kallsyms]  [k] pv_native_safe_halt\n"
        "no row at all\n"
    )
    parts = profile.classify(report, ADDRS, NAMES)
    assert parts == {
        profile.UNREAD: pytest.approx(45 / 55 * 100),
        "idle": pytest.approx(10 / 55 * 100),
    }
