"""Tail batching: RollPacker (Gao et al., "RollPacker: Mitigating Long-Tail Rollouts for Fast,
Synchronous RL Post-Training", arXiv 2509.21009, NSDI'26): ``+system=rollpacker``.

What the original does: synchronous, on-policy RL whose rollout steps are of two kinds. In most
steps ("short rounds") it launches more prompts than it trains on and keeps the first to finish
(speculative execution, race to completion), which leaves out the prompts that would produce the
longest responses; those prompts are aborted and queued. Once a batch of them is queued, a "long
round" generates them to their full lengths without speculation, so the long responses are
batched together instead of idling the GPUs in every step. It also chooses the rollout's tensor
parallelism per round (long rounds want more), schedules reward computation, and streams
training; it reports 2.03-2.56x over veRL and up to 2.24x over RLHFuse on Qwen2.5 models, up to
128 H800 GPUs (its abstract; those numbers are what to reproduce, not tuned towards).

What we reproduce is :mod:`baselines.refit`'s plan (every model on every GPU, verl's stages in
turn; RollPacker builds on a veRL-style synchronous trainer) with tail batching
(:mod:`harness.planning.partial`): short rounds launch ``system.speculation`` times the prompt
groups trained (1.25, the paper's eta: "we fix eta = 1.25 for both", prompts and responses, its
section 6.3; so a long round follows every four short ones, the period of its Figure 4),
long rounds regenerate the queued prompts' responses around their own length factor, so long
rounds are long only where prompts set lengths (``workload.output_len.prompt_sigma``, 0 by
default). Its parallelism planner (section 4.2) is ``system.parallelism_planner`` (on by default):
short and long rounds each keep a tensor parallelism, starting at the plan's rollout tp (the
fastest without tail batching, as RollPacker profiles its defaults), doubled after a round whose KV
preemptions rose by more than 5% and halved after four rounds without any, within a node
(:mod:`harness.planning.partial`). Not modelled: the response-level speculation (each prompt's
1.25 x R0 responses, the first R0 to finish kept and the rest aborted: here each prompt generates
its R0, so its group finishes with its longest), reward scheduling, streamed training. FSDP training and vLLM generation by default, as ``+system=verl``.
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
class RollPackerConfig(SystemConfig):
    name: str = "rollpacker"
    impl: str = "baselines.rollpacker.RollPacker"
    speculation: float = 1.25  # prompt groups launched per short round / groups trained (the paper's eta)
    parallelism_planner: bool = True  # per-round tensor parallelism (section 4.2); false: every round at rollout_tp
    rollout_tp: int = 0  # tensor parallelism of a vLLM engine; 0 = the fastest that fits
    max_num_seqs: int = 1024
    gpu_memory_utilization: Optional[float] = None  # vLLM's share of each GPU (weights + KV cache); None: what the plan leaves free
    train_layout: Optional[str] = None  # Megatron backend only (engine.training=megatron)
    zero_stage: int = 1
    generation_engine: str = "vllm"
    training_engine: str = "fsdp"


class RollPacker(RefitSystem):
    cfg: RollPackerConfig
    KNOBS = {"rollout_tp": "rollout_tp", "max_num_seqs": "max_num_seqs", "train_layout": "train_layout",
             "zero_stage": "zero_stage", "gpu_memory_utilization": "gpu_memory_utilization"}

    def off_policy(self, ctx: PlanContext, max_staleness: Optional[int]) -> Optional[OffPolicyPolicy]:
        if not self.cfg.speculation >= 1:
            raise ConfigError(f"system.speculation={self.cfg.speculation}: launch at least the groups trained (>= 1)")
        return OffPolicyPolicy(0, rollout="tail_batching", oversample_factor=float(self.cfg.speculation),
                               round_tp="adaptive" if self.cfg.parallelism_planner else "fixed")


register_system_config("rollpacker", RollPackerConfig)
