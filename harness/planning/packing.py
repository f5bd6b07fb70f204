"""Sequence packing: micro-batches as bins of whole samples up to a token budget.

NeMo-RL packs by default (``policy.sequence_packing``, on in every recipe of its performance tables,
with ``train_mb_tokens = max_total_sequence_length x train_micro_batch_size``):
``BatchedDataDict.shard_by_batch_size`` (``nemo_rl/distributed/batched_data_dict.py``, v0.5.0) rounds
each sequence of a mini-batch up to a multiple of 64 tokens (``sequence_length_round``), packs them
into bins of at most the budget with a first-fit-decreasing packer (``nemo_rl/data/packing/``), raises
the bin count to a multiple of the data-parallel size (``bin_count_multiple = shards``) and deals the
bins out to the replicas, so every replica runs the same number of micro-batches. verl's dynamic batch
size (``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``) bins per rank the same way. Attention runs
within each sample (variable-length kernels), so a packed micro-batch costs its tokens at its
samples' own lengths, with no padding between them.

This module owns the rule; ``workload.micro_batch_tokens`` turns it on:

- training (:func:`per_replica` of :func:`planned_bins`): the pipeline schedule's micro-batch count per replica
  is planned on the planning batch (iteration 0's, :func:`planned_bins`): the most bins any of its
  mini-batches needs, dealt over dp. The schedule is plan data, so every later iteration's mini-batch
  is split into that many micro-batches of equal tokens (:func:`samples_per_microbatch`) whatever its
  lengths;
- forward-only passes (log-probs, reference, reward, values: no schedule to keep): each pass's
  samples are packed anew (:func:`pass_microbatches_per_replica`). One budget serves both; NeMo-RL's
  log-prob budget is ``logprob_batch_size`` times the training one;
- memory: the largest micro-batch holds the budget's tokens (:func:`samples_at_longest`).

RLHFuse's fused actor-critic schedule is searched over each model's packed micro-batches (the
planned bins dealt over its replicas, as :func:`per_replica`). Not packed: inference streamed from
generation (RLHFuse's inter-stage fusion) takes finished samples ``micro_batch_size`` at a time as
they arrive.

``backend=ray`` executes packed plans with the same packer: a forward-only pass packs each
replica's rows (dealt round-robin) with :func:`pack_bins`, the bins :func:`num_bins` counts; a
training replica splits its share of each mini-batch into its pipe's planned micro-batch count
with :func:`balanced_bins`, micro-batches of nearly equal tokens (a later iteration's longer
samples can fill one past the budget, as the simulator's equal split does), each one packed row
(:mod:`harness.real.packing`).

The packer is plain first-fit decreasing; NeMo-RL's default, modified first-fit decreasing (Johnson
and Garey 1985), packs the small items differently and needs about as many bins on these workloads
(both within 71/60 of the optimum plus one bin).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Optional

import numpy as np

from harness.errors import PlanError

# NeMo-RL's ``sequence_length_round``: each packed sequence is padded to a multiple of this many tokens
LENGTH_MULTIPLE = 64


def padded_lengths(lengths: Iterable[float]) -> np.ndarray:
    """Sample lengths (tokens) rounded up to :data:`LENGTH_MULTIPLE`, as the packer sees them."""
    arr = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths, dtype=np.int64)
    return -(-arr // LENGTH_MULTIPLE) * LENGTH_MULTIPLE


def _first_fit_decreasing(sorted_desc: Iterable[int], budget: int, bin_of: Optional[np.ndarray] = None) -> int:
    """First-fit decreasing over lengths already sorted longest first: the bin count, and with
    ``bin_of`` each item's bin, written in place (the one packer the planner counts with and the
    Ray backend packs with)."""
    lengths = list(sorted_desc)
    free = np.empty(len(lengths), dtype=np.int64)
    num_bins = 0
    for i, length in enumerate(lengths):
        fits = np.flatnonzero(free[:num_bins] >= length)
        if fits.size:
            b = int(fits[0])
            free[b] -= length
        else:
            b = num_bins
            free[b] = budget - length
            num_bins += 1
        if bin_of is not None:
            bin_of[i] = b
    return num_bins


@lru_cache(maxsize=512)
def _ffd_bins(sorted_desc: tuple[int, ...], budget: int) -> int:
    return _first_fit_decreasing(sorted_desc, budget)


def _check_fits(padded: np.ndarray, budget: int) -> None:
    if padded.size and int(padded.max()) > budget:
        raise PlanError(f"a sample of {int(padded.max())} tokens (padded to a multiple of {LENGTH_MULTIPLE}) "
                        f"exceeds workload.micro_batch_tokens={budget}: it fits no packed micro-batch")


def num_bins(lengths: Iterable[float], budget: int) -> int:
    """Bins of at most ``budget`` tokens that first-fit decreasing packs ``lengths`` (padded to
    :data:`LENGTH_MULTIPLE`) into. A sample longer than the budget fits no bin: PlanError."""
    padded = padded_lengths(lengths)
    if padded.size == 0:
        return 0
    _check_fits(padded, budget)
    return _ffd_bins(tuple(int(x) for x in np.sort(padded)[::-1]), int(budget))


def pack_bins(lengths: Iterable[float], budget: int) -> list[list[int]]:
    """The bins :func:`num_bins` counts, as lists of indices into ``lengths`` (each bin's in
    increasing order; bins in the order the packer opened them). Equal lengths are taken lower
    index first, so the packing is a function of the lengths alone."""
    padded = padded_lengths(lengths)
    if padded.size == 0:
        return []
    _check_fits(padded, budget)
    order = np.argsort(-padded, kind="stable")
    bin_of = np.empty(len(order), dtype=np.int64)
    count = _first_fit_decreasing((int(x) for x in padded[order]), int(budget), bin_of)
    bins: list[list[int]] = [[] for _ in range(count)]
    for i, b in zip(order, bin_of):
        bins[int(b)].append(int(i))
    return [sorted(b) for b in bins]


def balanced_bins(lengths: Iterable[float], num_parts: int) -> list[list[int]]:
    """``lengths`` split into exactly ``num_parts`` groups of nearly equal tokens (longest first,
    each to the group with the fewest tokens so far, ties to the lowest group: Graham's LPT rule,
    its largest group within 4/3 of the best), as lists of indices in increasing order: how a
    replica's share of a mini-batch fills the micro-batch count its pipeline schedule was planned
    with (:func:`per_replica`), the simulator's "micro-batches of equal tokens". With at least as
    many lengths as groups no group is empty. Deterministic in the lengths."""
    arr = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths, dtype=np.int64)
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be at least 1")
    if len(arr) < num_parts:
        raise PlanError(f"{len(arr)} samples cannot fill {num_parts} packed micro-batches")
    loads = np.zeros(num_parts, dtype=np.int64)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in np.argsort(-arr, kind="stable"):
        b = int(np.argmin(loads))
        loads[b] += arr[i]
        parts[b].append(int(i))
    return [sorted(p) for p in parts]


def per_replica(bins: int, dp: int) -> int:
    """Micro-batches each of ``dp`` replicas runs for ``bins`` bins: the count raised to a multiple
    of dp (at least dp) and dealt out evenly."""
    return max(1, math.ceil(bins / dp))


def planned_bins(seq_lens: np.ndarray, mini_batch_samples: int, budget: int) -> int:
    """The most bins any mini-batch of ``seq_lens`` (consecutive runs of ``mini_batch_samples``)
    needs: what a training schedule's micro-batch count is planned on."""
    return max(num_bins(seq_lens[lo:lo + mini_batch_samples], budget)
               for lo in range(0, len(seq_lens), mini_batch_samples))


