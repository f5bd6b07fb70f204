"""DAPO's dynamic sampling (arXiv 2503.14476 section 3.2): the batch's rounds and kept groups
(:func:`harness.core.workload.make_sampled_batch`), the simulator's rounds, the planners' estimates
and the refusals (harness/core/algorithm.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.core import metrics as mk
from harness.core.algorithm import samples_per_round
from harness.core.workload import draw_batch, make_batch
from harness.errors import ConfigError, HarnessError
from harness.planning.estimate import GenerationEstimates, representative_batch
from harness.planning.taskmodels.sampling import group_ready_s, kept_stream
from harness.testing import context, plan_for, simulate_iterations

SMALL = ["cluster.num_nodes=4", "workload.global_batch_size=64", "workload.mini_batch_size=16"]
DAPO = ["+system=rlhfuse_base", "model=13b", "algo=dapo", *SMALL]
# pass rates piled near 0 and 1: few groups with mixed outcomes, so several rounds
POLARISED = ["workload.pass_rate.alpha=0.2", "workload.pass_rate.beta=0.2", "algo.oversample_factor=1.5"]


def _expected_kept(batch, num_prompts: int, group_size: int) -> tuple[np.ndarray, int]:
    """Oracle from the rounds' outcomes: the trained sample ids (the first ``num_prompts`` groups
    with mixed outcomes, round by round, prompt by prompt) and how many rounds filling them takes."""
    kept, num_rounds, offset = [], 0, 0
    for rb in batch.rounds:
        num_rounds += 1
        k = rb.group_num_correct
        assert k.shape == (rb.num_samples // group_size,) and (0 <= k).all() and (k <= group_size).all()
        kept += [offset + g * group_size for g in np.flatnonzero((k > 0) & (k < group_size))]
        offset += rb.num_samples
        if len(kept) >= num_prompts:
            break
    ids = np.array([s + i for s in kept[:num_prompts] for i in range(group_size)])
    return ids, num_rounds


@pytest.mark.parametrize("extra", [[], POLARISED])
def test_the_batch_is_the_first_groups_with_mixed_outcomes_and_rounds_stop_once_it_is_full(extra):
    ctx = context([*DAPO, *extra])
    g, num_prompts = ctx.algorithm.group_size, 64
    rounds_seen = set()
    for iteration in range(6):
        batch = draw_batch(ctx.workload, ctx.seed, iteration, ctx.algorithm)
        ids, num_rounds = _expected_kept(batch, num_prompts, g)
        assert len(batch.rounds) == num_rounds  # no round after the batch is full
        assert all(rb.num_samples == samples_per_round(ctx.workload, ctx.algorithm) for rb in batch.rounds)
        assert np.array_equal(batch.trained_ids, ids)
        assert batch.num_samples == num_prompts * g == ctx.workload.global_batch_size
        prompts = np.concatenate([rb.prompt_lens for rb in batch.rounds])
        outputs = np.concatenate([rb.output_lens for rb in batch.rounds])
        assert np.array_equal(batch.prompt_lens, prompts[ids]) and np.array_equal(batch.output_lens, outputs[ids])
        assert (batch.prompt_lens.reshape(-1, g) == batch.prompt_lens[::g, None]).all()  # a group shares its prompt
        rounds_seen.add(num_rounds)
        again = draw_batch(ctx.workload, ctx.seed, iteration, ctx.algorithm)  # a pure function of seed and iteration
        assert np.array_equal(again.trained_ids, batch.trained_ids)
    if extra:  # the polarised pass rates exercise several rounds; uniform ones fill the batch in one
        assert max(rounds_seen) > 1
    else:
        assert rounds_seen == {1}


def test_a_kept_sample_streams_once_its_whole_group_is_scored():
    ctx = context([*DAPO, *POLARISED])
    batch = draw_batch(ctx.workload, ctx.seed, 0, ctx.algorithm)
    g = ctx.algorithm.group_size
    scored = np.random.default_rng(0).uniform(0, 10, sum(rb.num_samples for rb in batch.rounds))
    ready = group_ready_s(scored, g)
    assert np.array_equal(ready, np.repeat(scored.reshape(-1, g).max(axis=1), g))
    stream = kept_stream(batch, ready)
    assert [r.sample_id for r in stream] == list(range(batch.num_samples))
    assert [r.finish_s for r in stream] == ready[batch.trained_ids].tolist()
    assert [r.response_len for r in stream] == batch.output_lens.tolist()
    first = batch.rounds[0].num_samples  # a prefix of the rounds (the first): its kept samples only
    assert len(kept_stream(batch, ready[:first])) == int((batch.trained_ids < first).sum())


def test_uniform_pass_rates_keep_the_closed_form_share_of_groups():
    """Pass rate p ~ Beta(1, 1), k ~ Binomial(G, p): P(k = 0) = P(k = G) = 1 / (G + 1), so a group
    has mixed outcomes with probability 1 - 2 / (G + 1) (15/17 for G = 16)."""
    ctx = context([*DAPO, "workload.global_batch_size=512", "workload.mini_batch_size=64"])
    g = ctx.algorithm.group_size
    k = np.concatenate([draw_batch(ctx.workload, ctx.seed, i, ctx.algorithm).rounds[0].group_num_correct
                        for i in range(4)])
    share = float(((k > 0) & (k < g)).mean())
    stderr = math.sqrt(share * (1 - share) / len(k))
    assert abs(share - (1 - 2 / (g + 1))) < 4 * stderr


def test_without_dynamic_sampling_the_batch_is_the_plain_draw():
    ctx = context([*DAPO, "algo.dynamic_sampling=false"])
    batch, plain = draw_batch(ctx.workload, 0, 2, ctx.algorithm), make_batch(ctx.workload, 0, 2, 16)
    assert batch.rounds is None and batch.trained_ids is None
    assert np.array_equal(batch.prompt_lens, plain.prompt_lens) and np.array_equal(batch.output_lens, plain.output_lens)
    assert samples_per_round(ctx.workload, ctx.algorithm) == ctx.workload.global_batch_size


def test_rounds_that_cannot_fill_the_batch_are_an_error_naming_the_options():
    ctx = context([*DAPO, "workload.pass_rate.alpha=0.01", "workload.pass_rate.beta=0.01", "algo.max_gen_rounds=1"])
    with pytest.raises(ConfigError, match=r"algo\.max_gen_rounds=1.*raise algo\.max_gen_rounds or algo\.oversample_factor"):
        draw_batch(ctx.workload, ctx.seed, 0, ctx.algorithm)


@pytest.mark.parametrize("override, match", [
    ("algo.reward=model", r"set algo\.reward=rule"),
    ("algo.oversample_factor=0.5", r"algo\.oversample_factor=0\.5"),
    ("algo.max_gen_rounds=0", r"algo\.max_gen_rounds=0"),
    ("workload.pass_rate.alpha=0", r"workload\.pass_rate: alpha=0"),
])
def test_bad_dynamic_sampling_options_are_refused_before_planning(override, match):
    with pytest.raises(HarnessError, match=match):
        context([*DAPO, override])


def test_over_sampling_options_without_dynamic_sampling_are_refused(refused_in_process):
    line = refused_in_process("+system=rlhfuse_base", "model=13b", "algo=grpo", "algo.oversample_factor=2")
    assert "algo.oversample_factor=2 has no effect with algo.dynamic_sampling=false" in line


def test_backend_ray_refuses_dynamic_sampling_with_streamed_generation(refused_in_process):
    line = refused_in_process("+system=rlhfuse", "model=tiny", "workload=tiny", "backend=ray", "algo=grpo",
                              "algo.dynamic_sampling=true", "backend.options.reward.kind=token_range",
                              "system.fused_search.max_steps=50", "cluster=h100_8x", "cluster.gpus_per_node=2")
    assert "dynamic sampling with streamed generation" in line and "system.inter_stage=false" in line


# ---- the simulator and the planners ---------------------------------------------------------------

def test_the_verifier_scores_every_generated_sample_not_only_the_kept():
    """A sequential system (the verifier starts when generation ends) lengthens its step by the
    closed form of scoring all the rounds' samples on 8 workers: ceil(n / 8) x cost per round."""
    (_, [(free_trace, free)]), (_, [(_, costly)]) = (
        simulate_iterations([*DAPO, f"algo.rule_reward_s_per_sample={c}", "algo.num_reward_workers=8"])
        for c in (0.0, 0.25))
    num_rounds = free_trace.counters[mk.GEN_ROUNDS]
    generated = free_trace.counters[mk.GENERATED_SAMPLES]
    assert num_rounds == 1 and generated == math.ceil(3.0 * 64) * 16
    assert len(free_trace.samples) == 64 * 16  # the kept samples train
    assert costly["timing_s/step"] - free["timing_s/step"] == pytest.approx(math.ceil(generated / 8) * 0.25, rel=1e-9)


