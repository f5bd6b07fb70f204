"""``+system=verl`` and ``+system=nemo_rl``: time-sliced colocation with a weight refit into vLLM
(baselines/refit.py).

Oracles: the plan's structure follows from the frameworks' design (every task on every GPU, vLLM
engines of the chosen width, one refit movement per iteration, log-probs recomputed in the
training layout); the simulated stages never overlap (one pool, stages in turn); the searches keep
the fastest of the candidates they name; pinned knobs are honoured or refused with their key."""
import pytest

from harness.core.plan import MovementKind, TaskKind
from harness.errors import HarnessError
from harness.planning.estimate import simulate_plan
from harness.system import discover_systems
from harness.testing import plan_for

ONE_NODE = ["model=7b", "cluster.num_nodes=1", "workload.global_batch_size=64", "workload.mini_batch_size=16"]
GRPO = ["algo=grpo", "workload.global_batch_size=16", "workload.mini_batch_size=4"]


def test_both_are_found():
    assert {"verl", "nemo_rl"} <= set(discover_systems())


@pytest.mark.parametrize("system", ["verl", "nemo_rl"])
@pytest.mark.parametrize("algo", [[], GRPO], ids=["ppo", "grpo"])
def test_every_task_on_every_gpu_with_a_refit_and_recomputed_logprobs(system, algo):
    plan, ctx, _ = plan_for([f"+system={system}", *ONE_NODE, *algo])
    plan.validate(ctx.num_devices)
    devices = tuple(range(ctx.num_devices))
    assert all(t.allocation.mesh == devices for t in plan.tasks)
    train = plan.task("update_actor").allocation
    assert plan.task("logprobs").allocation == train  # the training engine's forward pass
    assert plan.task("logprobs").writes == ("old_logprobs",) and "old_logprobs" not in plan.task("gen").writes
    for task in plan.tasks:
        if task.kind in (TaskKind.INFERENCE, TaskKind.TRAIN):
            assert task.allocation == train, task.name
    gen = plan.task("gen").allocation.strategy
    assert gen.tp == plan.notes["rollout_tp"] and gen.pp == 1 and gen.dp * gen.tp == ctx.num_devices
    [refit] = plan.weight_movements
    assert (refit.model.value, refit.kind, refit.source, refit.target) == (
        "actor", MovementKind.REALLOC, train, plan.task("gen").allocation)
    trace = simulate_plan(ctx, plan)
    windows = sorted((min(s.start_s for s in trace.spans if s.task == t.name),
                      max(s.end_s for s in trace.spans if s.task == t.name)) for t in plan.tasks)
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert start >= end - 1e-9 * trace.makespan_s  # one pool: stages in turn


def test_verl_trains_with_fsdp_and_nemo_rl_with_megatron():
    verl, ctx, _ = plan_for(["+system=verl", *ONE_NODE])
    nemo, _, _ = plan_for(["+system=nemo_rl", *ONE_NODE])
    assert verl.engines.training.name == "fsdp" and nemo.engines.training.name == "megatron"
    assert verl.task("update_actor").allocation.strategy.zero_stage == 3
    assert verl.task("update_actor").allocation.strategy.dp == ctx.num_devices
    assert verl.engines.generation.name == nemo.engines.generation.name == "vllm"


@pytest.mark.parametrize("knob", ["system.rollout_tp", "system.train_layout"])
def test_searches_keep_the_fastest_candidate(knob):
    base = ["+system=verl", *ONE_NODE, "engine.training=megatron"]
    plan, ctx, _ = plan_for(base)
    chosen = simulate_plan(ctx, plan).makespan_s
    values = ["1", "2", "4", "8"] if knob == "system.rollout_tp" else ["dp8tp1pp1", "dp4tp2pp1", "dp2tp4pp1",
                                                                       "dp1tp8pp1", "dp4tp1pp2"]
    pinned = {"system.rollout_tp": f"system.rollout_tp={plan.notes['rollout_tp']}",
              "system.train_layout": f"system.train_layout={plan.notes['train_layout'].split(',')[0]}"}
    tried = 0
    for value in values:
        other_knob = [o for k, o in pinned.items() if k != knob]
        try:
            other, _, _ = plan_for([*base, f"{knob}={value}", *other_knob])
        except HarnessError:  # does not fit or cannot split the batch: never chosen
            continue
        tried += 1
        assert chosen <= simulate_plan(ctx, other).makespan_s * (1 + 1e-12), (knob, value)
    assert tried >= 2


def test_pinned_knobs_are_used_or_refused_with_their_key():
    plan, _, _ = plan_for(["+system=nemo_rl", *ONE_NODE, "system.gen_tp=2", "system.train_layout=dp2tp4pp1"])
    assert plan.task("gen").allocation.strategy.tp == 2
    assert str(plan.task("update_actor").allocation.strategy) == "dp2tp4pp1,zero1"
    with pytest.raises(HarnessError, match="system.gen_tp=3"):
        plan_for(["+system=nemo_rl", *ONE_NODE, "system.gen_tp=3"])
    with pytest.raises(HarnessError, match=r"system.train_layout=dp2tp4pp1 pins a Megatron layout.*"
                                           r"engine.training=megatron"):
        plan_for(["+system=verl", *ONE_NODE, "system.train_layout=dp2tp4pp1"])


