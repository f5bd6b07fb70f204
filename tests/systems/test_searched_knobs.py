"""Planners agree with the simulator: every searched knob's chosen value simulates at least as well
as the simple alternatives its search considers, at paper scale (13b and 65b_33b on the RLHFuse
testbed).

- RLHFuse's R_t and shared inference layout (section 4): the chosen pair against streaming without
  migration (``system.migration_frac=0``) and against the probe threshold the layout search starts
  from (``system.migration_frac=0.2``), each with the layout the planner picks for it;
- RLHFuse's fused actor+critic schedule (section 5): the fused stage against the separate 1F1B
  stages of the base search's layouts (``system.intra_stage=false``, the planner's fallback), and
  its makespan against the serial and greedy schedules the search starts from (the plan's notes);
- ReaLHF's layout search: the searched plan against the heuristic layout it starts from
  (``+system=realhf_heuristic``).

Plans are compared on the batch the planners estimate with (iteration 0 of the seed,
:func:`harness.planning.estimate.representative_batch`), simulated whole by the simulator
``backend=sim`` runs. Search budgets are in steps (same numbers on every machine) and smaller than
the defaults, which changes what is found, not the rule checked.
"""
from __future__ import annotations

import functools

import pytest

from harness.testing import plan_for, simulate_plan_metrics

MODELS = ("13b", "65b_33b")
BUDGETS = {"rlhfuse": ["system.fused_search.max_steps=2000"], "realhf": ["system.max_steps=200"]}
REL_TOL = 1e-9  # the same plan simulated twice gives the same number; the rest is rounding


@functools.lru_cache(maxsize=None)
def simulated(system: str, model: str, *extra: str) -> tuple[dict, dict]:
    """(iteration-0 metrics, plan notes) of ``+system=<system> model=<model> *extra``."""
    plan, ctx, _ = plan_for([f"+system={system}", f"model={model}", *BUDGETS.get(system, []), *extra])
    _, metrics = simulate_plan_metrics(plan, ctx, iteration=0)
    return metrics, dict(plan.notes)


def no_slower(chosen: float, alternative: float) -> bool:
    return chosen <= alternative * (1 + REL_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("alternative", ["system.migration_frac=0", "system.migration_frac=0.2"])
def test_rlhfuse_threshold_and_layout_simulate_no_slower_than_the_alternatives(model, alternative):
    chosen, notes = simulated("rlhfuse", model)
    other, other_notes = simulated("rlhfuse", model, alternative)
    assert no_slower(chosen["timing_s/step"], other["timing_s/step"]), (
        f"chose R_t={notes['migration/threshold_frac']} on {notes['inference/shared_layout']}: "
        f"{chosen['timing_s/step']:.6f} s; {alternative} on {other_notes['inference/shared_layout']}: "
        f"{other['timing_s/step']:.6f} s")
    # the planner's curve is the chosen layout's: no threshold it swept is better on its estimate
    curve = notes["migration/curve_s"]
    assert curve[f"{notes['migration/threshold_frac']:.2f}"] == min(curve.values())


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_rlhfuse_fused_stage_simulates_no_slower_than_separate_stages(model):
    fused, notes = simulated("rlhfuse", model)
    separate, _ = simulated("rlhfuse", model, "system.intra_stage=false")
    assert no_slower(fused["timing_s/train"], separate["timing_s/train"])
    assert notes["fused/makespan_s"] <= min(notes["fused/serial_makespan_s"], notes["fused/greedy_makespan_s"])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_realhf_searched_layout_simulates_no_slower_than_its_heuristic_start(model):
    searched, _ = simulated("realhf", model)
    heuristic, _ = simulated("realhf_heuristic", model)
    assert no_slower(searched["timing_s/step"], heuristic["timing_s/step"])
