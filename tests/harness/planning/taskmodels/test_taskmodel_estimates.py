"""The planners' span-free task estimates end exactly where the full task models do (the
estimates skip the spans, nothing else)."""
from __future__ import annotations

import numpy as np
import pytest
from hydra.utils import get_class

from harness.planning.taskmodels.generation import simulate_generation
from harness.planning.taskmodels.passes import simulate_inference, simulate_training
from harness.planning.taskmodels.streaming import simulate_streaming_inference
from harness.run.pipeline import build_context
from harness.testing import run_config
from harness.core.workload import make_batch


@pytest.fixture(scope="module")
def planned():
    run = run_config(["+system=rlhfuse", "model=tiny", "workload=tiny", "cluster=h100_8x", "logger=none"])
    ctx = build_context(run)
    return ctx, get_class(run.system.impl)(run.system).plan(ctx)


def test_training_without_spans_ends_where_the_full_model_does(planned):
    ctx, plan = planned
    batch = make_batch(ctx.workload, ctx.seed, 0)
    seq = batch.prompt_lens + batch.output_lens
    assert plan.training
    for stage in plan.training:
        full = simulate_training(ctx.cost_model, plan, stage, ctx.models, seq, ctx.workload.activation_recompute, 1.5)
        quick = simulate_training(ctx.cost_model, plan, stage, ctx.models, seq, ctx.workload.activation_recompute,
                                  1.5, record_spans=False)
        assert quick.end_s == full.end_s and full.spans and not quick.spans


def test_streaming_inference_without_spans_ends_where_the_full_model_does(planned):
    ctx, plan = planned
    streamed = [t for t in plan.tasks if t.stream_from is not None]
    assert streamed, "the RLHFuse plan streams inference"
    batch = make_batch(ctx.workload, ctx.seed, 0)
    gen = plan.task("gen")
    res = simulate_generation(ctx.cost_model, gen, plan.generation, ctx.model("actor"), batch.prompt_lens,
                              batch.output_lens, 0.0, 1.0, ctx.workload.max_gen_len)
    free = {d: 0.25 * (d % 3) for d in streamed[0].allocation.mesh}
    models = {t.model: ctx.model(t.model) for t in streamed}
    args = (ctx.cost_model, streamed, models, res.samples, free, ctx.workload.micro_batch_size, {})
    full, quick = simulate_streaming_inference(*args), simulate_streaming_inference(*args, record_spans=False)
    assert quick.end_s == full.end_s and full.spans and not quick.spans
    assert np.isfinite(max(full.end_s.values()))


@pytest.mark.parametrize("offloaded", [False, True])
def test_inference_without_spans_ends_where_the_full_model_does(planned, offloaded):
    ctx, plan = planned
    batch = make_batch(ctx.workload, ctx.seed, 0)
    seq = batch.prompt_lens + batch.output_lens
    for task in (t for t in plan.tasks if t.kind == "inference"):
        args = (ctx.cost_model, task, ctx.model(task.model), seq, ctx.workload.micro_batch_size, 2.0, offloaded)
        full, quick = simulate_inference(*args), simulate_inference(*args, record_spans=False)
        assert quick.end_s == full.end_s and full.spans and not quick.spans


def test_generation_estimate_stops_only_above_the_given_time(planned):
    ctx, plan = planned
    from harness.planning.estimate import generation_s, representative_batch
    gen, batch = plan.task("gen"), representative_batch(ctx)
    full = generation_s(ctx, gen, plan.generation, batch, 1.0)
    assert generation_s(ctx, gen, plan.generation, batch, 1.0, stop_above=full) == full
    early = generation_s(ctx, gen, plan.generation, batch, 1.0, stop_above=0.5 * full)
    assert 0.5 * full < early <= full


@pytest.mark.parametrize("dp,tp,pp", [(2, 4, 1), (1, 4, 2), (2, 2, 2), (1, 2, 4), (1, 1, 8)])
def test_training_bound_never_exceeds_the_simulated_time(planned, dp, tp, pp):
    from harness.core.plan import Allocation, ParallelStrategy, Task
    from harness.planning.estimate import representative_batch, training_bound_s, training_s
    from harness.planning.workflow import single_pipe_stage
    ctx, _ = planned
    w, batch = ctx.workload, representative_batch(ctx)
    for role in ("actor", "critic"):
        s = ParallelStrategy(dp, tp, pp, 1)
        task = Task(f"update_{role}", "train", role, Allocation(tuple(range(8)), s))
        stage = single_pipe_stage(task.name, role, s, w.mini_batch_size, w.micro_batch_size, w.global_batch_size)
        bound = training_bound_s(ctx, task, stage, w.mini_batch_size, batch)
        assert 0 < bound <= training_s(ctx, task, stage, w.mini_batch_size, batch) * (1 + 1e-12)


def _simulated_generation_s(ctx, gen, policy, batch, kv_gb, instances):
    """The latest end of ``instances`` of ``gen`` run alone by the simulator's generation task model."""
    from harness.core.plan import Allocation, ParallelStrategy, Task

    s, ids = gen.allocation.strategy, np.arange(batch.num_samples)
    ends = []
    for k in instances:
        mine = ids[ids % s.dp == k]
        sub = Task("gen", "generate", "actor", Allocation(gen.allocation.replica_devices(k), ParallelStrategy(1, s.tp, s.pp)))
        ends.append(simulate_generation(ctx.cost_model, sub, policy, ctx.model("actor"), batch.prompt_lens[mine],
                                        batch.output_lens[mine], 0.0, kv_gb, ctx.workload.max_gen_len).end_s)
    return max(ends)


@pytest.mark.parametrize("kv_allocation", ["reserve", "on_demand"])
@pytest.mark.parametrize("max_batch_size", [None, 3])
def test_memoised_generation_estimates_equal_the_simulated_instances(planned, max_batch_size, kv_allocation):
    """One GenerationEstimates scoring many candidates gives the simulator's numbers bit for bit (the
    latest end of the instances it estimates, each run by the generation task model): on other
    meshes, other widths, and KV capacities that bind (a few hundred tokens) or not (1-2 GB: the same
    run, simulated once), with the batch limited or not, KV reserved or allocated on demand; and so
    does generation_s."""
    from dataclasses import replace

    from harness.core.plan import Allocation, ParallelStrategy, Task
    from harness.planning.estimate import GenerationEstimates, generation_s, representative_batch

    ctx, plan = planned
    policy = replace(plan.generation, max_batch_size=max_batch_size, kv_allocation=kv_allocation)
    assert policy.batching == "continuous"
    batch = representative_batch(ctx)
    estimates = GenerationEstimates(ctx, batch)
    capacities_gb = (1e-5, 3e-5, 1e-4, 1.0, 2.0)
    for dp, tp, pp in ((8, 1, 1), (4, 2, 1), (2, 2, 2)):
        for mesh in (tuple(range(8)), tuple(range(7, -1, -1))):
            gen = Task("gen", "generate", "actor", Allocation(mesh, ParallelStrategy(dp, tp, pp)))
            for kv_gb in capacities_gb:
                simulated = _simulated_generation_s(ctx, gen, policy, batch, kv_gb, estimates.slowest_instances(dp))
                assert estimates(gen, policy, kv_gb) == simulated == generation_s(ctx, gen, policy, batch, kv_gb)
    # ample capacities and the second mesh reuse the first mesh's runs: at most the three binding
    # capacities plus one ample one per instance of each layout
    instances = sum(len(estimates.slowest_instances(dp)) for dp in (8, 4, 2))
    assert estimates.num_simulated <= 4 * instances