def test_engines_span_whole_nodes_only_when_a_node_cannot_hold_one():
    """DeepSeek-V3 (671B: 168 GB a GPU in a vLLM engine of one node's 8 GPUs) gets engines over whole
    nodes in both frameworks, as NeMo-RL's DeepSeek-V3 recipes run vLLM (tensor parallelism 32 or
    64); a model a node holds keeps engines of at most a node (the other tests); a pinned width over
    whole nodes is used, and one that neither divides a node nor is a multiple of it is refused."""
    for system in ("verl", "nemo_rl"):
        plan, ctx, _ = plan_for([f"+system={system}", "algo=dapo", "model=deepseek_v3", "cluster.num_nodes=64"])
        gen, per_node = plan.task("gen").allocation.strategy, ctx.cluster.gpus_per_node
        assert gen.tp > per_node and gen.tp % per_node == 0 and gen.tp == plan.notes["rollout_tp"], system
    two_nodes = ["+system=nemo_rl", "model=7b", "cluster.num_nodes=2", "workload.global_batch_size=64",
                 "workload.mini_batch_size=16"]
    plan, _, _ = plan_for([*two_nodes, "system.gen_tp=16"])
    assert plan.task("gen").allocation.strategy.tp == 16
    with pytest.raises(HarnessError, match=r"system.gen_tp=12\): .*or be a multiple of them"):
        plan_for([*two_nodes, "system.gen_tp=12"])


def test_fsdp_refuses_a_mini_batch_smaller_than_the_gpus_and_names_the_fix():
    with pytest.raises(HarnessError, match=r"set workload.mini_batch_size=8 or engine.training=megatron"):
        plan_for(["+system=verl", *ONE_NODE, "workload.mini_batch_size=4", "workload.micro_batch_size=1"])
    plan_for(["+system=verl", *ONE_NODE, "workload.mini_batch_size=8", "workload.micro_batch_size=1"])


def test_fsdp_micro_batches_divide_each_gpus_share():
    """16 samples per mini-batch over 8 GPUs: 2 each, so a workload micro-batch of 4 trains in
    micro-batches of 2 (one per step), and one of 1 in two accumulation steps."""
    for micro, expected in ((4, 2), (1, 1)):
        plan, _, _ = plan_for(["+system=verl", *ONE_NODE, f"workload.micro_batch_size={micro}"])
        assert {stage.micro_batch_size for stage in plan.training} == {expected}


def test_nemo_rl_with_generation_nodes_broadcasts_to_them():
    plan, ctx, _ = plan_for(["+system=nemo_rl", "model=7b", "cluster.num_nodes=2", *GRPO,
                             "system.generation_nodes=1"])
    gen, train = plan.task("gen").allocation, plan.task("update_actor").allocation
    assert set(gen.mesh) == set(range(8, 16)) and set(train.mesh) == set(range(8))
    [sync] = plan.weight_movements
    assert sync.kind == MovementKind.PARAM_SYNC
    with pytest.raises(HarnessError, match="system.generation_nodes=2"):
        plan_for(["+system=nemo_rl", "model=7b", "cluster.num_nodes=2", *GRPO, "system.generation_nodes=2"])


def test_nemo_rl_keeps_the_policy_and_reference_in_host_memory_while_vllm_generates():
    """Colocated NeMo-RL offloads the policy's training states and the reference weights
    (``offload_before_refit`` / ``offload_after_refit``): the plan lists both as offloaded and keeps
    no state of theirs resident, so generation's memory holds neither; with the knob off both stay
    resident, as verl's plan keeps them; with generation on nodes of its own nothing is offloaded."""
    plan, ctx, _ = plan_for(["+system=nemo_rl", *ONE_NODE, *GRPO])
    assert set(plan.offloaded) == {"actor", "ref"} and not plan.resident
    assert "offloaded" in plan.notes
    resident, _, _ = plan_for(["+system=nemo_rl", *ONE_NODE, *GRPO, "system.offload_for_generation=false"])
    assert not resident.offloaded and {r.model for r in resident.resident} == {"actor", "ref"}
    split, _, _ = plan_for(["+system=nemo_rl", "model=7b", "cluster.num_nodes=2", *GRPO, "system.generation_nodes=1"])
    assert not split.offloaded
    verl, _, _ = plan_for(["+system=verl", *ONE_NODE, *GRPO])
    assert not verl.offloaded


