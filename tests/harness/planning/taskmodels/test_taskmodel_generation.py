"""Simulated generation against hand-computed timelines.

A profile table makes every op time a round number: prefill 10 ms and decode step 1 ms whatever
the batch (two equal points -> flat interpolation), so the expected timelines can be worked out
by hand (comments below).
"""
import numpy as np
import pytest

from harness.planning.taskmodels.generation import simulate_generation
from harness.core.plan import Allocation, GenerationPolicy, ParallelStrategy, Task


def _gen(cm, model, policy, dp=1):
    task = Task("gen", "generate", "actor", Allocation(tuple(range(dp)), ParallelStrategy(dp=dp)))
    prompts = np.array([4, 4, 4, 4])
    outputs = np.array([1, 2, 3, 6])
    return simulate_generation(cm, task, policy, model, prompts, outputs, 0.0, kv_capacity_gb=10.0, max_gen_len=16)


def test_continuous_batching_timeline(setup):
    # max batch 2. t=0 admit s0,s1, prefill -> 10; 1 step -> s0 done at 11.
    # admit s2, prefill -> 21; 1 step -> s1 done at 22. admit s3, prefill -> 32;
    # 2 steps -> s2 done at 34; 4 more steps -> s3 done at 38.
    cm, model = setup
    res = _gen(cm, model, GenerationPolicy("continuous", max_batch_size=2))
    assert [r.finish_s for r in res.samples] == pytest.approx([0.011, 0.022, 0.034, 0.038])
    assert res.end_s == pytest.approx(0.038)


def test_static_batching_decodes_until_longest(setup):
    # rounds of 2. Round 1: prefill -> 10, decode max(1,2)=2 steps -> 12 (s0 at 11, s1 at 12).
    # Round 2: prefill -> 22, decode max(3,6)=6 steps -> 28 (s2 at 25, s3 at 28).
    cm, model = setup
    res = _gen(cm, model, GenerationPolicy("static", max_batch_size=2))
    assert [r.finish_s for r in res.samples] == pytest.approx([0.011, 0.012, 0.025, 0.028])
    assert res.end_s == pytest.approx(0.028)


def test_instances_split_samples_round_robin(setup):
    # 2 instances: {s0, s2} and {s1, s3}, continuous, unlimited batch.
    # inst 0: prefill -> 10, s0 done at 11, s2 at 13. inst 1: prefill -> 10, s1 at 12, s3 at 16.
    cm, model = setup
    res = _gen(cm, model, GenerationPolicy("continuous"), dp=2)
    assert [r.finish_s for r in res.samples] == pytest.approx([0.011, 0.012, 0.013, 0.016])
    assert [i.end_s for i in res.instances] == pytest.approx([0.013, 0.016])
    assert {span.devices for span in res.instances[1].spans} == {(1,)}


def test_kv_capacity_limits_the_batch(setup):
    # KV reserved per sample = prompt + max_gen_len = 4 + 16 = 20 tokens; a capacity of 45 tokens
    # admits 2 at a time, which gives the max-batch-2 timeline.
    cm, model = setup
    task = Task("gen", "generate", "actor", Allocation((0,), ParallelStrategy()))
    kv_gb = cm.kv_cache_gb(model, 45, 1, 1)
    res = simulate_generation(cm, task, GenerationPolicy("continuous"), model, np.array([4, 4, 4, 4]),
                              np.array([1, 2, 3, 6]), 0.0, kv_gb, 16)
    assert res.end_s == pytest.approx(0.038)


def test_synced_static_rounds_end_on_the_longest_instance(setup):
    # 2 instances, rounds of 1 sample: instance 0 holds s0 (1 token) then s2 (3), instance 1 holds
    # s1 (2) then s3 (6). Synced (generate(synced_gpus=True)): round 1 decodes max(1, 2) = 2 steps on
    # both -> 12; round 2 decodes max(3, 6) = 6 steps on both -> 12 + 10 + 6 = 28. Unsynced, instance 0
    # would end at 10 + 1 + 10 + 3 = 24.
    cm, model = setup
    synced = _gen(cm, model, GenerationPolicy("static", max_batch_size=1, synced_instances=True), dp=2)
    assert [i.end_s for i in synced.instances] == pytest.approx([0.028, 0.028])
    assert [r.finish_s for r in synced.samples] == pytest.approx([0.011, 0.012, 0.025, 0.028])
    free = _gen(cm, model, GenerationPolicy("static", max_batch_size=1), dp=2)
    assert [i.end_s for i in free.instances] == pytest.approx([0.024, 0.028])


