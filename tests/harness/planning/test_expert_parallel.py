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
                                         parse_layout)
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
    assert {(s.dp, s.tp, s.pp, s.ep) for s in got} == {(s.dp, s.tp, s.pp, ep) for s in base
                                                       for ep in (1, 2, 4, 8) if s.dp % ep == 0}
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
