"""``+system=streamrl`` (baselines/streamrl.py) and the length dispatch it plans
(``GenerationPolicy.dispatch``, harness/planning/taskmodels/generation.py).

Oracles:

- **dispatch**: every sample goes to exactly one instance; the ranker flags ``round(alpha n)``
  samples, of which ``round(recall x that)`` are among the truly longest ``round(alpha n)`` (recall
  1: exactly the longest; recall 0: none of them); the flagged samples are all on the long-tail
  instances and nothing else is; the same batch is always dealt the same way; round-robin without a
  dispatch;
- **simulation**: with one instance per sample and no batch limit a dispatch cannot change when a
  sample ends (each runs alone), so the generation time equals round-robin's; the plan's
  samples all finish;
- **system**: generation on GPUs of its own; the asynchronous mode is one step off-policy (every
  batch after the first one version stale) and does not stream; the synchronous mode streams its
  finished samples into the log-prob and reference passes on the training GPUs and is on-policy;
  the enumerated long-tail instances are the fastest of the candidates; bad knobs are refused with
  their key (backend=ray runs the dispatch: tests/harness/backends/ray/test_ray_off_policy.py).
"""
import dataclasses

import numpy as np
import pytest

from harness.core import metrics as mk
from harness.core.plan import Feature, GenerationPolicy, LengthDispatch, OffPolicyPolicy, TaskKind
from harness.errors import HarnessError, PlanError
from harness.planning.estimate import simulated_makespan_s
from harness.planning.taskmodels.generation import dispatch_samples
from harness.system import discover_systems
from harness.testing import plan_for, simulate_iterations, simulate_plan_metrics

SMALL = ["model=7b", "cluster.num_nodes=2", "algo=grpo", "workload.global_batch_size=32",
         "workload.mini_batch_size=16", "workload.max_gen_len=1536", "workload.output_len.max=1536",
         "workload.output_len.sigma=1.0"]


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 5000, size=n)


def test_is_found():
    assert "streamrl" in discover_systems()


@pytest.mark.parametrize("n, dp, num_long, frac, recall", [
    (100, 8, 2, 0.2, 0.87), (64, 4, 1, 0.2, 1.0), (64, 4, 3, 0.25, 0.0), (7, 3, 1, 0.2, 0.5), (1000, 16, 4, 0.1, 0.9)])
def test_dispatch_deals_every_sample_once_with_the_stated_recall(n, dp, num_long, frac, recall):
    lengths = _lengths(n)
    policy = GenerationPolicy(dispatch=LengthDispatch(num_long, frac, recall))
    dealt = dispatch_samples(policy, dp, lengths)
    assert len(dealt) == dp and sorted(np.concatenate(dealt).tolist()) == list(range(n))
    flagged = set(np.concatenate(dealt[:num_long]).tolist())
    m = max(1, round(frac * n))
    longest = set(np.lexsort((np.arange(n), -lengths))[:m].tolist())
    assert len(flagged) == m
    assert len(flagged & longest) == round(recall * m)
    again = dispatch_samples(policy, dp, lengths.copy())
    assert all(np.array_equal(a, b) for a, b in zip(dealt, again))


def test_without_a_dispatch_samples_go_round_robin():
    dealt = dispatch_samples(GenerationPolicy(), 3, _lengths(10))
    assert [d.tolist() for d in dealt] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_a_dispatch_needs_an_instance_for_the_rest_and_continuous_batching():
    with pytest.raises(PlanError, match="the others need one"):
        dispatch_samples(GenerationPolicy(dispatch=LengthDispatch(4)), 4, _lengths(10))
    with pytest.raises(PlanError, match="continuous batching"):
        GenerationPolicy("static", dispatch=LengthDispatch(1))
    with pytest.raises(PlanError, match="long_frac"):
        LengthDispatch(1, long_frac=1.0)


def test_one_sample_an_instance_ends_when_round_robin_does():
    plan, ctx, _ = plan_for(["+system=streamrl", "system.asynchronous=false", "system.generation_gpus=8",
                             "system.rollout_tp=1", "system.long_instances=2", "system.max_num_seqs=1", *SMALL,
                             "workload.global_batch_size=1", "workload.mini_batch_size=1"])  # 1 prompt x 8
    assert plan.generation.dispatch == LengthDispatch(2) and plan.task("gen").allocation.strategy.dp == 8
    plain = dataclasses.replace(plan, generation=dataclasses.replace(plan.generation, dispatch=None))
    dispatched, m = simulate_plan_metrics(plan, ctx, 1)
    _, m_plain = simulate_plan_metrics(plain, ctx, 1)
    assert m["timing_s/gen"] == pytest.approx(m_plain["timing_s/gen"], rel=1e-12)
    assert len(dispatched.samples) == 8


def test_asynchronous_mode_is_one_step_off_without_streaming():
    plan, rows = simulate_iterations(["+system=streamrl", "system.generation_gpus=8", "system.rollout_tp=2", *SMALL], 4)
    gen = set(plan.task("gen").allocation.mesh)
    train = {d for t in plan.tasks if t.kind in (TaskKind.TRAIN, TaskKind.INFERENCE) for d in t.allocation.mesh}
    assert gen == set(range(8, 16)) and not gen & train
    assert plan.off_policy == OffPolicyPolicy(1) and not plan.stream_edges()
    assert [m[mk.STALENESS_MAX] for _, m in rows] == [0.0, 1.0, 1.0, 1.0]
    assert Feature.LENGTH_DISPATCH in plan.features()


def test_synchronous_mode_streams_into_the_trainers_inference():
    plan, rows = simulate_iterations(["+system=streamrl", "system.asynchronous=false", "system.generation_gpus=8",
                                      *SMALL], 2)
    assert plan.off_policy is None
    assert {t.name for t in plan.tasks if t.stream_from == "gen"} == {"logprobs", "ref"}
    assert all(m[mk.STALENESS_MAX] == 0 for _, m in rows)


def test_enumerated_long_instances_are_the_fastest_candidate():
    args = ["+system=streamrl", "system.generation_gpus=8", "system.rollout_tp=1", *SMALL]
    plan, ctx, _ = plan_for(args)
    steps = {}
    for n in (1, 2, 4):
        pinned, _, _ = plan_for([*args, f"system.long_instances={n}"])
        steps[n] = simulated_makespan_s(ctx, pinned)
    assert plan.generation.dispatch.num_long_instances == min(steps, key=steps.get)
    assert plan.notes["long_instances"].endswith("(enumerated)")


@pytest.mark.parametrize("overrides, message", [
    (["system.long_frac=1.5"], "system.long_frac"),
    (["system.ranker_recall=-0.1"], "system.ranker_recall"),
    (["system.generation_gpus=8", "system.rollout_tp=1", "system.long_instances=8"], "system.long_instances=8"),
])
def test_bad_knobs_are_refused(overrides, message):
    with pytest.raises(HarnessError, match=message):
        plan_for(["+system=streamrl", *overrides, *SMALL])
