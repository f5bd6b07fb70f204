"""Behaviour preserved across the planning-library redesign (issue 10).

Every system plans and runs (sim backend, 5 iterations, fixed seed, step-budgeted searches) on
``model=13b`` and ``model=65b_33b``; the plan and the summary metrics must equal the golden files
in ``tests/golden/``, recorded before the redesign (``tests/golden/record.py``). Wall-clock
measurements (planning time, search time) are the only values not compared.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import record  # noqa: E402


def without_wall_clock(d):
    if isinstance(d, dict):
        return {k: without_wall_clock(v) for k, v in d.items() if k not in record.WALL_CLOCK_KEYS}
    if isinstance(d, list):
        return [without_wall_clock(v) for v in d]
    return d


@pytest.mark.parametrize("model", record.MODELS)
@pytest.mark.parametrize("system", record.SYSTEMS)
def test_plan_and_metrics_match_golden(system, model):
    golden = json.loads(record.golden_path(system, model).read_text())
    now = json.loads(json.dumps(record.run(system, model)))
    assert without_wall_clock(now["metrics"]) == without_wall_clock(golden["metrics"])
    assert without_wall_clock(now["plan"]) == without_wall_clock(golden["plan"])
