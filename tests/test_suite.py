"""The test suite's own settings in tests/conftest.py name files that exist (a renamed or removed
file would silently drop out of the run order or lose its exclusive hold on the machine)."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import EXCLUSIVE_MODULES, RUN_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_files_named_in_conftest_exist():
    missing = [path for path in (*EXCLUSIVE_MODULES, *RUN_FIRST) if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py names files that do not exist: {missing}"
    assert len(set(RUN_FIRST)) == len(RUN_FIRST)
