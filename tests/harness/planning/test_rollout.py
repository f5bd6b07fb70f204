"""Continuous rollout across iterations (harness/planning/rollout.py).

Oracles: with a bound of 0, draining engines and a verifier that costs nothing, continuous rollout
is the synchronous run (each steady-state window the synchronous iteration); under every weight
update and batch order the bound holds for every trained sample and is reached; interrupted
samples finish under newer weights than they started with (and only under interrupt); the trainer
under ``finish`` order trains whole groups of the earliest finished samples; a plan whose trainer
shares the generation devices is refused."""
import dataclasses

import pytest

from harness.core import metrics as mk
from harness.core.plan import OffPolicyPolicy
from harness.core.workload import draw_batch
from harness.errors import PlanError
from harness.planning.offpolicy import OffPolicyTimeline
from harness.planning.rollout import run_continuous
from harness.testing import simulate_plan_metrics
from helpers import off_policy_setup, window_metrics

SMALL = ["model=7b", "cluster.num_nodes=2", "algo=grpo", "workload.global_batch_size=16", "workload.mini_batch_size=8",
         "+system=one_step_off", "system.rollout_gpus=8", "workload.output_len.sigma=1.0"]


def setup(policy: OffPolicyPolicy, extra=()):
    return off_policy_setup([*SMALL, *extra], policy)


def test_bound_zero_draining_is_the_synchronous_run():
    policy = OffPolicyPolicy(0, rollout="continuous", weight_update="drain")
    plan, ctx, memory, batch_of = setup(policy, ["algo.rule_reward_s_per_sample=0"])
    windows = OffPolicyTimeline(ctx, plan, memory, batch_of, 4)
    sync = dataclasses.replace(plan, off_policy=None)
    for k in range(1, 4):
        off = window_metrics(plan, ctx, windows.window(k))
        _, on = simulate_plan_metrics(sync, ctx, iteration=k)
        for key in (mk.STEP_TIME, mk.SAMPLES_PER_S, mk.TRAIN_TIME, mk.timing_key("gen"), mk.BUSY_MEAN):
            assert off[key] == pytest.approx(on[key], rel=1e-9), key
        assert off[mk.STALENESS_MAX] == 0


@pytest.mark.parametrize("update", ["drain", "inflight", "interrupt"])
@pytest.mark.parametrize("order", ["iteration", "finish"])
@pytest.mark.parametrize("bound", [1, 2])
def test_the_bound_holds_for_every_sample(update, order, bound):
    policy = OffPolicyPolicy(bound, rollout="continuous", weight_update=update, batch_order=order)
    plan, ctx, memory, batch_of = setup(policy)
    run = run_continuous(ctx, plan, memory, batch_of, 6)
    staleness = [[k - r.first_version for r in sim.trace.samples] for k, sim in enumerate(run.sims)]
    assert all(0 <= s <= bound for row in staleness for s in row)
    assert max(max(row) for row in staleness) == bound  # generation runs ahead as far as it may
    for k, sim in enumerate(run.sims):
        assert len(sim.trace.samples) == draw_batch(ctx.workload, ctx.seed, k, ctx.algorithm).num_samples
        for r in sim.trace.samples:
            assert r.first_version <= r.last_version <= k
            if update != "interrupt":
                assert sim.trace.counters[mk.INTERRUPTED_SAMPLES] == 0
    interrupted = sum(sim.trace.counters[mk.INTERRUPTED_SAMPLES] for sim in run.sims)
    assert (interrupted > 0) == (update == "interrupt")
    assert all(e > b for b, e in zip(run.train_end_s, run.train_end_s[1:]))


def test_finish_order_trains_whole_groups_earliest_first():
    policy = OffPolicyPolicy(2, rollout="continuous", weight_update="interrupt", batch_order="finish")
    plan, ctx, memory, batch_of = setup(policy)
    run = run_continuous(ctx, plan, memory, batch_of, 4)
    group = ctx.algorithm.group_size
    for sim in run.sims:
        finishes = [r.finish_s for r in sim.trace.samples]
        assert len(finishes) % group == 0
        ready = [max(finishes[i:i + group]) for i in range(0, len(finishes), group)]
        assert ready == sorted(ready)


def test_a_trainer_on_the_generation_devices_is_refused():
    policy = OffPolicyPolicy(0, rollout="continuous")
    plan, ctx, memory, batch_of = setup(policy)
    gen = plan.task("gen")
    shared = [dataclasses.replace(t, allocation=gen.allocation) if t.name == "ref" else t for t in plan.tasks]
    plan = dataclasses.replace(plan, tasks=shared)
    with pytest.raises(PlanError, match="shares its devices"):
        run_continuous(ctx, plan, memory, batch_of, 2)


def test_policy_fields_are_checked():
    with pytest.raises(PlanError, match="weight_update='later'"):
        OffPolicyPolicy(1, rollout="continuous", weight_update="later")
    with pytest.raises(PlanError, match="apply to continuous rollout"):
        OffPolicyPolicy(1, weight_update="interrupt")


def test_a_batch_still_being_scored_is_not_a_stall():
    """A decode step longer than the loop's chunk (the trainer's shortest step) ends past the
    horizon, and the verifier scores its samples after that: the loop waits for the batch instead
    of reporting a stall. AReaL at eta 0 on the tiny model, vLLM's host time per step raised to
    50 ms (far above the trainer's few-ms shortest step)."""
    from harness.run.pipeline import compose, simulate_summary

    overrides = ["+system=areal", "cluster.gpus_per_node=2", "model=tiny", "workload=tiny", "cluster=h100_8x",
                 "cluster.num_nodes=1", "algo=grpo", "workload.global_batch_size=2", "workload.mini_batch_size=1",
                 "algo.group_size=4", "system.eta=0", "backend.num_iterations=3", "logger=none",
                 "engine.constants={generation/vllm:{host_s_per_step:0.05}}"]
    summary = simulate_summary(compose(overrides))
    assert summary[mk.STALENESS_MAX] == 0
    assert summary["training/global_step"] == 3
