"""Plans that fit: the layout search counts what co-located and resident models
hold (training states, ref/reward weights, activations, KV cache, the fused stage's peak),
reserves memory for the choices still to come, takes slower layouts that fit rather than refusing,
and refuses only when nothing fits, naming the smallest requirement."""
import pytest

from harness.costmodel.llama import num_params
from harness.errors import PlanError
from harness.planning.memory import MemoryLedger, MemoryNeed, MemoryShortfall, check_plan_memory, pareto
from harness.testing import context, plan_for

ONE_NODE_13B = ["model=13b", "cluster.num_nodes=1"]


def fits(plan, ctx):
    plan.validate(ctx.num_devices)
    report = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    assert max(report.peak_gb.values()) <= ctx.cost_model.hbm_capacity_gb
    return report


@pytest.mark.parametrize("system,extra", [
    ("rlhfuse_base", []), ("interleaved", []),
    ("rlhfuse", ["system.fused_search.max_steps=100", "system.migration_frac=0.2"])])
def test_13b_fits_on_one_node(system, extra):
    plan, ctx, _ = plan_for([f"+system={system}", *ONE_NODE_13B, *extra])
    fits(plan, ctx)


def test_rlhfuse_fused_stage_and_shared_layout_fit_together():
    """On two nodes the fused stage's activation peak and the shared inference layout's weights used
    to be chosen apart and overflow together (update_actor 72.8 of 72 GB)."""
    plan, ctx, _ = plan_for(["+system=rlhfuse", "model=13b_33b", "cluster.num_nodes=2", "system.fused_search.max_steps=200"])
    report = fits(plan, ctx)
    assert "fused/actor" in plan.notes and "inference/shared_layout" in plan.notes
    assert report.task_peak_gb["update_actor"] <= ctx.cost_model.hbm_capacity_gb


def test_refused_naming_the_smallest_requirement():
    with pytest.raises(PlanError, match=r"smallest requirement: .* needs \d+\.\d GB per device"):
        plan_for(["+system=rlhfuse_base", "model=65b", "cluster.num_nodes=1"])


def test_65b_actor_and_33b_critic_cannot_fit_one_node_with_adam_states():
    """16 bytes per parameter (bf16 weights and gradients, fp32 master weights, momentum and
    variance) of a 65B actor and a 33B critic are ~1562 GB, against 8 x 72 GB usable on one node: even
    sharded perfectly over the 8 GPUs that is ~195 GB per device."""
    overrides = ["+system=rlhfuse_base", "model=65b_33b", "cluster.num_nodes=1"]
    ctx = context(overrides)
    states_gb = 16 * (num_params(ctx.model("actor")) + num_params(ctx.model("critic"))) / 1e9
    assert states_gb == pytest.approx(1561.6, abs=0.5)
    assert states_gb / 8 > 2 * ctx.cost_model.hbm_capacity_gb  # 195 GB per GPU against 72 GB usable
    with pytest.raises(PlanError) as err:
        plan_for(overrides)
    need = float(str(err.value).split("needs ")[1].split(" GB")[0])
    assert need >= states_gb / 8 * 0.99


def test_ledger_reserves_the_cheapest_way_of_making_later_steps():
    ledger = MemoryLedger(10.0)
    ledger.expect("ref", [MemoryNeed({"ref": 4.0}, {"ref": 0.1}), MemoryNeed({"ref": 2.0}, {"ref": 0.1}),
                          MemoryNeed({}, {"ref": 2.5})])  # resident (two layouts) or offloaded
    assert len(ledger.later["ref"]) == 2  # the 4 GB layout is beaten on both counts
    train = MemoryNeed({"actor": 5.0}, {"update_actor": 1.0})
    assert ledger.total_gb(train) == pytest.approx(5.0 + 2.5)  # cheapest: ref offloaded
    ledger.require(train)
    with pytest.raises(MemoryShortfall, match="reserved"):
        ledger.require(MemoryNeed({"actor": 7.6}, {"update_actor": 1.0}))
    ledger.commit("training", train)
    # ref's own choice does not reserve for itself
    assert ledger.total_gb(MemoryNeed({"ref": 4.0}, {"ref": 0.1}), "ref") == pytest.approx(10.0)
    assert ledger.headroom_gb(MemoryNeed({"actor": 5.0}, {"update_actor": 0.0})) == pytest.approx(5.0 - 0.0)


