"""Disaggregated placement (arXiv 2312.11819): generation pool with a shadow actor synced by
``param_sync`` each iteration, training pool for everything else, split chosen by simulation."""
import json
import random

import pytest

from harness.core import metrics as mk
from harness.costmodel.llama import num_params
from harness.errors import PlanError
from harness.planning.memory import check_plan_memory
from harness.core.plan import Plan
from harness.planning.realloc import reallocation_transfers
from harness.testing import plan_for, simulate_plan_metrics
from baselines.disaggregated import coarse_splits, search_splits

SMALL = ["model=7b", "cluster.num_nodes=2"]
TRAINING_TASKS = ("update_actor", "update_critic", "ref", "reward", "values")


@pytest.fixture(scope="module")
def small():
    plan, ctx, _ = plan_for(["+system=disaggregated"] + SMALL)
    trace, row = simulate_plan_metrics(plan, ctx)
    return plan, ctx, trace, row


def pools(plan):
    gen = set(plan.task("gen").allocation.mesh)
    train = {d for t in TRAINING_TASKS for d in plan.task(t).allocation.mesh}
    return gen, train


def test_pools_are_disjoint_and_cover_the_cluster(small):
    plan, ctx, _, _ = small
    gen, train = pools(plan)
    assert not gen & train and gen | train == set(range(ctx.num_devices))
    assert gen == set(range(8, 16))  # whole nodes: the last one
    for t in TRAINING_TASKS:
        assert plan.task(t).allocation.mesh == tuple(range(8))


def test_sync_moves_one_actor_copy_per_generation_replica(small):
    plan, ctx, _, _ = small
    (move,) = [m for m in plan.weight_movements if m.task == "param_sync"]
    gen = plan.task("gen").allocation
    assert move.source == plan.task("update_actor").allocation and move.target == gen
    actor = ctx.models.actor
    layer_bytes = ctx.cost_model.weights_gb(actor, 1, 1) * 1e9 / actor.num_layers
    received = {t.device: t.bytes for t in reallocation_transfers(
        move.source, move.target, actor.num_layers, layer_bytes, ctx.cluster.gpus_per_node)}
    assert set(received) == set(gen.mesh)
    for k in range(gen.strategy.dp):
        replica = sum(received[d] for d in gen.replica_devices(k))
        assert replica == pytest.approx(2 * num_params(actor), rel=1e-9)
    assert plan.notes["split/gen_replicas"] == gen.strategy.dp


def test_sync_is_traced_and_counts_in_the_step(small):
    plan, _, trace, row = small
    sync = [s for s in trace.spans if s.task == "param_sync"]
    assert sync and all(s.kind == "param_sync" and s.bytes > 0 for s in sync)
    assert row[mk.timing_key("param_sync")] > 0
    gen_start = min(s.start_s for s in trace.spans if s.task == "gen")
    assert gen_start >= max(s.end_s for s in sync) - 1e-12  # gen waits for the synced weights
    assert row[mk.STEP_TIME] >= row[mk.timing_key("param_sync")] + row[mk.timing_key("gen")]


def test_memory_pools(small):
    plan, ctx, _, _ = small
    gen, _ = pools(plan)
    on_gen = {(r.model, r.what) for r in plan.resident if set(plan.task(r.task).allocation.mesh) & gen}
    assert on_gen == {("actor", "weights")}  # only the shadow actor (plus the KV cache while generating)
    report = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    assert max(report.peak_gb.values()) <= ctx.cost_model.hbm_capacity_gb
    shadow = ctx.cost_model.weights_gb(ctx.models.actor, plan.task("gen").allocation.strategy.tp,
                                       plan.task("gen").allocation.strategy.pp)
    assert report.kv_capacity_gb["gen"] == pytest.approx(ctx.cost_model.hbm_capacity_gb - shadow)


