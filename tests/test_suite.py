"""The test suite's own settings in tests/conftest.py name files that exist (a renamed or removed
file would silently drop out of the run order or lose its exclusive hold on the machine)."""
from __future__ import annotations

from pathlib import Path

import re

from tests.conftest import EXCLUSIVE_MODULES, LOCK_FREE_MODULES, RUN_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_files_named_in_conftest_exist():
    missing = [path for path in (*EXCLUSIVE_MODULES, *LOCK_FREE_MODULES, *RUN_FIRST) if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py names files that do not exist: {missing}"
    assert len(set(RUN_FIRST)) == len(RUN_FIRST)


# what a module that may start Ray (or a process that does) names in its source
STARTS_RAY = re.compile(r"backend=ray|\bimport ray\b|importorskip\(\"ray\"\)|run_harness|subprocess|run_readme_command")


def test_lock_free_modules_never_start_ray():
    """A module without a hold on the machine lock runs beside the exclusive one, whose ``ray stop``
    stops every Ray on the machine: it must start none, nor any process that could."""
    for path in LOCK_FREE_MODULES:
        found = STARTS_RAY.findall((ROOT / path).read_text())
        assert not found, f"{path} is lock-free in tests/conftest.py but names {sorted(set(found))}"
