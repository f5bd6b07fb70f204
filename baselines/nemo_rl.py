"""NeMo-RL (github.com/NVIDIA-NeMo/RL) GRPO in its colocated, synchronous mode, or with generation on
nodes of its own: ``+system=nemo_rl``.

What the original does: a policy of Megatron-core (``policy.megatron_cfg``: tensor, pipeline,
context and expert parallelism) or DTensor (FSDP2) workers, and vLLM generation workers
(``policy.generation.vllm_cfg.tensor_parallel_size``). Colocated (the default,
``policy.generation.colocated.enabled: true``), both share every GPU and a step runs generation,
"get logprobs" (the policy's and the reference model's log-probs, on the training workers),
training, then the refit of the new weights into vLLM (through CUDA IPC handles on the same GPUs);
its performance page defines a step as exactly these (../shared/published/README.md). Not
colocated, generation has GPUs of its own and the weights are broadcast to it over NCCL.

What we reproduce is :mod:`baselines.refit`'s plan (its docstring lists what it models and what it
does not) with NeMo-RL's choices: the ``megatron`` training engine in ``system.train_layout`` (or a
searched layout; ``engine.training=fsdp`` for the DTensor backend), vLLM engines of
``system.gen_tp`` GPUs (0 = searched) with up to ``system.max_num_seqs`` sequences each (vLLM's own
default, 256), and ``system.generation_nodes`` nodes of their own for generation when not 0 (the
non-colocated mode, a ``param_sync`` broadcast per step instead of the refit), and with
``system.max_trajectory_age_steps`` set its asynchronous GRPO (``grpo.async_grpo.enabled`` with
``max_trajectory_age_steps``: the published "1-step off" rows): generation of the next batches on
the generation nodes beside training, on weights at most that many steps old. Modelled as the
one-step-off pipeline of :mod:`harness.planning.iterations` (generation of batch ``k`` starts once
version ``k - age`` has been broadcast); NeMo-RL's replay buffer and trajectory collector, which
may also drop trajectories older than the bound, are not modelled (none is dropped here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from baselines.refit import RefitSystem
from harness.core.config import SystemConfig
from harness.system import register_system_config


@dataclass
class NemoRLConfig(SystemConfig):
    name: str = "nemo_rl"
    impl: str = "baselines.nemo_rl.NemoRL"
    gen_tp: int = 0  # policy.generation.vllm_cfg.tensor_parallel_size; 0 = the fastest that fits
    max_num_seqs: int = 256  # sequences per vLLM engine (vLLM's default max_num_seqs)
    train_layout: Optional[str] = None  # policy.megatron_cfg's dp/tp/pp, e.g. dp16tp4pp1; None = searched
    zero_stage: int = 1  # Megatron-core's distributed optimizer shards the optimizer states (ZeRO-1)
    generation_nodes: int = 0  # 0: colocated (refit on the same GPUs); k: generation on the last k nodes
    # the same in GPUs (generation.colocated.resources: gpus_per_node x num_nodes), for pools of part of a node
    generation_gpus: int = 0
    # grpo.async_grpo: None = synchronous (async_grpo.enabled false); k = asynchronous GRPO with
    # max_trajectory_age_steps k (needs generation_nodes or generation_gpus)
    max_trajectory_age_steps: Optional[int] = None
    generation_engine: str = "vllm"
    training_engine: str = "megatron"
    # colocated: the policy's training states and the reference weights in host memory while vLLM generates
    offload_for_generation: bool = True


class NemoRL(RefitSystem):
    cfg: NemoRLConfig
    KNOBS = {"rollout_tp": "gen_tp", "max_num_seqs": "max_num_seqs", "train_layout": "train_layout",
             "zero_stage": "zero_stage", "generation_nodes": "generation_nodes", "generation_gpus": "generation_gpus",
             "offload_for_generation": "offload_for_generation", "max_staleness": "max_trajectory_age_steps"}


register_system_config("nemo_rl", NemoRLConfig)