def test_plan_validates_and_round_trips(small):
    plan, ctx, _, _ = small
    plan.validate(ctx.num_devices)
    text = plan.to_json()
    assert Plan.from_json(text).to_json() == text
    json.loads(text)


def test_metric_keys_are_rlhfuse_base_plus_param_sync(small):
    plan, _, _, row = small
    base_plan, base_ctx, _ = plan_for(["+system=rlhfuse_base"] + SMALL)
    _, base_row = simulate_plan_metrics(base_plan, base_ctx)
    # realloc appears iff a layout change happens on shared devices (plan-dependent in both systems)
    ignore = {mk.REALLOC_TIME}
    # which stages ran at the same time is plan-dependent too (overlap_s/*: disjoint pools at once)
    ignore |= {k for k in set(row) | set(base_row) if k.startswith("overlap_s/")}
    assert set(row) - ignore == (set(base_row) - ignore) | {mk.timing_key("param_sync")}


def test_auto_split_is_the_best_tried():
    plan, ctx, _ = plan_for(["+system=disaggregated", "model=7b", "cluster.num_nodes=4"])
    curve = {int(k): v for k, v in plan.notes["split/curve_s"].items()}
    assert set(curve) | {int(k) for k in plan.notes.get("split/infeasible", {})} == {1, 2, 3}
    best = plan.notes["split/gen_nodes"]
    assert curve[best] == min(curve.values())
    assert len(plan.task("gen").allocation.mesh) == best * ctx.cluster.gpus_per_node
    _, row = simulate_plan_metrics(plan, ctx)
    assert row[mk.STEP_TIME] == pytest.approx(curve[best], rel=1e-5)


def test_refined_search_finds_the_minimum_of_unimodal_curves():
    assert coarse_splits(32) == [1, 2, 4, 8, 16, 31]
    assert coarse_splits(2) == [1]
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 40)
        best = rng.randint(1, n - 1)
        slope_l, slope_r = rng.uniform(0.1, 2), rng.uniform(0.1, 2)
        calls = []

        def score(k):
            calls.append(k)
            return 10 + (slope_l * (best - k) if k <= best else slope_r * (k - best))
        curve, _ = search_splits(n, score)
        assert min(curve, key=curve.get) == best
        assert len(calls) == len(set(calls)) <= n - 1


def test_infeasible_splits_are_recorded_not_chosen():
    def score(k):
        if k >= 6:
            raise PlanError("training pool too small")
        return 10.0 - k
    curve, infeasible = search_splits(8, score)
    assert min(curve, key=curve.get) == 5 and 7 in infeasible and "too small" in infeasible[7]
    with pytest.raises(PlanError, match="no split"):
        plan_for(["+system=disaggregated", "model=65b", "cluster.num_nodes=2"])


def test_pinned_split_and_one_node_halves():
    plan, ctx, _ = plan_for(["+system=disaggregated", "system.gen_nodes=1"] + SMALL)
    assert plan.task("gen").allocation.mesh == tuple(range(8, 16)) and "split/curve_s" not in plan.notes
    with pytest.raises(PlanError, match="gen_nodes=2"):
        plan_for(["+system=disaggregated", "system.gen_nodes=2"] + SMALL)
    plan, ctx, _ = plan_for(["+system=disaggregated", "model=tiny", "workload=tiny", "cluster.num_nodes=1"])
    gen, train = pools(plan)
    assert gen == {4, 5, 6, 7} and train == {0, 1, 2, 3}
    plan.validate(ctx.num_devices)


def test_cli_run_reports_param_sync(run_harness, tmp_path):
    proc = run_harness(["+system=disaggregated", *SMALL, "logger=none", f"results_dir={tmp_path / 'results'}",
                        "backend.num_iterations=2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (summary,) = (tmp_path / "results").glob("default/disaggregated*/7b/seed0/summary.json")
    data = json.loads(summary.read_text())
    assert data["metrics"][mk.timing_key("param_sync")] > 0
    assert data["info"]["notes/split/gen_nodes"] == 1