def samples_per_microbatch(mini_batch_samples: int, dp: int, num_mbs: int) -> float:
    """Mean samples in one of a replica's ``num_mbs`` packed micro-batches of its share of a mini-batch."""
    return mini_batch_samples / (dp * num_mbs)


def pass_microbatches_per_replica(seq_lens: np.ndarray, budget: int, dp: int) -> int:
    """Micro-batches per replica of a forward-only pass over ``seq_lens`` packed to ``budget``."""
    return per_replica(num_bins(seq_lens, budget), dp)


def samples_at_longest(micro_batch_size: int, micro_batch_tokens: Optional[int], max_seq_len: float) -> float:
    """Samples of the longest length one micro-batch can hold: ``micro_batch_size`` unpacked, else
    the budget's worth (what activation memory is checked at)."""
    if micro_batch_tokens is None:
        return float(micro_batch_size)
    return micro_batch_tokens / max_seq_len


def check_plan_packing(plan, micro_batch_tokens: Optional[int]) -> None:
    """Every training stage of ``plan`` packs as the workload says (``micro_batch_tokens``): a
    system that plans its own stages must carry the budget, else the option would silently do
    nothing. PlanError naming the stage."""
    for stage in plan.training:
        if stage.micro_batch_tokens != micro_batch_tokens:
            raise PlanError(f"{plan.system}: training stage {'+'.join(stage.tasks)} is planned with micro_batch_tokens="
                            f"{stage.micro_batch_tokens}, the workload's is {micro_batch_tokens} "
                            f"(the system does not plan packed micro-batches)")
