"""Expert parallelism in the plan and the layout search: ``ParallelStrategy.ep`` (carved from dp),
its spelling in strings, pins and plan.json (absent at ep = 1), the refusals, and the searched
candidates (dense models: exactly the (dp, tp, pp) set)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from harness.core.plan import Allocation, GenerationPolicy, MigrationPolicy, ParallelStrategy, Plan, Task
from harness.costmodel.llama import ModelDims
from harness.errors import PlanError
from harness.planning.strategies import (candidate_strategies, check_expert_parallel, divisors, ep_options,
                                         expert_tp_options, parse_layout)
from harness.real.model import load_llama_config
from harness.testing import plan_for

MOE = ModelDims.of(load_llama_config("qwen3_30b_a3b"))
DENSE = ModelDims.of(load_llama_config("13b"))


def test_ep_prints_and_serialises_only_when_it_is_not_one():
    assert str(ParallelStrategy(4, 2, 1)) == "dp4tp2pp1" == str(ParallelStrategy(4, 2, 1, ep=1))
    assert str(ParallelStrategy(4, 2, 1, 1, ep=2)) == "dp4tp2pp1ep2,zero1"
    assert ParallelStrategy(4, 2, 1).to_dict() == {"dp": 4, "tp": 2, "pp": 1, "zero_stage": 0}
    assert ParallelStrategy(4, 2, 1, ep=4).to_dict() == {"dp": 4, "tp": 2, "pp": 1, "zero_stage": 0, "ep": 4}
    mesh = tuple(range(8))
    dense = Plan("x", [Task("gen", "generate", "actor", Allocation(mesh, ParallelStrategy(4, 2, 1)))])
    assert '"ep"' not in dense.to_json()
    moe = Plan("x", [Task("gen", "generate", "actor", Allocation(mesh, ParallelStrategy(4, 2, 1, ep=2)))])
    assert json.loads(moe.to_json())["tasks"][0]["allocation"]["strategy"]["ep"] == 2
    assert Plan.from_json(moe.to_json()).tasks[0].allocation.strategy.ep == 2
    assert Plan.from_json(moe.to_json()).to_json() == moe.to_json()


def test_ep_must_divide_dp():
    with pytest.raises(PlanError, match="ep=3 must divide dp=4"):
        ParallelStrategy(4, 2, 1, ep=3)
    with pytest.raises(PlanError, match="ep=0 must be an integer >= 1"):
        ParallelStrategy(4, 2, 1, ep=0)


def test_pinned_layouts_take_an_optional_ep():
    assert parse_layout("dp8tp4pp1", 1, "gen") == ParallelStrategy(8, 4, 1, 1)
    assert parse_layout("dp8tp4pp1ep4", 1, "update_actor") == ParallelStrategy(8, 4, 1, 1, ep=4)
    assert parse_layout(str(ParallelStrategy(8, 4, 1, ep=8)), 0, "ref").ep == 8
    with pytest.raises(PlanError, match=r"system\.layouts\.gen='dp8tp4pp1ep3': .*ep=3 must divide dp=8"):
        parse_layout("dp8tp4pp1ep3", 0, "gen")
    with pytest.raises(PlanError, match="dp<D>tp<T>pp<P>"):
        parse_layout("dp8tp4pp1ep", 0, "gen")


def _old_candidates(n: int, per_node: int, layers: int, zero: int = 0, max_pp: int = 32):
    """The (dp, tp, pp) enumeration before expert parallelism (every model shards tp here)."""
    return [ParallelStrategy(n // (tp * pp), tp, pp, zero) for tp in divisors(per_node) if n % tp == 0
            for pp in divisors(n // tp) if pp <= min(layers, max_pp)]


@pytest.mark.parametrize("n", [8, 64, 256])
def test_dense_candidates_are_exactly_the_dense_set(n):
    got = list(candidate_strategies(n, 8, DENSE.num_layers, 1, models=[DENSE, DENSE]))
    assert got == _old_candidates(n, 8, DENSE.num_layers, 1)
    assert all(s.ep == 1 for s in got)


def test_moe_candidates_add_power_of_two_ep_up_to_a_node():
    assert ep_options(256, 8, [MOE]) == [1, 2, 4, 8]
    assert ep_options(6, 8, [MOE]) == [1, 2]  # ep divides dp
    assert ep_options(256, 4, [MOE]) == [1, 2, 4]  # at most a node's GPUs
    assert ep_options(256, 8, [MOE, DENSE]) == [1]  # a layout shared with a dense model: none
    odd = ModelDims("odd", 4, 64, 4, 4, 256, num_experts=12, num_experts_per_token=2, moe_ffn_hidden_size=32)
    assert ep_options(16, 8, [odd]) == [1, 2, 4]  # ep divides num_experts
    got = list(candidate_strategies(64, 8, MOE.num_layers, models=[MOE]))
    base = _old_candidates(64, 8, MOE.num_layers)
    assert [s for s in got if s.ep == 1] == base
    assert {(s.dp, s.tp, s.pp, s.ep) for s in got if s.etp is None} == {(s.dp, s.tp, s.pp, ep) for s in base
                                                                        for ep in (1, 2, 4, 8) if s.dp % ep == 0}
    # and, beside tp > 1, ep at expert tensor parallelism 1: ep divides dp * tp, a domain within a node
    assert {(s.dp, s.tp, s.pp, s.ep) for s in got if s.etp is not None} == {
        (s.dp, s.tp, s.pp, ep) for s in base if s.tp > 1 for ep in (2, 4, 8) if (s.dp * s.tp) % ep == 0}
    assert all(s.etp == 1 for s in got if s.etp is not None) and len(set(got)) == len(got)
    assert expert_tp_options(1, 8, 8, [MOE]) == [2, 4, 8] and expert_tp_options(4, 1, 8, [MOE]) == []
    assert expert_tp_options(4, 2, 8, [MOE, DENSE]) == [] and expert_tp_options(1, 2, 4, [odd]) == [2]
    assert list(candidate_strategies(64, 8, MOE.num_layers, models=[MOE], expert_parallel=False)) == base


def test_plans_with_ep_on_a_dense_model_or_migrating_generation_are_refused():
    mesh = tuple(range(8))
    models = SimpleNamespace(actor=DENSE)
    plan = Plan("x", [Task("update_actor", "train", "actor", Allocation(mesh, ParallelStrategy(4, 2, 1, ep=2)))])
    with pytest.raises(PlanError, match="task update_actor runs .* ep=2 needs a mixture-of-experts model"):
        check_expert_parallel(plan, models)
    gen = Plan("x", [Task("gen", "generate", "actor", Allocation(mesh, ParallelStrategy(8, 1, 1, ep=2)))],
               generation=GenerationPolicy(migration=MigrationPolicy(0.2, 1)))
    with pytest.raises(PlanError, match="long-tail migration"):
        check_expert_parallel(gen, SimpleNamespace(actor=MOE))
    gen.generation = GenerationPolicy()
    check_expert_parallel(gen, SimpleNamespace(actor=MOE))


def test_a_pinned_ep_on_a_dense_model_is_refused_naming_the_option():
    with pytest.raises(PlanError, match=r"system\.layouts\.update_actor.*ep=2 needs a mixture-of-experts model"):
        plan_for(["+system=rlhfuse_base", "model=7b", "cluster.num_nodes=1", "system.layouts.update_actor=dp8tp1pp1ep2"])


def test_a_pinned_ep_on_a_moe_model_plans_and_writes_ep():
    plan, ctx, _ = plan_for(["+system=rlhfuse_base", "algo=grpo", "model=qwen3_30b_a3b",
                             "system.layouts.update_actor=dp64tp4pp1ep8", "system.layouts.gen=dp64tp4pp1ep2"])
    assert plan.task("update_actor").allocation.strategy == ParallelStrategy(64, 4, 1, 1, ep=8)
    assert plan.task("gen").allocation.strategy.ep == 2
    strategies = [t["allocation"]["strategy"] for t in json.loads(plan.to_json())["tasks"]]
    assert {"dp": 64, "tp": 4, "pp": 1, "zero_stage": 1, "ep": 8} in strategies


@pytest.mark.parametrize("dp,tp,pp,ep", [(8, 1, 2, 8), (4, 2, 2, 2), (2, 4, 3, 2), (6, 1, 1, 3)])
def test_pipeline_outermost_is_megatron_cores_rank_order(dp, tp, pp, ep):
    """Megatron-core's default order tp-cp-ep-dp-pp, tp varying fastest: global rank
    ``t + tp * (k + dp * p)`` for tp rank t, dp rank k, pipeline rank p; the allocation lays those
    ranks on a mesh of devices in that order, and its ep groups lie among ``ep * tp`` devices."""
    devices = tuple(100 + 3 * i for i in range(dp * tp * pp))  # any device ids, in rank order
    alloc = Allocation.pipeline_outermost(devices, ParallelStrategy(dp, tp, pp, ep=ep))
    assert sorted(alloc.mesh) == sorted(devices)
    for k in range(dp):
        for p in range(pp):
            for t in range(tp):
                assert alloc.device(k, p, t) == devices[t + tp * (k + dp * p)]
            assert alloc.stage_devices(k, p) == tuple(alloc.device(k, p, t) for t in range(tp))
    packed = Allocation.pipeline_outermost(tuple(range(dp * tp * pp)), ParallelStrategy(dp, tp, pp, ep=ep))
    assert packed.ep_span == ep * tp
    # the plain order puts a replica's stages side by side, so its ep groups reach across the pipeline
    plain = Allocation(tuple(range(dp * tp * pp)), ParallelStrategy(dp, tp, pp, ep=ep))
    assert plain.ep_span == (ep - 1) * pp * tp + tp
    if pp == 1:
        assert packed.mesh == plain.mesh


@pytest.mark.parametrize("dp,tp,pp,ep", [(8, 1, 2, 8), (4, 2, 2, 2), (8, 1, 2, 1), (6, 1, 1, 3), (4, 2, 1, 1)])
def test_in_engine_order_is_megatron_cores_only_for_an_expert_parallel_pipeline(dp, tp, pp, ep):
    devices = tuple(range(dp * tp * pp))
    s = ParallelStrategy(dp, tp, pp, ep=ep)
    placed = Allocation.in_engine_order(devices, s)
    assert placed == (Allocation.pipeline_outermost(devices, s) if ep > 1 and pp > 1 else Allocation(devices, s))
    assert placed.ep_span == (ep * tp if ep > 1 else tp)  # every ep group on consecutive devices


@pytest.mark.parametrize("system,pin", [("rlhfuse_base", "system.layouts.update_actor"), ("colocated", "system.layout")])
def test_the_searched_systems_keep_a_pipelined_ep_group_within_a_node(system, pin):
    """A pinned dp8tp1pp2ep8 on two nodes: each ep group is one node's 8 GPUs (Megatron-core's order),
    not one GPU of each of 8 replicas spread over both nodes."""
    plan, _, _ = plan_for([f"+system={system}", "algo=grpo", "model=qwen3_30b_a3b", "cluster=h100_8x",
                           "cluster.num_nodes=2", "workload.global_batch_size=64", "workload.mini_batch_size=64",
                           "workload.micro_batch_size=1", f"{pin}=dp8tp1pp2ep8"])
    train = plan.task("update_actor").allocation
    assert (train.strategy.dp, train.strategy.pp, train.strategy.ep, train.ep_span) == (8, 2, 8, 8)
    assert {tuple(sorted({train.device(k, p, 0) // 8 for k in range(8)})) for p in range(2)} == {(0,), (1,)}


def test_rlhfuses_fused_moe_pipelines_keep_each_ep_group_within_a_node():
    """RLHFuse's fused actor+critic stage (PPO, both models Qwen3-30B-A3B, dp8pp2ep8 on two
    nodes) in Megatron-core's order: each stage's ep group one node's 8 GPUs, actor stage p and
    critic stage 1 - p of a replica on the same devices (the bidirectional pairing), so every
    device holds one logical rank of the fused schedule."""
    from harness.planning.taskmodels.passes import pipe_stage_devices

    plan, _, _ = plan_for(["+system=rlhfuse", "algo=ppo", "model=qwen3_30b_a3b", "cluster=h100_8x",
                           "cluster.num_nodes=2", "workload.global_batch_size=64", "workload.mini_batch_size=64",
                           "workload.micro_batch_size=1", "system.fused_search.max_steps=50"])
    (stage,) = plan.training
    assert stage.fused
    actor, critic = plan.task("update_actor").allocation, plan.task("update_critic").allocation
    for alloc in (actor, critic):
        s = alloc.strategy
        assert (s.dp, s.pp, s.ep, alloc.ep_span) == (8, 2, 8, 8)
        assert {tuple(sorted({alloc.device(k, p, 0) // 8 for k in range(8)})) for p in range(2)} == {(0,), (1,)}
    assert all(actor.stage_devices(k, p) == critic.stage_devices(k, 1 - p) for k in range(8) for p in range(2))
    rank_of: dict[int, int] = {}
    for (pipe, st), devices in pipe_stage_devices(plan, stage).items():
        rank = stage.schedule.pipes[pipe].stage_to_rank[st]
        assert all(rank_of.setdefault(d, rank) == rank for d in devices)
    assert sorted(rank_of) == list(range(16))


def test_pipeline_outermost_refuses_a_wrong_device_count():
    with pytest.raises(PlanError, match="needs dp\\*tp\\*pp = 16 devices but 8"):
        Allocation.pipeline_outermost(tuple(range(8)), ParallelStrategy(8, 1, 2, ep=8))


def test_ep_span_is_tp_without_expert_parallelism():
    assert Allocation(tuple(range(16)), ParallelStrategy(4, 2, 2)).ep_span == 2


def test_a_megatron_layout_keeps_its_ep_groups_within_a_node_and_times_them_there():
    """dp8pp2ep8 on two nodes: in Megatron-core's order every ep group is one node's 8 GPUs, so
    the MoE all-to-alls take NVLink, and the plan's passes are faster than the same layout in the
    plain order, whose ep groups span both nodes."""
    overrides = ["+system=nemo_rl", "algo=grpo", "model=qwen3_30b_a3b", "cluster=h100_8x", "cluster.num_nodes=2",
                 "workload.global_batch_size=64", "workload.mini_batch_size=64", "workload.micro_batch_size=1",
                 "system.train_layout=dp8tp1pp2ep8"]
    plan, ctx, _ = plan_for(overrides)
    train = plan.task("update_actor").allocation
    assert train.strategy == ParallelStrategy(8, 1, 2, 1, ep=8) and train.ep_span == 8
    nodes = {tuple(sorted({train.device(k, p, 0) // 8 for k in range(8)})) for p in range(2)}
    assert nodes == {(0,), (1,)}  # stage p of every replica on node p
    cm, model = ctx.cost_model, ctx.model("actor")
    args = (model, 4096.0, 4096.0, 1, model.num_layers / 2)
    in_node = cm.forward_s(*args, ep=8, ep_span=train.ep_span)
    across = cm.forward_s(*args, ep=8, ep_span=Allocation(tuple(range(16)), train.strategy).ep_span)
    assert in_node < across


# ---- expert tensor parallelism (Megatron-core's expert_tensor_parallel_size) ----------------------

def test_etp_prints_serialises_and_round_trips_only_when_it_differs_from_tp():
    plain = ParallelStrategy(16, 2, 1, ep=8)
    assert ParallelStrategy(16, 2, 1, ep=8, etp=2) == plain and ParallelStrategy(16, 2, 1, ep=8, etp=2).etp is None
    assert plain.expert_tp == 2 and "etp" not in plain.to_dict() and str(plain) == "dp16tp2pp1ep8"
    folded = ParallelStrategy(16, 2, 1, 1, ep=8, etp=1)
    assert folded != plain and folded.expert_tp == 1
    assert str(folded) == "dp16tp2pp1ep8etp1,zero1"
    assert folded.to_dict() == {"dp": 16, "tp": 2, "pp": 1, "zero_stage": 1, "ep": 8, "etp": 1}
    plan = Plan("x", [Task("update_actor", "train", "actor", Allocation(tuple(range(32)), folded))])
    assert Plan.from_json(plan.to_json()).tasks[0].allocation.strategy == folded
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_etp_folds_ep_over_dp_times_tp_and_is_refused_otherwise():
    # Qwen3-235B's asynchronous recipe: tp4 ep16 etp1 with dp4: ep does not divide dp, ep*etp divides dp*tp
    assert ParallelStrategy(4, 4, 8, ep=16, etp=1).ep == 16
    with pytest.raises(PlanError, match="ep=16 must divide dp=4"):
        ParallelStrategy(4, 4, 8, ep=16)
    with pytest.raises(PlanError, match=r"ep\*etp = 32 must divide dp\*tp = 16"):
        ParallelStrategy(4, 4, 8, ep=16, etp=2)
    with pytest.raises(PlanError, match="expert tensor parallelism needs expert parallelism"):
        ParallelStrategy(4, 4, 1, etp=1)
    with pytest.raises(PlanError, match="etp=0 must be an integer >= 1"):
        ParallelStrategy(4, 4, 1, ep=2, etp=0)
    assert parse_layout("dp16tp2pp1ep8etp1", 0, "update_actor") == ParallelStrategy(16, 2, 1, ep=8, etp=1)
    assert parse_layout(str(ParallelStrategy(4, 4, 8, ep=16, etp=1)), 0, "x") == ParallelStrategy(4, 4, 8, ep=16, etp=1)
    with pytest.raises(PlanError, match=r"system\.layouts\.x='dp4tp4pp8ep16etp2': .*must divide dp\*tp = 16"):
        parse_layout("dp4tp4pp8ep16etp2", 0, "x")
    with pytest.raises(PlanError, match="dp<D>tp<T>pp<P>"):
        parse_layout("dp16tp2pp1etp1", 0, "x")  # etp only after ep


@pytest.mark.parametrize("dp,tp,pp,ep,etp,span", [
    (16, 2, 1, 8, 1, 8),  # Qwen3-30B-A3B's v0.4 recipe: each domain is one node's 8 GPUs
    (16, 2, 1, 8, None, 16),  # the same ep with every expert over tp: two nodes
    (4, 4, 8, 16, 1, 16),  # Qwen3-235B's asynchronous recipe, Megatron order: one stage's 16 GPUs
    (8, 2, 2, 4, 1, 4),
])
def test_ep_span_of_an_expert_tensor_parallel_domain(dp, tp, pp, ep, etp, span):
    """A domain is ``ep * etp`` consecutive ranks of one stage, tp fastest: in Megatron-core's
    order that is ``ep * etp`` consecutive devices."""
    alloc = Allocation.pipeline_outermost(tuple(range(dp * tp * pp)), ParallelStrategy(dp, tp, pp, ep=ep, etp=etp))
    assert alloc.ep_span == span


def test_etp_memory_is_the_closed_form():
    """Routed experts / (ep * etp) per device, the rest / tp; ZeRO shards the experts' states over the
    dp * tp / (ep * etp) ranks that hold the same experts."""
    from harness.costmodel import memory
    from harness.costmodel.llama import routed_expert_params_per_layer
    d, tp, pp, ep, dp = MOE, 2, 1, 8, 16
    experts = d.num_layers * routed_expert_params_per_layer(d)
    dense = memory.max_stage_params(d, pp) - experts
    for etp in (1, 2):
        assert memory.weights_gb(d, tp, pp, ep=ep, etp=etp) * 1e9 == pytest.approx(
            (dense / tp + experts / (ep * etp)) * 2, rel=1e-12)
        assert memory.expert_weights_gb(d, tp, pp, ep, etp=etp) * 1e9 == pytest.approx(experts / (ep * etp) * 2)
        replicas = dp * tp // (ep * etp)
        want = (dense / tp * (2 + 2 + 12 / dp) + experts / (ep * etp) * (2 + 2 + 12 / replicas)) / 1e9
        assert memory.training_state_gb(d, dp, tp, pp, zero_stage=1, ep=ep, etp=etp) == pytest.approx(want)
        assert memory.updated_params_per_device(d, dp, tp, pp, 1, ep, etp) == pytest.approx(
            dense / tp / dp + experts / (ep * etp) / replicas)
    assert memory.weights_gb(d, tp, pp, ep=ep, etp=tp) == memory.weights_gb(d, tp, pp, ep=ep)


def test_etp_keeps_the_flops_and_dispatches_its_share_of_the_tokens():
    """Splitting each expert over etp < tp ranks leaves a device's FLOPs alone, reads 1/(ep*etp) of
    the routed experts, and sends etp/tp of its tp group's tokens through each all-to-all."""
    from harness.costmodel.compute import Roofline
    from harness.costmodel.llama import moe_dispatch_bytes, routed_expert_params_per_layer
    sent = []

    def alltoall_s(num_bytes, ep, span):
        sent.append((num_bytes, ep, span))
        return 0.0

    gpu = SimpleNamespace(peak_bf16_tflops=989, matmul_efficiency_frac=0.6, hbm_bandwidth_gbps=3350,
                          memory_efficiency_frac=0.8)
    roof = Roofline(gpu, alltoall_s=alltoall_s)
    tokens, tp, ep = 4096.0, 2, 8
    plain = roof.forward_cost(MOE, tokens, 2048.0, tp, ep=ep, ep_span=16)
    folded = roof.forward_cost(MOE, tokens, 2048.0, tp, ep=ep, ep_span=8, etp=1)
    assert folded.flops == plain.flops
    extra = MOE.num_layers * routed_expert_params_per_layer(MOE) * (1 / (ep * 1) - 1 / (ep * tp)) * 2
    assert folded.num_bytes - plain.num_bytes == pytest.approx(extra)
    assert sent[0] == (moe_dispatch_bytes(MOE, tokens), ep, 16)
    assert sent[-1] == (moe_dispatch_bytes(MOE, tokens / tp), ep, 8)


