"""Interleaving placement (arXiv 2312.11819): actor/critic everywhere, ref and reward on disjoint
halves whose inference runs concurrently in the simulator."""
import pytest

from harness.planning.memory import check_plan_memory
from harness.core.plan import Plan
from harness.testing import context, plan_for, simulate_plan_metrics
from baselines.interleaved import ref_reward_groups

SMALL = ["model=7b", "cluster.num_nodes=2"]


def task_window(trace, task):
    window = trace.task_window(task)
    assert window is not None, f"no spans for {task}"
    return window


@pytest.fixture(scope="module")
def small():
    plan, ctx, _ = plan_for(["+system=interleaved"] + SMALL)
    trace, row = simulate_plan_metrics(plan, ctx)
    return plan, ctx, trace, row


def test_placement(small):
    plan, ctx, _, _ = small
    everywhere = tuple(range(ctx.num_devices))
    assert plan.task("ref").allocation.mesh == tuple(range(8))
    assert plan.task("reward").allocation.mesh == tuple(range(8, 16))
    for name in ("gen", "values", "update_actor", "update_critic"):
        assert plan.task(name).allocation.mesh == everywhere
    assert plan.generation.batching == "continuous" and plan.generation.max_batch_size == 256
    resident = {(r.model, r.task, r.what) for r in plan.resident}
    assert resident == {("actor", "update_actor", "train"), ("critic", "update_critic", "train"),
                        ("ref", "ref", "weights"), ("reward", "reward", "weights")}


def test_plan_validates_fits_and_round_trips(small):
    plan, ctx, _, _ = small
    plan.validate(ctx.num_devices)
    report = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    assert max(report.peak_gb.values()) <= ctx.cost_model.hbm_capacity_gb
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_ref_and_reward_run_concurrently_after_generation(small):
    _, _, trace, _ = small
    gen_end = task_window(trace, "gen")[1]
    (ref0, ref1), (rew0, rew1) = task_window(trace, "ref"), task_window(trace, "reward")
    assert ref0 == pytest.approx(gen_end) and rew0 == pytest.approx(gen_end)
    assert max(ref0, rew0) < min(ref1, rew1)  # the two windows overlap
    assert task_window(trace, "values")[0] >= max(ref1, rew1) - 1e-9  # values needs all devices


def test_metric_keys_match_rlhfuse_base(small):
    plan, ctx, _, row = small
    base_plan, base_ctx, _ = plan_for(["+system=rlhfuse_base"] + SMALL)
    _, base_row = simulate_plan_metrics(base_plan, base_ctx)
    # ref and reward run at once on disjoint halves: their overlap is the one key rlhfuse_base lacks
    assert set(row) == set(base_row) | {"overlap_s/ref/reward"}


def test_groups_on_odd_and_single_node_clusters():
    ref, reward = ref_reward_groups(context(["+system=interleaved", "model=13b_33b", "cluster.num_nodes=3"]))
    assert (len(ref), len(reward)) == (8, 16)  # the extra node goes to the larger (33B reward) model
    ref, reward = ref_reward_groups(context(["+system=interleaved", "model=33b_13b", "cluster.num_nodes=3"]))
    assert (len(ref), len(reward)) == (16, 8)
    plan, ctx, _ = plan_for(["+system=interleaved", "model=tiny", "workload=tiny", "cluster.num_nodes=1"])
    assert plan.task("ref").allocation.mesh == (0, 1, 2, 3)
    assert plan.task("reward").allocation.mesh == (4, 5, 6, 7)
    plan.validate(ctx.num_devices)
    check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