def test_several_rounds_run_one_after_the_other():
    """With polarised pass rates the batch takes several rounds, each a full generation: the step
    is longer than with one round of the same size, and the counters say how many rounds ran."""
    (_, [(one, one_m)]) = simulate_iterations([*DAPO, "algo.oversample_factor=1.5"])
    plan, [(many, many_m)] = simulate_iterations([*DAPO, *POLARISED])
    ctx = context([*DAPO, *POLARISED])
    batch = draw_batch(ctx.workload, ctx.seed, 0, ctx.algorithm)
    assert many.counters[mk.GEN_ROUNDS] == len(batch.rounds) > 1 == one.counters[mk.GEN_ROUNDS]
    assert many.counters[mk.GENERATED_SAMPLES] == sum(rb.num_samples for rb in batch.rounds)
    assert many_m["timing_s/gen"] > one_m["timing_s/gen"]


def test_planners_estimate_generation_as_the_sum_of_the_rounds():
    plan, ctx, _ = plan_for([*DAPO, *POLARISED])
    batch = representative_batch(ctx)
    assert batch.rounds is not None and len(batch.rounds) > 1
    gen = next(t for t in plan.tasks if t.kind == "generate")
    kv_gb = 10.0
    whole = GenerationEstimates(ctx, batch)(gen, plan.generation, kv_gb)
    parts = [GenerationEstimates(ctx, rb)(gen, plan.generation, kv_gb) for rb in batch.rounds]
    assert whole == sum(parts) and min(parts) > 0


@pytest.mark.parametrize("system", ["rlhfuse", "realhf", "disaggregated", "verl", "nemo_rl", "deepspeed_chat"])
def test_every_critic_free_system_plans_and_simulates_dynamic_sampling(system):
    fast = {"realhf": ["system.max_steps=5"], "rlhfuse": ["system.fused_search.max_steps=50"],
            "disaggregated": ["system.gen_nodes=2"], "verl": ["workload.mini_batch_size=64"]}
    plan, [(trace, metrics)] = simulate_iterations([f"+system={system}", "model=13b", "algo=grpo",
                                                    "algo.dynamic_sampling=true", *SMALL, *fast.get(system, [])])
    assert trace.counters[mk.GEN_ROUNDS] >= 1 and metrics["perf/samples_per_s"] > 0
    assert len(trace.samples) == 64 * 8