def test_a_pinned_etp_layout_plans_writes_etp_and_keeps_its_all_to_alls_in_a_node():
    """NeMo-RL's Qwen3-30B-A3B recipe (tp2 ep8 etp1 on 32 GPUs): each expert-parallel domain is one
    node, so training is faster than the same ep with experts split over tp (domains of two nodes);
    the layout reaches plan.json."""
    base = ["+system=nemo_rl", "algo=grpo", "model=qwen3_30b_a3b", "cluster=h100_8x", "cluster.num_nodes=4",
            "workload.global_batch_size=64", "workload.mini_batch_size=64", "workload.micro_batch_size=1"]
    folded_plan, ctx, _ = plan_for([*base, "system.train_layout=dp16tp2pp1ep8etp1"])
    plain_plan, _, _ = plan_for([*base, "system.train_layout=dp16tp2pp1ep8"])
    folded, plain = (p.task("update_actor").allocation for p in (folded_plan, plain_plan))
    assert folded.strategy.etp == 1 and folded.ep_span == 8 and plain.ep_span == 16
    strategies = [t["allocation"]["strategy"] for t in json.loads(folded_plan.to_json())["tasks"]]
    assert any(s.get("etp") == 1 for s in strategies)
    cm, model = ctx.cost_model, ctx.model("actor")
    args = (model, 4096.0, 4096.0, 2)
    assert (cm.backward_s(*args, ep=8, ep_span=folded.ep_span, etp=1)
            < cm.backward_s(*args, ep=8, ep_span=plain.ep_span))


def test_rlhfuse_keeps_a_pinned_etp_in_its_fused_stage():
    plan, _, _ = plan_for(["+system=rlhfuse", "model=qwen3_30b_a3b", "cluster.num_nodes=8",
                           "system.fused_search.max_steps=50", "system.layouts.update_actor=dp32tp2pp1ep8etp1"])
    actor = plan.task("update_actor").allocation
    assert actor.strategy.ep == 8 and actor.strategy.etp == 1 and actor.ep_span == 8
