"""Partial rollout (harness/planning/partial.py): over-provisioned iterations that stop once the
batch is complete and carry the rest.

Oracles: launching exactly the groups trained (no over-provisioning) is the synchronous run, window
for window; every iteration trains exactly a batch of whole groups, at their full lengths; the
staleness bound restarts older carried responses and holds for every trained sample; over-
provisioning ends generation no later than the synchronous run's; no sample is lost or invented
between iterations."""
import dataclasses

import numpy as np
import pytest

from harness.core import metrics as mk
from harness.core.plan import OffPolicyPolicy
from harness.planning.offpolicy import OffPolicyTimeline
from harness.planning.partial import run_partial
from harness.testing import simulate_plan_metrics
from helpers import off_policy_setup, window_metrics

SMALL = ["model=7b", "cluster.num_nodes=1", "algo=grpo", "workload.global_batch_size=16", "workload.mini_batch_size=8",
         "+system=verl", "workload.output_len.sigma=1.0", "algo.rule_reward_s_per_sample=0"]


def setup(policy: OffPolicyPolicy):
    return off_policy_setup(SMALL, policy)


def windows_beside_synchronous(policy: OffPolicyPolicy, count: int):
    """(window metrics, synchronous iteration metrics) of iterations 1 .. count - 1 of ``policy``
    on the small run, the synchronous run being the same plan without it."""
    plan, ctx, memory, batch_of = setup(policy)
    windows = OffPolicyTimeline(ctx, plan, memory, batch_of, count)
    sync = dataclasses.replace(plan, off_policy=None)
    return [(window_metrics(plan, ctx, windows.window(k)), simulate_plan_metrics(sync, ctx, iteration=k)[1])
            for k in range(1, count)]


def test_without_over_provisioning_it_is_the_synchronous_run():
    for off, on in windows_beside_synchronous(OffPolicyPolicy(4, rollout="partial", oversample_factor=1.0), 4):
        for key in (mk.STEP_TIME, mk.SAMPLES_PER_S, mk.TRAIN_TIME, mk.timing_key("gen"), mk.GEN_TAIL_S):
            assert off[key] == pytest.approx(on[key], rel=1e-9), key
        assert off[mk.STALENESS_MAX] == 0 and off[mk.CARRIED_SAMPLES] == 0


@pytest.mark.parametrize("bound", [0, 1, 16])
def test_batches_are_whole_groups_within_the_bound(bound):
    plan, ctx, memory, batch_of = setup(OffPolicyPolicy(bound, rollout="partial", oversample_factor=2.0))
    run = run_partial(ctx, plan, memory, batch_of, 6)
    group = ctx.algorithm.group_size
    lengths = np.concatenate([batch_of(k).output_lens for k in range(8)])
    for k, sim in enumerate(run.sims):
        samples = sim.trace.samples
        assert len(samples) == batch_of(k).num_samples and len(samples) % group == 0
        assert all(0 <= k - r.first_version <= bound and r.last_version == k for r in samples)
        assert all(r.response_len in lengths for r in samples)  # full responses of drawn samples
    if bound == 0:
        assert sum(sim.trace.counters[mk.DROPPED_SAMPLES] for sim in run.sims) > 0
    carried = [sim.trace.counters[mk.CARRIED_SAMPLES] for sim in run.sims]
    assert all(c > 0 for c in carried)


# two engines of the tiny model: one finishes a sample in a decode step under way when the other
# completes the batch (iteration 2)
TWO_ENGINES = ["model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=2",
               "algo=grpo", "workload.global_batch_size=2", "workload.mini_batch_size=1", "algo.group_size=4",
               "+system=verl", "system.rollout_tp=1"]


@pytest.mark.parametrize("config", [SMALL, TWO_ENGINES], ids=["7b", "tiny_two_engines"])
@pytest.mark.parametrize("bound", [1, 16])
def test_no_sample_is_lost_or_invented_between_iterations(config, bound):
    """What leaves iteration k untrained (everything launched or waiting in it, less its batch) is
    exactly what iteration k + 1 resumes or keeps waiting, samples that finished in a decode step
    under way at the stop included."""
    plan, ctx, memory, batch_of = off_policy_setup(config, OffPolicyPolicy(bound, rollout="partial",
                                                                           oversample_factor=2.0))
    rounds = []
    run_partial(ctx, plan, memory, batch_of, 6, record_spans=False, rounds=rounds)
    seen: set[int] = set()
    for before, after in zip(rounds, rounds[1:]):
        launched = {g for engine in before.engines for g, _ in engine} | set(before.complete)
        seen |= launched
        entering = {g for engine in after.engines for g, _ in engine if g in seen} | set(after.complete)
        assert entering == launched - set(before.batch), before.iteration


def test_over_provisioning_ends_generation_sooner():
    for partial, on in windows_beside_synchronous(OffPolicyPolicy(16, rollout="partial", oversample_factor=2.0), 3):
        assert partial[mk.timing_key("gen")] < on[mk.timing_key("gen")]


def test_tail_batching_without_speculation_is_the_synchronous_run():
    for off, on in windows_beside_synchronous(OffPolicyPolicy(0, rollout="tail_batching", oversample_factor=1.0), 3):
        assert off[mk.STEP_TIME] == pytest.approx(on[mk.STEP_TIME], rel=1e-9)
        assert off[mk.LONG_ROUND] == 0 and off[mk.QUEUED_PROMPTS] == 0


@pytest.mark.parametrize("prompt_sigma", [0.0, 0.9])
def test_tail_batching_queues_the_aborted_prompts_for_long_rounds(prompt_sigma):
    """Short rounds of 1.5 x 2 groups train 2 and queue 1; a long round follows two of them, trains
    the queued prompts, on-policy; where prompts set lengths, long rounds are longer."""
    plan, ctx, memory, batch_of = off_policy_setup(
        [*SMALL, "workload.global_batch_size=2", "workload.mini_batch_size=2",
         f"workload.output_len.prompt_sigma={prompt_sigma}"],
        OffPolicyPolicy(0, rollout="tail_batching", oversample_factor=1.5))
    run = run_partial(ctx, plan, memory, batch_of, 9)
    rounds = [sim.trace.counters[mk.LONG_ROUND] for sim in run.sims]
    queued = [sim.trace.counters[mk.QUEUED_PROMPTS] for sim in run.sims]
    assert rounds == [0, 0, 1] * 3 and queued == [1, 2, 0] * 3
    assert all(r.first_version == r.last_version == k for k, sim in enumerate(run.sims) for r in sim.trace.samples)
    # every prompt trained once: a long round's regenerated groups are not taken again as new prompts
    group = ctx.algorithm.group_size
    trained = [tuple(r.response_len for r in sim.trace.samples[i:i + group])
               for sim in run.sims for i in range(0, len(sim.trace.samples), group)]
    assert len(set(trained)) == len(trained)
    mean = [np.mean([r.response_len for r in sim.trace.samples]) for sim in run.sims]
    if prompt_sigma:
        assert np.mean(mean[2::3]) > np.mean(mean[0::3] + mean[1::3])
