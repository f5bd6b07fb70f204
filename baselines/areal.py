"""AReaL: fully asynchronous RL with interruptible rollout (Fu et al., "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning", arXiv 2505.24298;
github.com/inclusionAI/AReaL): ``+system=areal``.

What the original does (its section 4-5): generation and training on devices of their own.
Rollout workers generate continuously and never wait for training: each prompt group is submitted
as soon as the staleness controller allows, and the trainer updates the policy as soon as a batch
of finished trajectories is in the buffer. When new weights arrive, generation in flight is
interrupted: the running requests' KV caches are discarded, the weights loaded, and the requests
continue, their prompt and tokens so far recomputed under the new weights (so one trajectory may
hold tokens of several versions). Staleness is bounded by ``eta`` (``max_head_offpolicyness``):
with ``B`` trajectories a batch and policy version ``i``, a new request is submitted only while
``(N_r - 1) // B <= i + eta`` (``N_r`` the requests submitted so far, itself included), and the
trainer takes the earliest finished trajectories. A decoupled PPO objective corrects for the
staleness; on ``backend=ray`` the losses are the algorithm's, with log-probs recomputed by the
training engine (AReaL's proximal policy) and without the behaviour-policy importance weight.

What we reproduce is :mod:`baselines.refit`'s plan with generation on ``system.rollout_gpus`` of
its own (0 = the fastest of a quarter, half and three quarters of the GPUs) and continuous rollout
(:mod:`harness.planning.rollout`): ``weight_update="interrupt"``, ``batch_order="finish"`` (finished
groups trained in the order they finish; a group staler than ``eta`` when its turn comes is
dropped, never trained), the submission rule above counted in prompt groups (a GRPO group's
responses are one request each, submitted together), no limit on groups in flight beyond it. The
weights move by the plan's ``param_sync`` broadcast, during which the engines pause. Training runs
in FSDP (``engine.training=megatron`` for Megatron), generation in the ``vllm`` engine (AReaL
generates with SGLang: its constants are vLLM's here, as for every CUDA-graph engine that has no
measurements of its own). What :mod:`baselines.refit` does not model applies here too.
``backend=ray`` executes these decisions for real (docs/ASYNC.md, "On Ray").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from baselines.refit import RefitSystem
from harness.core.config import SystemConfig
from harness.core.plan import OffPolicyPolicy, Plan
from harness.errors import ConfigError
from harness.system import PlanContext, register_system_config


@dataclass
class ArealConfig(SystemConfig):
    name: str = "areal"
    impl: str = "baselines.areal.Areal"
    eta: int = 4  # max_head_offpolicyness: how many versions a trained trajectory may lag (an assumed default)
    rollout_gpus: int = 0  # GPUs of the rollout workers; 0 = searched (module docstring)
    rollout_tp: int = 0  # tensor parallelism of a rollout engine; 0 = the fastest that fits
    max_num_seqs: int = 1024  # sequences per rollout engine
    train_layout: Optional[str] = None  # Megatron backend only (engine.training=megatron)
    zero_stage: int = 1
    generation_engine: str = "vllm"
    training_engine: str = "fsdp"


class Areal(RefitSystem):
    cfg: ArealConfig
    KNOBS = {"rollout_tp": "rollout_tp", "max_num_seqs": "max_num_seqs", "train_layout": "train_layout",
             "zero_stage": "zero_stage", "generation_gpus": "rollout_gpus", "max_staleness": "eta"}

    def off_policy(self, ctx: PlanContext, max_staleness: Optional[int]) -> Optional[OffPolicyPolicy]:
        return OffPolicyPolicy(max_staleness, rollout="continuous", weight_update="interrupt", batch_order="finish")

    def plan(self, ctx: PlanContext) -> Plan:
        if self.cfg.eta < 0:
            raise ConfigError(f"system.eta={self.cfg.eta}: weight versions, >= 0")
        return self.pooled(ctx)


register_system_config("areal", ArealConfig)
