"""On-demand (paged) KV allocation with preemption: a hand-worked schedule, the instance against its
step schedule, the capacity never exceeded, every token generated once, and the oracles that tie it
to reserving (ample memory) and to the planners' memo (the clamped capacity)."""
import numpy as np
import pytest

from harness.core.plan import Allocation, GenerationPolicy, ParallelStrategy, Task
from harness.errors import ConfigError, PlanError
from harness.planning.taskmodels.generation import (ContinuousInstance, _Sample, simulate_generation, step_schedule,
                                                     timed_end_s)


def _instance(cm, model, prompts, outputs, max_batch, kv_tokens, on_demand=True, tp=1, pp=1, ep=1):
    inst = ContinuousInstance(cm, model, tuple(range(tp * pp)), tp, pp, 0.5, max_batch, kv_tokens, 10_000, [],
                              "gen", ep, kv_on_demand=on_demand)
    inst.waiting = [_Sample(i, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]
    inst.run()
    return inst


def _spans(schedule):
    return list(zip(*(column.tolist() for column in vars(schedule).values())))


def test_a_full_cache_preempts_the_latest_admitted_and_recomputes_it(setup):
    # Three samples of prompt 2 and output 4, a cache of 12 tokens. Admission needs a sample's
    # context plus a token for every running sample and itself: s0 2+1 <= 12, s1 4+2+... all three
    # (held 6, 6 + 3 = 9 <= 12). Span 1: batch 3 from 6 held tokens, (12 - 6) // 3 = 2 steps -> 12 held.
    # The next step needs 15 > 12: s2 (the latest) is preempted with 2 tokens generated (held 8,
    # 8 + 2 = 10 fits). Span 2: batch 2, 2 steps; s0 and s1 finish. s2 comes back: prefill of its
    # prompt and its 2 tokens (4), then its last 2 steps.
    cm, model = setup
    schedule = step_schedule(np.array([2, 2, 2]), np.array([4, 4, 4]), 3, 12, 10_000, kv_on_demand=True)
    assert _spans(schedule) == [(6, 3, 6, 2), (0, 2, 8, 2), (4, 1, 4, 2)]
    inst = _instance(cm, model, [2, 2, 2], [4, 4, 4], 3, 12)
    assert inst.num_preempted == 1
    assert [r.sample_id for r in inst.finishes] == [0, 1, 2]
    assert [s.kind for s in inst.result.spans] == ["prefill", "decode", "decode", "prefill", "decode"]
    assert timed_end_s(schedule, cm, model, 1, 1, 1, 0.5) == inst.result.end_s
    # Reserving prompt + max_gen_len (here 6) per sample, the same cache admits two at a time and
    # never preempts: s2 waits for both to finish and is prefilled once.
    reserved = step_schedule(np.array([2, 2, 2]), np.array([4, 4, 4]), 3, 12, 4)
    assert _spans(reserved) == [(4, 2, 4, 4), (2, 1, 2, 4)]


def test_the_instance_and_its_step_schedule_agree_and_hold_the_rules(setup):
    """On random lengths, batch limits and capacities from binding to ample: the instance ends where
    its step schedule timed does, bit for bit; the held KV (contexts at a span's start plus a token
    per sample per step) never exceeds the capacity; every output token is decoded exactly once
    (preemption recomputes by prefill, prompt and tokens so far); prefills exceed the prompts
    exactly when something was preempted."""
    cm, model = setup
    rng = np.random.default_rng(11)
    num_preempting = 0
    for case in range(40):
        n = int(rng.integers(1, 50))
        prompts, outputs = rng.integers(1, 60, n), rng.integers(1, 200, n)
        capacity = int(rng.choice([int((prompts + outputs).max()) + 1, 400, 1500, 1 << 40]))
        max_batch = int(rng.choice([1, 4, 16, n]))
        schedule = step_schedule(prompts, outputs, max_batch, capacity, 10_000, kv_on_demand=True)
        inst = _instance(cm, model, prompts, outputs, max_batch, capacity)
        assert timed_end_s(schedule, cm, model, 1, 1, 1, 0.5) == inst.result.end_s, case
        assert sorted(r.sample_id for r in inst.finishes) == list(range(n))
        held_at_end = schedule.context_totals + schedule.num_steps * schedule.batch_sizes
        assert held_at_end.max() <= capacity, case
        assert inst.result.peak_kv_tokens == held_at_end.max()
        assert int((schedule.batch_sizes * schedule.num_steps).sum()) == int(outputs.sum())
        assert (schedule.num_steps >= 1).all()
        recomputed = int(schedule.prefill_tokens.sum()) - int(prompts.sum())
        assert (recomputed > 0) == (inst.num_preempted > 0), case
        num_preempting += inst.num_preempted > 0
    assert num_preempting >= 5  # the binding capacities did preempt


def test_with_memory_for_everything_on_demand_is_reserving_unbounded(setup):
    """When the cache holds every sample's final context (and a token each), nothing is preempted
    and admission is bound by the batch limit alone: the schedule of reserving with no memory limit."""
    rng = np.random.default_rng(5)
    for case in range(20):
        n = int(rng.integers(1, 40))
        prompts, outputs = rng.integers(1, 60, n), rng.integers(1, 200, n)
        enough = int((prompts + outputs + 1).sum())
        max_batch = int(rng.choice([1, 3, n]))
        on_demand = step_schedule(prompts, outputs, max_batch, enough, 200, kv_on_demand=True)
        reserving = step_schedule(prompts, outputs, max_batch, 1 << 40, 200)
        assert _spans(on_demand) == _spans(reserving), case


def test_the_planners_clamped_capacity_gives_the_same_schedule():
    """GenerationEstimates keys an instance by its capacity clamped to what its samples can hold
    at once (prompt + output + 1 each, allocating on demand): any capacity above gives the same run."""
    rng = np.random.default_rng(9)
    for case in range(20):
        n = int(rng.integers(1, 40))
        prompts, outputs = rng.integers(1, 60, n), rng.integers(1, 200, n)
        max_batch = int(rng.choice([2, 5, n]))
        at_once = min(max_batch, n)
        bound = int(np.sort(prompts + outputs + 1)[::-1][:at_once].sum())
        a = step_schedule(prompts, outputs, max_batch, bound, 200, kv_on_demand=True)
        b = step_schedule(prompts, outputs, max_batch, bound * 7 + 3, 200, kv_on_demand=True)
        assert _spans(a) == _spans(b), case


def test_a_cache_smaller_than_one_sample_is_an_error(setup):
    cm, model = setup
    with pytest.raises(PlanError, match="fewer than one sample's"):
        step_schedule(np.array([4]), np.array([20]), 1, 10, 20, kv_on_demand=True)
    with pytest.raises(PlanError, match="fewer than one sample's"):
        _instance(cm, model, [4], [20], 1, 10)


def test_simulated_generation_follows_the_policy(setup):
    """simulate_generation runs the policy's allocation: on a cache that reserving fills with two
    samples, allocating on demand runs all four at once and ends sooner."""
    cm, model = setup
    task = Task("gen", "generate", "actor", Allocation((0,), ParallelStrategy()))
    kv_gb = cm.kv_cache_gb(model, 45, 1, 1)
    args = (np.array([4, 4, 4, 4]), np.array([1, 2, 3, 6]), 0.0, kv_gb, 16)
    reserve = simulate_generation(cm, task, GenerationPolicy("continuous"), model, *args)
    paged = simulate_generation(cm, task, GenerationPolicy("continuous", kv_allocation="on_demand"), model, *args)
    # on demand: one prefill of all four (10 ms), then 6 steps of 1 ms (the profile table's round numbers)
    assert paged.end_s == pytest.approx(0.016)
    assert reserve.end_s == pytest.approx(0.038)


def test_the_allocation_is_checked_and_round_trips_in_plan_json():
    from harness.core.engines import GenerationEngine
    from harness.testing import plan_for

    with pytest.raises(PlanError, match="kv_allocation"):
        GenerationPolicy("continuous", kv_allocation="paged")
    with pytest.raises(ConfigError, match="kv_allocation"):
        GenerationEngine("x", kv_allocation="paged")
    with pytest.raises(ConfigError, match="needs batching=continuous"):
        GenerationEngine("x", batching="static", kv_allocation="on_demand")
    base = ["+system=verl", "algo=grpo", "model=7b", "cluster.num_nodes=1", "workload.global_batch_size=64",
            "workload.mini_batch_size=64", "logger=none"]
    plan, _, _ = plan_for(base)  # verl generates on vLLM, which allocates on demand
    assert plan.engines.generation.name == "vllm" and plan.engines.generation.kv_allocation == "on_demand"
    assert plan.generation.kv_allocation == "on_demand"  # the engine's rule, set on the plan
    assert plan.to_dict()["generation"]["kv_allocation"] == "on_demand"
    from harness.core.plan import Plan
    assert Plan.from_json(plan.to_json()).generation.kv_allocation == "on_demand"
    plan, _, _ = plan_for([*base, "engine/generation=vllm", "engine.generation.kv_allocation=reserve"])
    assert plan.generation.kv_allocation == "reserve" and "kv_allocation" not in plan.to_dict()["generation"]
    assert Plan.from_json(plan.to_json()).generation.kv_allocation == "reserve"
