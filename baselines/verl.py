"""verl (HybridFlow: Sheng et al., "HybridFlow: A Flexible and Efficient RLHF Framework", EuroSys'25,
arXiv 2409.19256; github.com/verl-project/verl) in its default colocated, synchronous mode:
``+system=verl``.

What the original does: one resource pool holds every model; the actor, its vLLM rollout and the
reference model share one worker group (``actor_rollout_ref``), the critic and reward model their
own groups on the same GPUs, and the single-controller trainer (``RayPPOTrainer.fit``) runs each
step's stages in turn: generate (``generate_sequences``, vLLM), recompute the old log-probs with the
actor (``compute_log_prob``), the reference log-probs, rewards (a rule-based reward function on the
driver, or a reward model), values (PPO), advantages on the driver, then ``update_critic`` and
``update_actor``. The actor trains under FSDP by default (``actor_rollout_ref.actor.strategy``; a
Megatron-core backend exists); between update and generation its weights are resharded into vLLM's
tensor-parallel layout on the same GPUs (the 3D-HybridEngine, section 5.3).

What we reproduce is :mod:`baselines.refit`'s plan (its docstring lists what it models and what it
does not) with verl's defaults: the ``fsdp`` training engine (``engine.training=megatron`` with
``system.train_layout`` or a searched layout for the Megatron backend), vLLM engines of
``system.rollout_tp`` GPUs (``actor_rollout_ref.rollout.tensor_model_parallel_size``; 0 = searched)
with up to ``system.max_num_seqs`` sequences each (``rollout.max_num_seqs``, 1024 in verl's
``ppo_trainer.yaml``). The rule-based reward is the algorithm's verifier on the driver
(``algo.reward=rule``), as verl's ``RewardManager`` scores the generated batch there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from baselines.refit import RefitSystem
from harness.core.config import SystemConfig
from harness.system import register_system_config


@dataclass
class VerlConfig(SystemConfig):
    name: str = "verl"
    impl: str = "baselines.verl.Verl"
    rollout_tp: int = 0  # actor_rollout_ref.rollout.tensor_model_parallel_size; 0 = the fastest that fits
    max_num_seqs: int = 1024  # actor_rollout_ref.rollout.max_num_seqs: sequences per vLLM engine
    # actor_rollout_ref.rollout.gpu_memory_utilization: the share of each GPU vLLM takes for its weights and
    # KV cache; None = what the plan leaves free
    gpu_memory_utilization: Optional[float] = None
    train_layout: Optional[str] = None  # Megatron backend only (engine.training=megatron): e.g. dp8tp4pp1
    zero_stage: int = 1  # Megatron backend: its distributed optimizer shards the optimizer states (ZeRO-1)
    generation_engine: str = "vllm"
    training_engine: str = "fsdp"


class Verl(RefitSystem):
    cfg: VerlConfig
    KNOBS = {"rollout_tp": "rollout_tp", "max_num_seqs": "max_num_seqs", "train_layout": "train_layout",
             "zero_stage": "zero_stage", "gpu_memory_utilization": "gpu_memory_utilization"}


register_system_config("verl", VerlConfig)
