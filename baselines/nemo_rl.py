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
``max_trajectory_age_steps``: the published "1-step off" rows): generation on the generation
GPUs beside training, on weights at most that many steps old. Its ``AsyncTrajectoryCollector``
launches each prompt group as a request of its own, up to prompts-per-step x age groups in flight,
each for a target training step no more than ``age`` steps beyond the weights it starts with, and
the replay buffer hands step ``k`` exactly the groups targeted at it: continuous rollout with
``batch_order="iteration"`` (:mod:`harness.planning.rollout`). At a refit the collector stops
launching and, with ``system.in_flight_weight_updates`` (``grpo.async_grpo.in_flight_weight_updates``,
which the asynchronous performance recipes set), loads the weights between decode steps while
running requests continue with their KV cache, or without it waits for every launched group to
finish first (``drain``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from baselines.refit import RefitSystem
from harness.core.config import SystemConfig
from harness.core.plan import OffPolicyPolicy, Plan
from harness.system import PlanContext, register_system_config


@dataclass
class NemoRLConfig(SystemConfig):
    name: str = "nemo_rl"
    impl: str = "baselines.nemo_rl.NemoRL"
    gen_tp: int = 0  # policy.generation.vllm_cfg.tensor_parallel_size; 0 = the fastest that fits
    max_num_seqs: int = 256  # sequences per vLLM engine (vLLM's default max_num_seqs)
    # policy.generation.vllm_cfg.gpu_memory_utilization: the share of each GPU vLLM takes for its weights
    # and KV cache (the recipes: 0.6 colocated, 0.8 asynchronous); None = what the plan leaves free
    gpu_memory_utilization: Optional[float] = None
    train_layout: Optional[str] = None  # policy.megatron_cfg's dp/tp/pp, e.g. dp16tp4pp1; None = searched
    zero_stage: int = 1  # Megatron-core's distributed optimizer shards the optimizer states (ZeRO-1)
    generation_nodes: int = 0  # 0: colocated (refit on the same GPUs); k: generation on the last k nodes
    # the same in GPUs (generation.colocated.resources: gpus_per_node x num_nodes), for pools of part of a node
    generation_gpus: int = 0
    # grpo.async_grpo: None = synchronous (async_grpo.enabled false); k = asynchronous GRPO with
    # max_trajectory_age_steps k, on generation_nodes or generation_gpus of its own (both 0: the
    # fastest of a quarter, half and three quarters of the GPUs)
    max_trajectory_age_steps: Optional[int] = None
    # grpo.async_grpo.in_flight_weight_updates (NeMo-RL's default: false): new weights loaded while requests run
    in_flight_weight_updates: bool = False
    generation_engine: str = "vllm"
    training_engine: str = "megatron"
    # colocated: the policy's training states and the reference weights in host memory while vLLM generates
    offload_for_generation: bool = True


class NemoRL(RefitSystem):
    cfg: NemoRLConfig

    def plan(self, ctx: PlanContext) -> Plan:
        if self.cfg.max_trajectory_age_steps is not None:  # asynchronous GRPO needs pools of its own
            return self.pooled(ctx)
        return self.refit(ctx)

    def off_policy(self, ctx: PlanContext, max_staleness: Optional[int]) -> Optional[OffPolicyPolicy]:
        """Asynchronous GRPO: continuous rollout, each step trained on the groups targeted at it, at
        most prompts-per-step x age groups in flight (module docstring)."""
        if max_staleness is None:
            return None
        prompts = ctx.workload.global_batch_size // ctx.algorithm.group_size
        return OffPolicyPolicy(max_staleness, rollout="continuous",
                               weight_update="inflight" if self.cfg.in_flight_weight_updates else "drain",
                               batch_order="iteration", max_groups_in_flight=prompts * max(1, max_staleness))
    KNOBS = {"rollout_tp": "gen_tp", "max_num_seqs": "max_num_seqs", "train_layout": "train_layout",
             "zero_stage": "zero_stage", "generation_nodes": "generation_nodes", "generation_gpus": "generation_gpus",
             "offload_for_generation": "offload_for_generation", "max_staleness": "max_trajectory_age_steps",
             "gpu_memory_utilization": "gpu_memory_utilization"}


register_system_config("nemo_rl", NemoRLConfig)
