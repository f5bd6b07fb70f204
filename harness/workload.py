"""Iteration inputs: prompt lengths and target output lengths drawn from the workload config.

Systems benchmarks of RLHF (RLHFuse section 7, ReaLHF, verl) control output lengths: each prompt
carries a target length drawn from a distribution fitted to the dataset, and generation ignores
EOS until it is reached. Long tails matter (RLHFuse section 2.2: P99.9 of output length is more
than 10x the median), so the default distribution is a lognormal clipped at ``max_gen_len``.

Batches are a pure function of (workload config, seed, iteration): every system sees the same
samples in the same iteration, so differences in throughput come from the systems alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.config import LengthDistConfig, WorkloadConfig
from harness.errors import ConfigError


@dataclass(frozen=True)
class Batch:
    iteration: int
    prompt_lens: np.ndarray  # int64 [global_batch_size]
    output_lens: np.ndarray  # int64 [global_batch_size], target tokens to generate

    @property
    def num_samples(self) -> int:
        return int(self.prompt_lens.shape[0])

    @property
    def total_num_tokens(self) -> int:
        return int(self.prompt_lens.sum() + self.output_lens.sum())


def sample_lengths(dist: LengthDistConfig, num: int, rng: np.random.Generator, cap: int | None = None) -> np.ndarray:
    upper = dist.max if cap is None else min(dist.max, cap)
    if dist.kind == "constant":
        values = np.full(num, dist.median, dtype=float)
    elif dist.kind == "lognormal":
        values = rng.lognormal(mean=np.log(dist.median), sigma=dist.sigma, size=num)
    else:
        raise ConfigError(f"unknown length distribution kind {dist.kind!r} (expected 'lognormal' or 'constant')")
    return np.clip(np.rint(values), dist.min, upper).astype(np.int64)


def validate_workload(w: WorkloadConfig) -> None:
    if w.global_batch_size % w.mini_batch_size:
        raise ConfigError(
            f"workload.global_batch_size={w.global_batch_size} is not a multiple of "
            f"workload.mini_batch_size={w.mini_batch_size}")
    if w.mini_batch_size % w.micro_batch_size:
        raise ConfigError(
            f"workload.mini_batch_size={w.mini_batch_size} is not a multiple of "
            f"workload.micro_batch_size={w.micro_batch_size}")
    if w.activation_recompute not in ("none", "selective", "full"):
        raise ConfigError(f"workload.activation_recompute={w.activation_recompute!r}; use none, selective or full")
    if w.max_gen_len < 1 or w.output_len.min > w.max_gen_len:
        raise ConfigError(f"workload.max_gen_len={w.max_gen_len} is below output_len.min={w.output_len.min}")


def make_batch(w: WorkloadConfig, seed: int, iteration: int) -> Batch:
    rng = np.random.default_rng([seed, iteration])
    prompts = sample_lengths(w.prompt_len, w.global_batch_size, rng)
    outputs = sample_lengths(w.output_len, w.global_batch_size, rng, cap=w.max_gen_len)
    return Batch(iteration, prompts, outputs)