def test_an_offloaded_policy_copies_its_training_states_in_and_out_around_training():
    """Closed form: the actor's training task starts with one PCIe copy of its training states
    (what each device holds under the layout) and ends with another, each
    ``host_transfer_s(training_state_gb)``; the log-prob and reference passes each copy their
    weights in first. Without offloading the same plan has none of these spans."""
    plan, ctx, _ = plan_for(["+system=nemo_rl", *ONE_NODE, *GRPO])
    trace = simulate_plan(ctx, plan)
    cm, actor = ctx.cost_model.with_engines(plan.engines), ctx.models.actor
    s = plan.task("update_actor").allocation.strategy
    copy_s = cm.host_transfer_s(cm.training_state_gb(actor, s.dp, s.tp, s.pp, s.zero_stage, False, s.ep) * 1e9)
    assert copy_s > 0
    spans = [sp for sp in trace.spans if sp.task == "update_actor" and sp.kind in ("load", "offload")]
    assert [sp.kind for sp in spans] == ["load", "offload"]
    assert all(sp.duration_s == pytest.approx(copy_s, rel=1e-12) for sp in spans)
    train_spans = [sp for sp in trace.spans if sp.task == "update_actor"]
    assert spans[0].start_s == min(sp.start_s for sp in train_spans)
    assert spans[1].end_s == max(sp.end_s for sp in train_spans)
    assert {sp.task for sp in trace.spans if sp.kind == "load"} == {"update_actor", "logprobs", "ref"}
    resident, rctx, _ = plan_for(["+system=nemo_rl", *ONE_NODE, *GRPO, "system.offload_for_generation=false"])
    assert not [sp for sp in simulate_plan(rctx, resident).spans if sp.kind in ("load", "offload")]


def test_offloading_for_generation_is_what_lets_a_recipe_layout_fit():
    """Llama-3.1-8B on one node of 8 H100s with NeMo-RL's v0.3 layout (dp 8, vLLM tp 1): with the
    policy's states and the reference weights resident, generation's vLLM copy does not fit beside
    them, and the refusal names generation; offloaded, the plan fits and generation's KV capacity
    is the whole usable memory less vLLM's copy of the weights (nothing else is resident)."""
    base = ["+system=nemo_rl", "model=llama3_1_8b", "cluster.num_nodes=1", *GRPO, "system.train_layout=dp8tp1pp1",
            "system.gen_tp=1"]
    plan, ctx, _ = plan_for(base)
    with pytest.raises(HarnessError, match="task gen"):
        plan_for([*base, "system.offload_for_generation=false"])
    from harness.planning.memory import check_plan_memory

    report = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    cm = ctx.cost_model
    assert report.kv_capacity_gb["gen"] == pytest.approx(cm.hbm_capacity_gb - cm.weights_gb(ctx.models.actor, 1, 1),
                                                         rel=1e-12)


@pytest.mark.parametrize("system", ["verl", "nemo_rl"])
def test_gpu_memory_utilization_caps_the_kv_cache_at_vllms_share_less_its_weights(system):
    """vLLM's gpu_memory_utilization: the engine's share of each GPU holds its weights and its KV
    cache, so the KV capacity is that share less the weights (closed form), below what the plan
    would otherwise leave free; generation with less KV is never faster."""
    from harness.planning.memory import check_plan_memory

    tp_key = {"verl": "system.rollout_tp", "nemo_rl": "system.gen_tp"}[system]
    base = [f"+system={system}", *GRPO, "model=7b", "cluster.num_nodes=1", f"{tp_key}=1"]
    free, ctx, _ = plan_for(base)
    capped, _, _ = plan_for([*base, "system.gpu_memory_utilization=0.3"])
    assert capped.generation.memory_frac == 0.3 and free.generation.memory_frac is None
    gen = capped.task("gen")
    s, cm = gen.allocation.strategy, ctx.cost_model
    kv_free = check_plan_memory(free, cm, ctx.models, ctx.workload).kv_capacity_gb["gen"]
    kv_capped = check_plan_memory(capped, cm, ctx.models, ctx.workload).kv_capacity_gb["gen"]
    assert kv_capped == pytest.approx(0.3 * cm.gpu.hbm_gb - cm.weights_gb(ctx.model("actor"), s.tp, s.pp))
    assert kv_capped < kv_free
    assert simulate_plan(ctx, capped).makespan_s >= simulate_plan(ctx, free).makespan_s


def test_a_share_too_small_for_the_weights_is_refused_before_any_work():
    with pytest.raises(HarnessError, match="gives its generation engine 0.1 of each device"):
        plan_for(["+system=nemo_rl", *GRPO, "model=7b", "cluster.num_nodes=1", "system.gen_tp=1",
                  "system.gpu_memory_utilization=0.1"])


@pytest.mark.parametrize("value", [0, 1.5])
def test_gpu_memory_utilization_outside_zero_one_is_a_config_error(value):
    with pytest.raises(HarnessError, match=r"system\.gpu_memory_utilization"):
        plan_for(["+system=verl", *GRPO, "model=7b", "cluster.num_nodes=1", f"system.gpu_memory_utilization={value}"])
