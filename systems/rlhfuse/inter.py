"""RLHFuse inter-stage fusion planning (RLHFuse, NSDI'25, arXiv 2409.13221, section 4).

Generation and inference are split into per-sample subtasks: a finished sample goes to ref,
reward and critic inference at once. When fewer than R_t samples remain unfinished, they migrate
to ``m`` generation instances and the freed devices run inference. This module decides:

- ``BS_max``: the decode batch size beyond which step latency stops being flat (decoding is
  memory-bound up to it: weights are streamed once per step whatever the batch). Found from the
  cost model (or a profile table) as the largest batch whose step time is within ``flat_tol``
  (10%) of the batch-1 step at the same per-sample context.
- ``m = max(ceil(R_t / BS_max), ceil(R_t * KV(max-length sample) / KV capacity per instance))``:
  enough tail instances to keep decode latency flat and to hold the tail's KV cache.
- ``R_t``: chosen by simulating generation + streaming inference for R_t from 5% to 95% of the
  batch (step 5%; and 0 = streaming without migration) with the workload's output-length
  distribution, keeping the fastest; re-chosen whenever the plan is made for a different
  workload. ``system.migration_frac`` pins it.
- the one inference layout shared by ref, reward and critic, chosen together with R_t: the pair
  whose streaming inference ends first. Coordinate descent (R_t for the layout, then the layout for
  R_t, until neither changes) from two starts, the best layout behind a probe migration (R_t = 20%)
  and the best layout without migration, so the chosen pair is never worse on the estimate than
  streaming without migration on its best layout.

Everything here scores candidates with the simulator's own models (:mod:`harness.planning.estimate`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from harness.core.algorithm import samples_per_round
from harness.costmodel import CostModel
from harness.costmodel.llama import kv_bytes_per_token
from typing import Callable

from harness.core.plan import GenerationPolicy, MigrationPolicy, ParallelStrategy, Task, WeightMovement
from harness.system import PlanContext

DEFAULT_FRACS = tuple(round(0.05 * k, 2) for k in range(1, 20))


def max_flat_batch_size(cm: CostModel, model, tp: int, pp: int, context_len: int, flat_tol: float = 0.1,
                        limit: int = 4096, ep: int = 1) -> int:
    """BS_max: the largest batch whose decode step is within ``flat_tol`` of the batch-1 step (a MoE
    model's step streams more experts as the batch grows, so its BS_max is smaller)."""
    base = cm.decode_step_s(model, 1, context_len, tp, pp, ep)
    lo, hi = 1, limit
    if cm.decode_step_s(model, hi, hi * context_len, tp, pp, ep) <= base * (1 + flat_tol):
        return hi
    while hi - lo > 1:  # step time grows monotonically with the batch
        mid = (lo + hi) // 2
        if cm.decode_step_s(model, mid, mid * context_len, tp, pp, ep) <= base * (1 + flat_tol):
            lo = mid
        else:
            hi = mid
    return lo


def num_tail_instances(threshold_samples: int, bs_max: int, kv_bytes_max_sample: float,
                       kv_capacity_bytes_per_instance: float, num_instances: int) -> int:
    by_batch = math.ceil(threshold_samples / bs_max)
    by_memory = math.ceil(threshold_samples * kv_bytes_max_sample / kv_capacity_bytes_per_instance)
    return max(1, min(num_instances, max(by_batch, by_memory)))


@dataclass
class MigrationChoice:
    policy: MigrationPolicy
    bs_max: int
    curve: dict[float, float]  # R_t fraction -> estimated generation+inference seconds


def migration_policy(ctx: PlanContext, gen: Task, frac: float, kv_capacity_gb: float, transfer: str,
                     bs_max: int) -> MigrationPolicy:
    actor = ctx.model("actor")
    s = gen.allocation.strategy
    threshold = math.ceil(frac * samples_per_round(ctx.workload, ctx.algorithm))  # R_t of a generation round
    max_len = int(ctx.workload.prompt_len.max + ctx.workload.max_gen_len)
    kv_instance_bytes = kv_capacity_gb * 1e9 * s.tp * s.pp  # capacity per device x devices of the instance
    m = num_tail_instances(threshold, bs_max, kv_bytes_per_token(actor) * max_len, kv_instance_bytes, s.dp)
    return MigrationPolicy(threshold_frac=frac, num_tail_instances=m, transfer=transfer)


def _kept_of_first_round(result, batch, group_size: int):
    """``result`` (a dynamic-sampling batch's first round) as the stream of its kept samples."""
    from harness.planning.taskmodels.generation import GenerationResult
    from harness.planning.taskmodels.sampling import group_ready_s, kept_stream

    finished = np.empty(len(result.samples))
    for rec in result.samples:
        finished[rec.sample_id] = rec.finish_s
    return GenerationResult(kept_stream(batch, group_ready_s(finished, group_size)), result.instances,
                            result.migrated_samples, result.tail_instances, result.migration_s)


def choose_inter_stage(ctx: PlanContext, gen: Task, inference_layouts: list[ParallelStrategy],
                       make_inference: Callable[[ParallelStrategy], tuple[list[Task], dict[str, WeightMovement]]],
                       base_policy: GenerationPolicy, kv_capacity_gb: float, transfer: str,
                       fracs: tuple[float, ...] = DEFAULT_FRACS, pinned_frac: float | None = None,
                       probe_frac: float = 0.2) -> tuple[MigrationChoice, ParallelStrategy]:
    """Choose the shared inference layout and R_t over ``{0} U fracs`` (0 = stream without
    migrating) together: the pair whose generation + streaming inference ends first on the
    estimate, found by coordinate descent from the best layout behind a probe migration at
    ``probe_frac`` and from the best layout without migration."""
    from harness.planning.taskmodels.generation import simulate_generation_each
    from harness.planning.estimate import representative_batch, streaming_inference_end_s

    s = gen.allocation.strategy
    actor = ctx.model("actor")
    typical_context = int(ctx.workload.prompt_len.median + ctx.workload.output_len.median)
    bs_max = max_flat_batch_size(ctx.cost_model, actor, s.tp, s.pp, typical_context, ep=s.ep)
    batch = representative_batch(ctx)
    probe_frac = pinned_frac if pinned_frac is not None else probe_frac
    swept = (pinned_frac,) if pinned_frac is not None else (0.0,) + tuple(fracs)
    # every threshold's generation in one sweep: they share the run that fixes their migration times
    migs = {frac: migration_policy(ctx, gen, frac, kv_capacity_gb, transfer, bs_max) if frac > 0 else None
            for frac in dict.fromkeys((probe_frac,) + swept)}
    # under dynamic sampling: the first round, streaming its kept samples as their groups complete
    # (the scoring time left out; one round fills the batch unless few groups have mixed outcomes)
    gen_batch = batch.rounds[0] if batch.rounds is not None else batch
    results = simulate_generation_each(ctx.cost_model, gen, [replace(base_policy, migration=m) for m in migs.values()],
                                       actor, gen_batch.prompt_lens, gen_batch.output_lens, 0.0, kv_capacity_gb,
                                       ctx.workload.max_gen_len)
    if batch.rounds is not None:
        results = [_kept_of_first_round(r, batch, ctx.algorithm.group_size) for r in results]
    generated = dict(zip(migs, results))

    cache: dict[tuple[int, float], float] = {}
    inference_of: dict[int, tuple[list[Task], dict[str, WeightMovement]]] = {}

    def end_s(i: int, frac: float) -> float:
        """Generation + streaming inference time of layout ``i`` behind threshold ``frac``."""
        if (i, frac) not in cache:
            if i not in inference_of:
                inference_of[i] = make_inference(inference_layouts[i])
            cache[(i, frac)] = streaming_inference_end_s(ctx, generated[frac], *inference_of[i])
        return cache[(i, frac)]

    def best_layout(frac: float) -> int:  # ties: the first candidate
        return min(range(len(inference_layouts)), key=lambda i: (end_s(i, frac), i))

    def best_frac(i: int) -> float:  # ties: the smaller threshold (0 = no migration first)
        return min(swept, key=lambda f: (end_s(i, f), f))

    # Layout and R_t are chosen together, by coordinate descent on the estimate from two starts:
    # the best layout behind the probe threshold, and (when R_t is searched) the best layout without
    # migration, so the pair chosen is never worse than streaming without migration on its best
    # layout. Each step re-chooses R_t for the layout, then the layout for R_t, until neither moves.
    starts = dict.fromkeys([best_layout(probe_frac)] + ([best_layout(0.0)] if 0.0 in swept else []))
    pairs = []
    for i in starts:
        frac = best_frac(i)
        while True:
            j = best_layout(frac)
            if end_s(j, frac) >= end_s(i, frac) - 1e-12:
                break
            i, frac = j, best_frac(j)
        pairs.append((end_s(i, frac), frac, i))
    _, frac, i = min(pairs)
    curve = {f: end_s(i, f) for f in swept}
    policy = migs[frac] or MigrationPolicy(0.0, 0, transfer)
    return MigrationChoice(policy, bs_max, curve), inference_layouts[i]
