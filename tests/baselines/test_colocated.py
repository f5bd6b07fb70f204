"""``+system=colocated``: the worked example of adding a system (docs/ARCHITECTURE.md)."""
import pytest

from harness.system import discover_systems
from harness.errors import PlanError
from harness.core.plan import TaskKind
from harness.planning.estimate import simulate_plan
from harness.testing import plan_for

ONE_NODE = ["+system=colocated", "model=7b", "cluster.num_nodes=1"]


def test_found_without_an_entry_point():
    assert "colocated" in discover_systems()


def test_one_shared_layout_and_no_weight_movement():
    plan, ctx, _ = plan_for(ONE_NODE)
    plan.validate(ctx.num_devices)
    assert len({t.allocation for t in plan.tasks}) == 1
    assert plan.tasks_of(TaskKind.WEIGHT_MOVEMENT) == [] and plan.weight_movements == []
    assert plan.features() == []


def test_search_keeps_the_fastest_feasible_layout():
    plan, ctx, _ = plan_for(ONE_NODE)
    chosen = simulate_plan(ctx, plan).makespan_s
    for layout in ("dp8tp1pp1", "dp1tp8pp1", "dp2tp4pp1", "dp4tp2pp1"):
        try:
            other, _, _ = plan_for(ONE_NODE + [f"system.layout={layout}"])
        except PlanError:  # does not fit in memory or cannot split the batch: never chosen
            continue
        assert chosen <= simulate_plan(ctx, other).makespan_s + 1e-12


def test_pinned_layout_is_used_or_refused_with_its_reason():
    plan, _, _ = plan_for(ONE_NODE + ["system.layout=dp1tp8pp1"])
    assert str(plan.tasks[0].allocation.strategy) == "dp1tp8pp1,zero1"
    with pytest.raises(PlanError, match="system.layout"):
        plan_for(ONE_NODE + ["system.layout=dp3tp8pp1"])


def test_cli_run(run_harness, tmp_path):
    proc = run_harness(ONE_NODE + ["logger=none", "logger.progress_bar=false", "backend.num_iterations=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "layout" in proc.stdout and "samples/s" in proc.stdout
