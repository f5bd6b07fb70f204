"""OpenRLHF's Ray placement (arXiv 2405.11143): ref, reward, actor, critic and vLLM on disjoint pools
sized by ``system.split``, param_sync to the vLLM engines, concurrent inference and training."""
import json

import pytest

from harness.core import metrics as mk
from harness.system import discover_systems
from harness.errors import ConfigError, PlanError
from harness.core.plan import MovementKind, Plan, ResidentState, TaskKind
from harness.testing import plan_for, simulate_plan_metrics

ONE_NODE = ["+system=openrlhf", "cluster=a800_8x", "cluster.num_nodes=1"]  # OpenRLHF's benchmark: 8 A800-80GB
SEVEN_B = ONE_NODE + ["model=7b"]
RAY_ONLY = ["system.split.actor=4", "system.split.gen=0"]  # the benchmark's "ray" row: 1:1:4:2, no vLLM
POOLS = {"ref": "ref", "reward": "reward", "values": "critic", "update_actor": "actor", "update_critic": "critic"}


def pools(plan) -> dict[str, set[int]]:
    out = {role: set(plan.task(task).allocation.mesh) for task, role in POOLS.items()}
    if plan.weight_movements and plan.weight_movements[0].kind == MovementKind.PARAM_SYNC:
        out["gen"] = set(plan.task("gen").allocation.mesh)
    return out


def spans_by_task(trace) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for s in trace.spans:
        start, end = out.get(s.task, (float("inf"), float("-inf")))
        out[s.task] = (min(start, s.start_s), max(end, s.end_s))
    return out


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


@pytest.fixture(scope="module")
def vllm_run():
    """7B with vLLM on one node (the default 1:1:2:2:2, ZeRO-2), simulated."""
    plan, ctx, _ = plan_for(SEVEN_B)
    trace, row = simulate_plan_metrics(plan, ctx)
    return plan, ctx, trace, row


def test_found_without_an_entry_point():
    assert "openrlhf" in discover_systems()


def test_default_split_on_one_node():
    plan, ctx, _ = plan_for(SEVEN_B)
    plan.validate(ctx.num_devices)
    p = pools(plan)
    assert {role: len(devs) for role, devs in p.items()} == {"ref": 1, "reward": 1, "actor": 2, "critic": 2, "gen": 2}
    roles = list(p)
    assert all(not p[a] & p[b] for i, a in enumerate(roles) for b in roles[i + 1:])  # disjoint
    assert set().union(*p.values()) == set(range(8)) == set(plan.devices())  # and covering the node
    for task in POOLS:
        s = plan.task(task).allocation.strategy
        assert (s.dp, s.tp, s.pp) == (len(plan.task(task).allocation.mesh), 1, 1)
    zero = {t: plan.task(t).allocation.strategy.zero_stage for t in POOLS}
    assert zero == {"ref": 0, "reward": 0, "values": 2, "update_actor": 2, "update_critic": 2}
    assert plan.task("values").allocation == plan.task("update_critic").allocation  # the critic's own engine
    gen = plan.task("gen").allocation.strategy
    assert (gen.dp, gen.tp, gen.pp) == (2, 1, 1)  # two vLLM engines of one GPU
    assert plan.generation.batching == "continuous" and plan.engines.generation.kernels == "graph"
    assert plan.generation.max_batch_size == 16  # each engine gets one actor rank's micro-rollout batch
    assert plan.notes["pools/ref"] == "0..0 (1 device)" and plan.notes["pools/gen"] == "6..7 (2 devices)"
    assert plan.notes["split"] == "1:1:2:2:2"
    assert plan.engines is not None
    assert (plan.engines.generation.name, plan.engines.training.name) == ("vllm", "deepspeed")


def test_actor_reaches_vllm_by_param_sync():
    plan, _, _ = plan_for(SEVEN_B)
    (move,) = plan.weight_movements
    assert move.kind == MovementKind.PARAM_SYNC and move.task == "param_sync"
    assert move.source == plan.task("update_actor").allocation and move.target == plan.task("gen").allocation
    assert "actor_weights@gen" in plan.task("gen").reads
    assert ResidentState("actor", "gen", "weights") in plan.resident  # the engines' own copy


def test_simulated_iteration_overlaps_pools(vllm_run):
    plan, _, trace, row = vllm_run
    assert row[mk.STEP_TIME] > 0 and row[mk.timing_key("param_sync")] > 0
    span = spans_by_task(trace)
    assert span["gen"][0] >= span["param_sync"][1] - 1e-12  # generation waits for the synced weights
    assert overlap(span["update_actor"], span["update_critic"])  # disjoint pools train at the same time
    assert overlap(span["ref"], span["reward"]) and overlap(span["reward"], span["values"])
    assert min(span[t][0] for t in ("ref", "reward", "values")) >= span["gen"][1] - 1e-12


def test_ray_without_vllm_generates_on_the_actor_pool():
    plan, ctx, _ = plan_for(SEVEN_B + RAY_ONLY)
    plan.validate(ctx.num_devices)
    p = pools(plan)
    assert {role: len(devs) for role, devs in p.items()} == {"ref": 1, "reward": 1, "actor": 4, "critic": 2}
    assert set().union(*p.values()) == set(range(8))
    assert plan.task("gen").allocation == plan.task("update_actor").allocation  # in place: no weight movement
    assert plan.weight_movements == [] and plan.tasks_of(TaskKind.WEIGHT_MOVEMENT) == []
    g = plan.generation
    assert (g.batching, plan.engines.generation.kernels, g.max_batch_size, g.pad_to_longest) == ("static", "eager", 16, True)
    assert plan.engines.generation.name == "hf_generate_fa2"  # derived from system.split.gen=0
    assert "pools/gen" not in plan.notes and plan.notes["split"] == "1:1:4:2:0"