def test_ledger_later_entry_for_a_resident_model_counts_the_larger():
    """RLHFuse's shared inference layout replaces the per-task ones: until it is chosen, the ref
    entry counts as the larger of the chosen per-task layout and the cheapest shared one."""
    ledger = MemoryLedger(100.0)
    ledger.expect("shared", [MemoryNeed({"ref": 3.0}, {})])
    ledger.commit("ref", MemoryNeed({"ref": 1.0}, {}))
    assert ledger.total_gb() == pytest.approx(3.0)
    ledger.commit("shared", MemoryNeed({"ref": 2.0}, {}))
    assert ledger.total_gb() == pytest.approx(2.0)


def test_pareto_keeps_one_of_equal_options():
    a, b = MemoryNeed({"x": 1.0}, {"t": 1.0}), MemoryNeed({"y": 1.0}, {"u": 1.0})
    assert pareto([a, b]) == [a]


def training_in_flight(plan):
    """(micro-batches each training stage's first rank runs forward before its first backward,
    and what 1F1B holds: min(pp, micro-batches))."""
    out = {}
    for stage in plan.training:
        actions = stage.schedule.order[min(stage.schedule.order)]
        pipe = next(iter(stage.schedule.pipes.values()))
        out[stage.tasks[0]] = (next(i for i, a in enumerate(actions) if a.kind == "B"),
                               min(pipe.num_stages, pipe.num_mbs))
    return out


def test_no_lever_where_the_fastest_layouts_fit():
    plan, ctx, _ = plan_for(["+system=rlhfuse_base", "model=13b", "cluster.num_nodes=4"])
    assert not plan.offloaded
    assert all(plan.task(t).allocation.strategy.zero_stage == 1 for t in ("update_actor", "update_critic"))
    assert all(n == full for n, full in training_in_flight(plan).values())


# 13B models cut to one layer on two nodes: pipeline parallelism cannot shard them, so with little
# memory only ZeRO's sharding over dp (and then offloading) makes them fit
ONE_LAYER = ["+system=rlhfuse_base", "model=13b", "cluster.num_nodes=2"] + [
    f"model.{role}.num_layers=1" for role in ("actor", "critic", "ref", "reward")]


def test_higher_zero_stage_when_nothing_else_fits():
    plan, ctx, _ = plan_for(ONE_LAYER + ["cluster.gpu.hbm_gb=2.0"])
    fits(plan, ctx)
    zero = {plan.task(t).allocation.strategy.zero_stage for t in ("update_actor", "update_critic")}
    assert max(zero) >= 2 and not plan.offloaded
    plan, ctx, _ = plan_for(ONE_LAYER + ["cluster.gpu.hbm_gb=1.8"])  # and then ref/reward offloaded
    fits(plan, ctx)
    assert plan.offloaded == ["ref", "reward"]
    with pytest.raises(PlanError, match="smallest requirement"):
        plan_for(ONE_LAYER + ["cluster.gpu.hbm_gb=1.5"])


def test_offloaded_ref_and_reward_when_their_weights_do_not_fit_resident():
    plan, ctx, _ = plan_for(["+system=rlhfuse_base", *ONE_NODE_13B, "cluster.gpu.hbm_gb=65"])
    fits(plan, ctx)
    assert plan.offloaded == ["ref", "reward"]
    assert {r.model for r in plan.resident} == {"actor", "critic"}


def test_fewer_micro_batches_in_flight_when_activations_do_not_fit():
    plan, ctx, _ = plan_for(["+system=rlhfuse_base", *ONE_NODE_13B, "workload.max_gen_len=3072",
                             "workload.activation_recompute=none"])
    fits(plan, ctx)
    assert any(n < full for n, full in training_in_flight(plan).values())
