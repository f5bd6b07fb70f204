"""Partial rollout with over-provisioning: APRIL (Zhou et al., "APRIL: Active Partial Rollouts in
Reinforcement Learning to Tame Long-tail Generation", arXiv 2509.18521; in the slime framework):
``+system=partial_rollout``.

What the original does: each synchronous iteration launches more prompt groups than it trains on
(over-provisioning); once the batch's number of groups has finished, the generation still running
is aborted, its partial responses kept in a buffer, and the next iteration resumes them first,
under its new weights, before it launches new prompts. Generation thus ends when the batch is full,
not when its longest response ends; a response finished over several iterations holds tokens of
several policy versions. slime trains with Megatron-LM and generates with SGLang, colocated on the
same GPUs or on pools of their own.

What we reproduce is :mod:`baselines.refit`'s plan (colocated by default, stages in turn, the
weights refit into the engines each iteration; ``system.generation_gpus`` for pools of their own)
with partial rollout (:mod:`harness.planning.partial`): ``system.oversample_factor`` times the
groups trained are launched (an assumed 2; the paper's setting is not read here), carried responses
re-prefill their prompt and tokens under the new weights, and a carried response whose first token
is more than ``system.max_staleness`` versions old starts again (APRIL sets no bound; 16 here keeps
the bound a hard rule without binding in practice). Megatron training (``system.train_layout`` or
searched), the ``vllm`` generation engine's constants for SGLang (as for every CUDA-graph engine
without measurements of its own). What :mod:`baselines.refit` does not model applies here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from baselines.refit import RefitSystem
from harness.core.config import SystemConfig
from harness.core.plan import OffPolicyPolicy
from harness.errors import ConfigError
from harness.system import PlanContext, register_system_config


@dataclass
class PartialRolloutConfig(SystemConfig):
    name: str = "partial_rollout"
    impl: str = "baselines.partial_rollout.PartialRollout"
    oversample_factor: float = 2.0  # prompt groups launched per iteration / groups trained (an assumption)
    max_staleness: int = 16  # a carried response older than this starts again (APRIL sets none)
    generation_gpus: int = 0  # 0 = colocated; k = generation on the last k GPUs
    rollout_tp: int = 0  # tensor parallelism of a generation engine; 0 = the fastest that fits
    max_num_seqs: int = 1024  # sequences per generation engine
    train_layout: Optional[str] = None  # Megatron dp/tp/pp, e.g. dp8tp2pp1; None = searched
    zero_stage: int = 1  # Megatron's distributed optimizer
    generation_engine: str = "vllm"
    training_engine: str = "megatron"


class PartialRollout(RefitSystem):
    cfg: PartialRolloutConfig
    KNOBS = {"rollout_tp": "rollout_tp", "max_num_seqs": "max_num_seqs", "train_layout": "train_layout",
             "zero_stage": "zero_stage", "generation_gpus": "generation_gpus", "max_staleness": "max_staleness"}

    def off_policy(self, ctx: PlanContext, max_staleness: Optional[int]) -> Optional[OffPolicyPolicy]:
        if not self.cfg.oversample_factor >= 1:
            raise ConfigError(f"system.oversample_factor={self.cfg.oversample_factor}: launch at least the groups "
                              f"trained (>= 1)")
        if max_staleness is None or max_staleness < 0:
            raise ConfigError(f"system.max_staleness={max_staleness}: weight versions, >= 0")
        return OffPolicyPolicy(max_staleness, rollout="partial", oversample_factor=float(self.cfg.oversample_factor))


register_system_config("partial_rollout", PartialRolloutConfig)
