"""The sim backend over whole plans: invariants that must hold for any sequential plan."""
import pytest

from harness.core import metrics as mk
from harness.backends.sim import SimBackend
from harness.testing import plan_for
from harness.core.workload import make_batch

SEQUENTIAL_TASKS = ("gen", "ref", "reward", "values", "update_actor", "update_critic")


@pytest.fixture(params=["deepspeed_chat", "rlhfuse_base"])
def simulated(request):
    plan, ctx, run = plan_for([f"+system={request.param}", "model=7b", "cluster.num_nodes=2"])
    backend = SimBackend(run.backend, ctx)
    backend.setup(plan)
    batch = make_batch(run.workload, run.seed, 0)
    trace = backend.run_iteration(plan, 0, batch)
    metrics = mk.iteration_metrics(trace, batch.total_num_tokens, {t.name: t.model for t in plan.tasks},
                                   run.cluster.gpu.peak_bf16_tflops * 1e12)
    return plan, ctx, batch, trace, metrics


def test_sequential_stages_add_up_to_the_step(simulated):
    """Every task uses every device, so tasks run back to back: the step is their sum."""
    plan, _, _, trace, m = simulated
    total = sum(m[mk.timing_key(t)] for t in SEQUENTIAL_TASKS) + m.get(mk.REALLOC_TIME, 0.0)
    assert m[mk.STEP_TIME] == pytest.approx(total, rel=1e-9)
    windows = sorted(trace.task_window(t) for t in trace.tasks())
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert start >= end - 1e-12  # no two tasks overlap in time


def test_every_sample_is_generated_once_with_its_target_length(simulated):
    _, _, batch, trace, m = simulated
    assert [s.sample_id for s in trace.samples] == list(range(batch.num_samples))
    assert [s.response_len for s in trace.samples] == batch.output_lens.tolist()
    assert max(s.finish_s for s in trace.samples) == pytest.approx(trace.task_window("gen")[1])
    assert m[mk.SAMPLES_PER_S] == pytest.approx(batch.num_samples / m[mk.STEP_TIME])


def test_spans_stay_on_the_task_mesh_and_inside_the_step(simulated):
    plan, ctx, _, trace, m = simulated
    meshes = {t.name: set(t.allocation.mesh) for t in plan.tasks}
    for span in trace.spans:
        assert set(span.devices) <= meshes[span.task]
        assert 0.0 <= span.start_s <= span.end_s <= m[mk.STEP_TIME] + 1e-12
    assert 0.0 < m[mk.BUSY_MIN] <= m[mk.BUSY_MEAN] <= 1.0


def test_training_flops_match_the_model(simulated):
    """Forward+backward FLOPs recorded on the actor's spans = 3 x forward FLOPs of every token the
    plan trains on (prompts padded to the maximum where the generation engine pads them, samples to
    the longest of their generation round where the plan pads)."""
    import numpy as np

    from harness.costmodel.llama import forward_flops
    from harness.planning.taskmodels.generation import padded_lengths

    plan, ctx, batch, trace, _ = simulated
    gen_dp = plan.task("gen").allocation.strategy.dp
    prompts = batch.prompt_lens
    if plan.engines.generation.pad_prompts_to_max:
        prompts = np.full_like(prompts, ctx.workload.prompt_len.max)
    seq = padded_lengths(plan.generation, gen_dp, prompts, batch.output_lens)
    recorded = sum(s.flops * len(s.devices) for s in trace.spans if s.task == "update_actor")
    mbs = plan.mini_batch_size
    expected = 0.0
    for lo in range(0, batch.num_samples, mbs):
        mean_seq = float(seq[lo:lo + mbs].mean())
        expected += 3 * forward_flops(ctx.models.actor, mbs * mean_seq, mean_seq / 2)
    assert recorded == pytest.approx(expected, rel=1e-6)


def test_bubble_fraction_matches_the_pipeline_definition(simulated):
    _, _, _, trace, m = simulated
    for task in ("update_actor", "update_critic"):
        runs = [r for r in trace.pipelines if r.task == task]
        assert len(runs) > 0
        expected = 1 - sum(r.compute_s for r in runs) / sum(r.num_ranks * r.makespan_s for r in runs)
        assert m[mk.bubble_key(task)] == pytest.approx(expected)
        assert 0.0 <= m[mk.bubble_key(task)] < 1.0
