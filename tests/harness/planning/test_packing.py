"""Sequence packing (``workload.micro_batch_tokens``, harness/planning/packing.py): the packer's bin
counts against hand-worked cases, the planned schedule's micro-batch count, plan.json, the
refusals, and the simulator's invariants (the same tokens trained; one sample a bin is the
unpacked run)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from harness.core.plan import Feature
from harness.core.workload import draw_batch
from harness.errors import ConfigError, PlanError
from harness.planning import packing
from harness.testing import plan_for, simulate_iterations

# NeMo-RL's Llama-3.1-8B GRPO recipe in miniature: 16 prompts x 4 responses, mini-batches of 32 samples
BASE = ["+system=nemo_rl", "algo=grpo", "algo.group_size=4", "model=tiny", "cluster.num_nodes=1",
        "cluster.gpus_per_node=4", "workload=hh_rlhf", "workload.global_batch_size=16",
        "workload.mini_batch_size=8", "workload.micro_batch_size=1", "workload.max_gen_len=192",
        "workload.prompt_len.kind=constant", "workload.prompt_len.median=64", "workload.prompt_len.min=64",
        "workload.prompt_len.max=64", "workload.output_len.median=60", "workload.output_len.max=192",
        "system.train_layout=dp2tp1pp2"]


def test_first_fit_decreasing_bins_by_hand():
    assert packing.num_bins([], 256) == 0
    assert packing.num_bins([64, 64, 64, 64], 256) == 1  # exactly full
    assert packing.num_bins([65, 64, 64, 64], 256) == 2  # 65 pads to 128: 128 + 64 + 64 > 256 - 64
    assert packing.num_bins([256] * 5, 256) == 5
    # decreasing: 192 + 64 | 128 + 128 | 64 + 64
    assert packing.num_bins([64, 128, 64, 192, 128, 64], 256) == 3
    assert list(packing.padded_lengths([1, 64, 65, 130])) == [64, 64, 128, 192]


def test_a_sample_longer_than_the_budget_fits_no_bin():
    with pytest.raises(PlanError, match="exceeds workload.micro_batch_tokens=256"):
        packing.num_bins([100, 257], 256)


@pytest.mark.parametrize("seed", range(5))
def test_the_bins_packed_are_the_bins_counted(seed):
    """pack_bins (what backend=ray packs) holds every sample once, each bin within the budget
    (padded lengths), in the count num_bins (what the simulator plans with) gives."""
    lengths = np.random.default_rng(seed).integers(1, 700, size=40)
    bins = packing.pack_bins(lengths, 1024)
    assert len(bins) == packing.num_bins(lengths, 1024)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(packing.padded_lengths(lengths[b]).sum() <= 1024 for b in bins)
    assert packing.pack_bins(lengths, 1024) == bins  # a function of the lengths
    # by hand: decreasing, 192 + 64 | 128 + 128 | 64 + 64, equal lengths lower index first
    assert packing.pack_bins([64, 128, 64, 192, 128, 64], 256) == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(PlanError, match="exceeds"):
        packing.pack_bins([100, 300], 256)


def test_balanced_bins_fill_the_planned_count_evenly():
    assert packing.balanced_bins([5, 1, 3, 3, 2], 2) == [[0, 4], [1, 2, 3]]  # 5 + 2 | 3 + 3 + 1
    lengths = np.random.default_rng(0).integers(1, 500, size=37)
    for parts in (1, 4, 37):
        groups = packing.balanced_bins(lengths, parts)
        assert len(groups) == parts and all(groups) and sorted(i for g in groups for i in g) == list(range(37))
        loads = [int(lengths[g].sum()) for g in groups]
        # Graham's bound for LPT: the fullest within the mean plus the longest sample
        assert max(loads) <= lengths.sum() / parts + lengths.max()
    with pytest.raises(PlanError, match="cannot fill 5"):
        packing.balanced_bins([1, 2, 3], 5)


@pytest.mark.parametrize("bins, dp, per_replica", [(1, 4, 1), (8, 4, 2), (9, 4, 3), (157, 8, 20)])
def test_bins_are_raised_to_a_multiple_of_dp_and_dealt_out(bins, dp, per_replica):
    assert packing.per_replica(bins, dp) == per_replica


def test_planned_bins_are_the_fullest_mini_batch():
    lens = np.array([256, 256, 64, 64, 64, 64, 64, 64])  # two mini-batches of four
    assert packing.num_bins(lens[:4], 256) == 3 and packing.num_bins(lens[4:], 256) == 1  # 256 | 256 | 64 + 64
    assert packing.planned_bins(lens, 4, 256) == 3


def test_a_packed_plan_runs_the_planned_bins_and_writes_the_budget():
    plan, ctx, _ = plan_for([*BASE, "workload.micro_batch_tokens=512"])
    (stage,) = plan.training
    assert stage.micro_batch_tokens == 512 and Feature.SEQUENCE_PACKING in plan.features()
    batch = draw_batch(ctx.workload, ctx.seed, 0, ctx.algorithm)
    bins = packing.planned_bins(batch.prompt_lens + batch.output_lens, ctx.workload.mini_batch_size, 512)
    (pipe,) = stage.schedule.pipes.values()
    assert pipe.num_mbs == -(-bins // 2) < ctx.workload.mini_batch_size // 2  # fewer than one sample each
    written = json.loads(plan.to_json())["training"][0]
    assert written["micro_batch_tokens"] == 512
    assert type(plan).from_json(plan.to_json()).training[0].micro_batch_tokens == 512
    unpacked, _, _ = plan_for(BASE)
    assert "micro_batch_tokens" not in json.loads(unpacked.to_json())["training"][0]
    assert Feature.SEQUENCE_PACKING not in unpacked.features()


def test_packing_trains_the_same_tokens_in_fewer_micro_batches():
    """The FLOPs of the training spans are the mini-batches' tokens either way; the packed run
    takes fewer, larger micro-batches."""
    def train_flops(overrides):
        _, rows = simulate_iterations(overrides)
        trace, row = rows[0]
        spans = [s for s in trace.spans if s.task == "update_actor" and s.kind in ("forward", "backward")]
        return sum(s.flops * len(s.devices) for s in spans), len(spans), row

    flops, count, _ = train_flops(BASE)
    packed_flops, packed_count, _ = train_flops([*BASE, "workload.micro_batch_tokens=1024"])
    assert packed_flops == pytest.approx(flops, rel=1e-9)
    assert packed_count < count


def test_one_sample_a_bin_is_the_unpacked_run():
    """Every sample at the longest length (64 + 192 tokens, a multiple of 64) and a budget of one
    such sample: every bin holds one, so the packed run is the unpacked one, number for number."""
    fixed = [*BASE, "workload.output_len.kind=constant", "workload.output_len.median=192",
             "workload.output_len.min=192"]
    _, rows = simulate_iterations(fixed)
    _, packed_rows = simulate_iterations([*fixed, "workload.micro_batch_tokens=256"])
    assert packed_rows[0][1]["timing_s/step"] == rows[0][1]["timing_s/step"]
    assert packed_rows[0][1]["timing_s/update_actor"] == rows[0][1]["timing_s/update_actor"]


def test_a_budget_below_the_longest_sample_is_refused_before_planning():
    with pytest.raises(ConfigError, match="micro_batch_tokens=200 is below the longest sample"):
        plan_for([*BASE, "workload.micro_batch_tokens=200"])


def test_memory_is_checked_at_a_full_bin():
    from harness.planning.memory import microbatch_samples

    _, ctx, _ = plan_for([*BASE, "workload.micro_batch_tokens=1024"])
    assert microbatch_samples(ctx.workload) == 1024 / 256  # four samples of the longest length


# RLHFuse's fused actor+critic stage (PPO) on the same miniature workload
FUSED = ["+system=rlhfuse", "algo=ppo", *[o for o in BASE[3:] if not o.startswith("system.")],
         "system.fused_search.max_steps=200"]


def test_rlhfuses_fused_stage_packs_the_planned_bins():
    """The fused actor+critic schedule is searched over each model's packed micro-batches: per
    replica, the planned bins dealt over its dp (as single_pipe_stage plans a packed stage); the
    stage carries the budget, and trains the same tokens as unpacked in fewer micro-batches."""
    plan, ctx, _ = plan_for([*FUSED, "workload.micro_batch_tokens=1024"])
    (stage,) = plan.training
    assert stage.fused and stage.micro_batch_tokens == 1024
    batch = draw_batch(ctx.workload, ctx.seed, 0, ctx.algorithm)
    bins = packing.planned_bins(batch.prompt_lens + batch.output_lens, ctx.workload.mini_batch_size, 1024)
    for pipe in stage.schedule.pipes.values():
        dp = plan.task(f"update_{pipe.model}").allocation.strategy.dp
        assert pipe.num_mbs == packing.per_replica(bins, dp)
    unpacked, _, _ = plan_for(FUSED)
    (unpacked_stage,) = unpacked.training
    assert unpacked_stage.fused and unpacked_stage.micro_batch_tokens is None
    assert sum(p.num_mbs for p in stage.schedule.pipes.values()) < \
        sum(p.num_mbs for p in unpacked_stage.schedule.pipes.values())

    def train_flops(overrides):
        _, rows = simulate_iterations(overrides)
        return sum(s.flops * len(s.devices) for s in rows[0][0].spans
                   if s.task.startswith("update_") and s.kind in ("forward", "backward"))

    # the same layouts here, so the same tokens make the same FLOPs
    assert all(plan.task(t).allocation == unpacked.task(t).allocation for t in ("update_actor", "update_critic"))
    assert train_flops([*FUSED, "workload.micro_batch_tokens=1024"]) == pytest.approx(train_flops(FUSED), rel=1e-9)


def test_one_sample_a_bin_is_rlhfuses_unpacked_fused_stage():
    """Every sample 256 tokens and a budget of 256: each bin one sample, so the fused search sees
    the unpacked candidates, costs and memory, and plans and times the same stage."""
    fixed = [*FUSED, "workload.output_len.kind=constant", "workload.output_len.median=192",
             "workload.output_len.min=192"]
    plan, _, _ = plan_for(fixed)
    packed_plan, _, _ = plan_for([*fixed, "workload.micro_batch_tokens=256"])
    assert packed_plan.training[0].schedule == plan.training[0].schedule
    _, rows = simulate_iterations(fixed)
    _, packed_rows = simulate_iterations([*fixed, "workload.micro_batch_tokens=256"])
    assert packed_rows[0][1]["timing_s/update_actor"] == rows[0][1]["timing_s/update_actor"]