def test_padded_lengths_are_the_longest_of_each_round():
    from harness.planning.taskmodels.generation import padded_lengths

    prompts, outputs = np.array([4, 5, 6, 7]), np.array([1, 2, 3, 6])
    plain = GenerationPolicy("static", max_batch_size=1)
    assert list(padded_lengths(plain, 2, prompts, outputs)) == [5, 7, 9, 13]
    # per instance (dp 2, rounds of 1): every sample is its own round -> unchanged
    own = GenerationPolicy("static", max_batch_size=1, pad_to_longest=True)
    assert list(padded_lengths(own, 2, prompts, outputs)) == [5, 7, 9, 13]
    # synced: round 1 = {s0, s1} -> 5 + 2 = 7; round 2 = {s2, s3} -> 7 + 6 = 13
    synced = GenerationPolicy("static", max_batch_size=1, pad_to_longest=True, synced_instances=True)
    assert list(padded_lengths(synced, 2, prompts, outputs)) == [7, 7, 13, 13]
    # one instance, rounds of 2: {s0, s2} is not a round -- instance 0 holds all four in order
    two = GenerationPolicy("static", max_batch_size=2, pad_to_longest=True)
    assert list(padded_lengths(two, 1, prompts, outputs)) == [7, 7, 13, 13]


def test_padding_and_sync_need_static_rounds():
    from harness.errors import PlanError

    with pytest.raises(PlanError, match="static"):
        GenerationPolicy("continuous", pad_to_longest=True)