@pytest.mark.parametrize("extra", [["model=7b"], ["model=7b", "system.zero_stage=3"]])
def test_ray_without_vllm_runs(extra):
    plan, ctx, _ = plan_for(ONE_NODE + RAY_ONLY + extra)
    assert plan.weight_movements == []  # under ZeRO-3 the shards are gathered per step, in place
    assert plan.generation.synced_instances == ("system.zero_stage=3" in extra)
    trace, row = simulate_plan_metrics(plan, ctx)
    assert row[mk.STEP_TIME] > 0
    span = spans_by_task(trace)
    assert overlap(span["update_actor"], span["update_critic"])
    assert span["gen"][0] == 0.0 and "param_sync" not in span


def test_units_scale_with_the_cluster():
    plan, _, _ = plan_for(["+system=openrlhf", "model=7b", "cluster=a800_8x", "cluster.num_nodes=4",
                           "system.vllm_tp=2"])
    p = pools(plan)
    assert {role: len(devs) for role, devs in p.items()} == {"ref": 4, "reward": 4, "actor": 8, "critic": 8, "gen": 8}
    assert p["gen"] == set(range(24, 32))
    gen = plan.task("gen").allocation
    assert (gen.strategy.dp, gen.strategy.tp) == (4, 2)
    assert all(len({d // 8 for d in gen.replica_devices(k)}) == 1 for k in range(4))  # engines inside a node
    assert plan.generation.max_batch_size == 16 * 2  # 8 actor ranks over 4 engines
    plan, _, _ = plan_for(SEVEN_B + ["system.vllm_max_num_seqs=256"])
    assert plan.generation.max_batch_size == 256


@pytest.mark.parametrize(("overrides", "error", "match"), [
    (["system.split.gen=1"], PlanError, r"system\.split=1:1:2:2:1 .* 7 units, which do not divide .* 8 devices"),
    (["system.split.ref=0"], PlanError, r"system\.split=0:1:2:2:2 .* the ref pool would be empty"),
    (["system.split.critic=0", "system.split.actor=4"], PlanError, r"system\.split=.*critic pool would be empty"),
    (["system.split.gen=-2"], ConfigError, r"system\.split=1:1:2:2:-2 .* non-negative"),
    (["system.vllm_tp=4"], PlanError, r"system\.vllm_tp=4: .* gen pool's 2 devices"),
])
def test_bad_splits_are_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        plan_for(SEVEN_B + overrides)


def test_batches_follow_deepspeeds_rule_on_both_pools():
    plan, _, _ = plan_for(SEVEN_B + ["system.mini_batch_size=32", "system.micro_batch_size=4",
                                     "workload.activation_recompute=full"])  # 4 samples' activations fit then
    assert plan.mini_batch_size == 32
    for stage in plan.training:  # 32 = 4 per GPU x dp 2 x 4 accumulation steps
        assert stage.micro_batch_size == 4 and stage.num_minibatches == 512 // 32
        assert [p.num_mbs for p in stage.schedule.pipes.values()] == [4]
    plan, _, _ = plan_for(SEVEN_B)  # the workload's mini-batch (64) and micro-batch (1)
    assert plan.mini_batch_size == 64 and {s.micro_batch_size for s in plan.training} == {1}
    # the actor's 4 GPUs need a multiple of 4 x 4 = 16 samples; the critic's 2 would take 8
    with pytest.raises(PlanError, match=r"system\.mini_batch_size=8 .* system\.micro_batch_size=4 x the actor "
                                        r"pool's dp=4 = 16"):
        plan_for(SEVEN_B + RAY_ONLY + ["system.mini_batch_size=8", "system.micro_batch_size=4"])
    with pytest.raises(PlanError, match=r"system\.mini_batch_size=48 .* must divide the global batch"):
        plan_for(SEVEN_B + ["system.mini_batch_size=48"])


def test_engine_that_contradicts_the_split_is_refused():
    with pytest.raises(PlanError, match=r"system\.split\.gen=0 means no vLLM pool"):
        plan_for(SEVEN_B + RAY_ONLY + ["system.generation_engine=vllm"])
    with pytest.raises(PlanError, match=r"system\.split\.gen=2 gives vLLM engines a pool of their own"):
        plan_for(SEVEN_B + ["engine.generation=hf_generate"])


def test_plan_round_trips(vllm_run):
    plan, ctx, _, _ = vllm_run
    plan.validate(ctx.num_devices)
    text = plan.to_json()
    assert Plan.from_json(text).to_json() == text
    json.loads(text)


def test_cli_run(run_harness, tmp_path):
    proc = run_harness(ONE_NODE + ["model=tiny2", "workload=tiny", "logger=none", "logger.progress_bar=false",
                                   "backend.num_iterations=2", f"results_dir={tmp_path / 'results'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (summary,) = (tmp_path / "results").glob("default/openrlhf*/tiny2/seed0/summary.json")
    data = json.loads(summary.read_text())
    assert data["metrics"][mk.timing_key("param_sync")] > 0
    assert data["info"]["notes/pools/gen"] == "6..7 (2 devices)"


def test_cli_refuses_a_split_that_does_not_divide_the_cluster(refused_in_process):
    line = refused_in_process(*ONE_NODE, "model=tiny2", "workload=tiny", "system.split.gen=1")
    assert "system.split=1:1:2:2:1" in line