def _one_instance_end_s(cm, model, prompts, outputs, max_batch, kv_tokens, max_gen_len, tp, pp, ep):
    """The end of one continuous-batching instance as the simulator runs it (ContinuousInstance)."""
    from harness.planning.taskmodels.generation import ContinuousInstance, _Sample

    inst = ContinuousInstance(cm, model, tuple(range(tp * pp)), tp, pp, 0.5, max_batch, kv_tokens, max_gen_len, [],
                              "gen", ep)
    inst.waiting = [_Sample(i, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]
    inst.run()
    return inst.result.end_s


def _cost_model_of(kind, setup):
    """(cost model, actor model) of each kind the generation task model is timed under: a profile
    table (``setup``), the calibrated model with eager engines (DeepSpeed-Chat 7B), the calibrated
    model, the roofline, and the calibrated model of a MoE (Qwen3-30B-A3B)."""
    from harness.testing import context, plan_for

    if kind == "profile":
        return setup
    if kind == "engines":
        plan, ctx, _ = plan_for(["+system=deepspeed_chat", "model=7b", "cluster=a800_8x", "cluster.num_nodes=1",
                                 "workload.global_batch_size=64", "workload.mini_batch_size=64", "logger=none"])
        assert plan.engines.generation.kernels != "graph"
        return ctx.cost_model.with_engines(plan.engines), ctx.models.actor
    cluster = ["cluster=rlhfuse_testbed"] + (["cluster.cost_model=roofline"] if kind == "roofline" else [])
    ctx = context(["+system=rlhfuse_base", "model=qwen3_30b_a3b" if kind == "moe" else "model=13b", *cluster,
                   "logger=none"])
    return ctx.cost_model, ctx.models.actor


@pytest.mark.parametrize("kind", ["calibrated", "engines", "roofline", "profile", "moe"])
def test_a_step_schedule_timed_ends_where_the_instance_does(setup, kind):
    """A continuous-batching instance's step schedule (admissions and spans counted in steps), timed
    for a layout, ends where the instance run on the same samples does, bit for bit: on random
    lengths, batch limits and KV capacities that bind or not; timed in one elementwise pass (the
    calibrated model, with or without engines) or span by span (a profile table, the roofline)."""
    from harness.planning.taskmodels.generation import step_schedule, timed_end_s

    cm, model = _cost_model_of(kind, setup)
    ep = 2 if kind == "moe" else 1
    if kind in ("calibrated", "engines", "moe"):
        assert cm.decode_steps_s(model, np.array([3]), np.array([300]), 1, 1, ep) is not None
    else:
        assert cm.decode_steps_s(model, np.array([3]), np.array([300]), 1, 1, ep) is None
    rng = np.random.default_rng(1)
    for case in range(12):
        n, max_gen_len = int(rng.integers(1, 60)), int(rng.integers(8, 400))
        prompts = rng.integers(1, 200, size=n)
        outputs = rng.integers(1, max_gen_len + 1, size=n)
        max_batch = int(rng.choice([1, 4, 16, n]))
        kv_tokens = int(rng.choice([300, 2000, 1 << 40]))  # binding, mid, ample
        tp, pp = (1, 1) if kind == "profile" else (int(rng.choice([1, 2, 4])), int(rng.choice([1, 2])))
        schedule = step_schedule(prompts, outputs, max_batch, kv_tokens, max_gen_len)
        expected = _one_instance_end_s(cm, model, prompts, outputs, max_batch, kv_tokens, max_gen_len, tp, pp, ep)
        assert timed_end_s(schedule, cm, model, tp, pp, ep, 0.5) == expected, case
        assert int(schedule.num_steps.sum()) >= outputs.max()  # the longest sample decodes to its end


@pytest.mark.parametrize("kind", ["calibrated", "engines", "roofline", "profile", "moe"])
def test_many_prefills_at_once_are_the_prefills_one_by_one(setup, kind):
    """The cost model's elementwise pass over many one-sequence prefills equals its prefills one by
    one, bit for bit (dense and MoE, with and without engines, across tp, pp and ep); a profile
    table and the roofline have no such pass (None: their callers price prefills one at a time)."""
    cm, model = _cost_model_of(kind, setup)
    layouts = [(1, 1, 2), (2, 1, 4), (2, 2, 2), (1, 1, 1)] if kind == "moe" else [(1, 1, 1), (2, 1, 1), (4, 2, 1),
                                                                                (1, 4, 1)]
    tokens = np.random.default_rng(3).integers(1, 40_000, size=300)
    for tp, pp, ep in layouts:
        priced = cm.prefills_s(model, tokens, tp, pp, ep)
        if kind in ("roofline", "profile"):
            assert priced is None
            continue
        assert priced.tolist() == [cm.prefill_s(model, int(t), tp, pp, ep=ep) for t in tokens]


def test_the_compiled_step_schedule_is_the_interpreted_one(monkeypatch):
    """``step_schedule`` switches to its compiled kernel (:mod:`harness.planning.taskmodels.kernel`)
    after enough samples: the same spans as the interpreted heap on random lengths (with ties),
    batch limits and binding or ample KV capacities."""
    import importlib

    from harness.compiled import AVAILABLE

    generation = importlib.import_module("harness.planning.taskmodels.generation")
    rng = np.random.default_rng(7)
    for case in range(60):
        n = int(rng.integers(0, 200))
        prompts, outputs = rng.integers(1, 200, n), rng.integers(1, 400, n)
        if case % 3 == 0:
            outputs = rng.choice([5, 9], n)  # many samples finish at the same step
        max_batch, kv = int(rng.integers(1, 40)), int(rng.choice([900, 5000, 1 << 40]))
        schedules = []
        for compiled in (False, True):
            monkeypatch.setattr(generation, "compiled_kernels_warm", lambda: False)
            monkeypatch.setattr(generation, "_samples_scheduled", 1 << 60 if compiled else 0)
            schedules.append(generation.step_schedule(prompts, outputs, max_batch, kv, 512))
            assert (generation._samples_scheduled == n) == (not compiled or not AVAILABLE)
        for a, b in zip(vars(schedules[0]).values(), vars(schedules[1]).values()):
            assert np.array_equal(a, b), case


@pytest.mark.parametrize("overrides", [["+system=nemo_rl", "algo=dapo"], ["+system=colocated", "algo=grpo"],
                                       ["+system=deepspeed_chat", "algo=ppo"]])
def test_scoring_a_plan_times_its_generation_as_the_full_simulation_does(overrides):
    """Planners score whole plans (``record_spans=False``) with each generation instance's end from
    its step schedule (``continuous_instance_ends``) where nothing needs the samples' finishes:
    the same task ends, bit for bit, as the full simulation, whose instances run sample by sample."""
    from harness.planning.estimate import representative_batch
    from harness.planning.memory import check_plan_memory
    from harness.planning.simulate import PlanSimulator
    from harness.testing import plan_for

    plan, ctx, _ = plan_for([*overrides, "model=13b", "cluster.num_nodes=4", "workload.global_batch_size=64",
                             "workload.mini_batch_size=64", "logger=none"])
    if overrides[0] != "+system=deepspeed_chat":  # the step-schedule path (DeepSpeed-Chat's static rounds: not)
        assert plan.generation.batching == "continuous" and plan.generation.migration is None
    memory = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    batch = representative_batch(ctx)
    runs = []
    for record_spans in (True, False):
        simulator = PlanSimulator(ctx, plan, memory, 0, batch, record_spans=record_spans)
        simulator.run()
        runs.append((simulator.timeline.makespan_s, dict(simulator.timeline.end_s),
                     simulator.timeline.device_free_s.tolist()))
    assert runs[0] == runs[1]
