"""DeepSpeed-Chat (Yao et al., "DeepSpeed-Chat: Easy, Fast and Affordable RLHF Training of
ChatGPT-like Models at All Scales", arXiv 2308.01320) as a plan: ``+system=deepspeed_chat``.

What the original does, and what we reproduce as plan data:

- **Placement**: all four models are co-located on every GPU. Actor and critic train with ZeRO-3
  data parallelism over all GPUs (``dp = N, zero_stage = 3``); ref and reward run ZeRO-3 inference
  over all GPUs. Reproduced.
- **Hybrid engine generation**: before generation the actor's ZeRO-3 shards are gathered into a
  tensor-parallel inference layout (``inference_tp_size``, here ``gen_tp``, default one node, or the
  largest tp inside a node that divides the actor's attention heads: 4 for LLaMA-33B's 52) and
  every TP group generates with a *static* batch: each round decodes until the longest sample of
  the round ends. Reproduced as a ``realloc_actor_gen`` weight movement plus ``static`` batching
  with ``generation_batch_size`` prompts per round across the cluster.
- **Sequential stages**: generation, then ref, reward and critic inference, then actor training,
  then critic training, one after another on all GPUs. Reproduced (every task uses every device,
  so the simulator serialises them).
- **Engines of its reference implementation** (:mod:`harness.core.engines`): generation on the hybrid
  engine (``conf/engine/generation/ds_hybrid.yaml``: DeepSpeed's fused inference kernels under Hugging
  Face ``generate``, an eager Python loop, rounds synced across ranks under ZeRO-3, prompts padded to
  the maximum and later passes padded to the round's longest sequence) and training on DeepSpeed ZeRO
  (``conf/engine/training/deepspeed.yaml``; ``deepspeed_offload`` for ``--offload``). With
  ``engine.generation=ds_chat_generate`` (hybrid engine disabled) the actor generates in place with
  its training layout, each GPU its own batch, gathering ZeRO-3 shards at every step.
  ``system.actor_zero_stage`` / ``critic_zero_stage`` set the per-model ZeRO stages (the reference
  model follows the actor's, the reward model the critic's), ``system.offload_reference_model`` keeps
  the reference model in host memory.
- **Mini-batch, micro-batch and generation batch, derived from the cluster and the workload**:
  DeepSpeed-Chat trains with ZeRO-3 data parallelism over all N GPUs, so every micro-step needs at
  least one sample on every GPU: its mini-batch (``train_batch_size``) is
  ``per_device_training_batch_size`` (>= 1) x N x gradient-accumulation steps, a multiple of N. The
  RLHFuse authors therefore raised its mini-batch from the workload's 64 to 256 on their 256 GPUs
  (RLHFuse section 7): the smallest change that gives every GPU a sample. ``mini_batch_size: null``
  (the default) applies that rule to any cluster: the mini-batch is the smallest multiple of N that
  is at least ``workload.mini_batch_size`` and divides ``workload.global_batch_size``
  (:func:`derived_mini_batch_size`): 256 on the paper's 256 GPUs with batch 512, the workload's 64
  on one 8-GPU node, the workload's 4 for ``workload=tiny`` on 1, 2 or 4 devices. Each GPU's
  micro-batch (``per_device_training_batch_size``) is the workload's, or the largest divisor of the
  mini-batch's share per GPU below it where that share is smaller
  (:func:`per_device_micro_batch_size`; ``workload=tiny`` on 4 devices: 1, one sample per GPU):
  the mini-batch is raised only where one sample per GPU forces it, so wherever it can DeepSpeed-Chat
  solves the same optimisation problem as the other systems (the same mini-batches; the micro-batch
  split changes only float summation order). DeepSpeed-Chat's defaults use the same per-device batch
  for generation and training (``per_device_generation_batch_size`` =
  ``per_device_training_batch_size``, one generation round per training batch), so
  ``generation_batch_size: null`` is the mini-batch (256 on the paper's testbed). Either can be
  set (``system.mini_batch_size=...``); set values are checked (a mini-batch must be a multiple
  of N), not adjusted.

Modelled rather than executed here: ZeRO-3's per-layer gathers and reduce-scatters are costed by
the simulator as collectives overlapped with compute (prefetching); the host cost of the eager
loop and the other engine mechanisms are the engine's (docs/VALIDATION.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.core.config import SystemConfig, WorkloadConfig
from harness.errors import ConfigError, PlanError
from harness.core.plan import Allocation, GenerationPolicy, ParallelStrategy, Plan
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.strategies import largest_tp
from harness.planning.workflow import check_layout_fits, full_mesh
from harness.system import PlanContext, System, register_system_config


@dataclass
class DeepSpeedChatConfig(SystemConfig):
    name: str = "deepspeed_chat"
    impl: str = "baselines.deepspeed_chat.DeepSpeedChat"
    # Samples per gradient step; None = derived_mini_batch_size (256 on the RLHFuse testbed, which is
    # what RLHFuse section 7 had to raise it to).
    mini_batch_size: Optional[int] = None
    # Prompts generated per round across the cluster; None = the mini-batch.
    generation_batch_size: Optional[int] = None
    gen_tp: int = 0  # hybrid-engine inference_tp_size; 0 = the largest tp in a node that shards the actor's heads
    zero_stage: int = 3
    # --actor_zero_stage / --critic_zero_stage (None: zero_stage). The reference model follows the
    # actor's stage and the reward model the critic's, as DeepSpeed-Chat initialises them (rlhf_engine.py).
    actor_zero_stage: Optional[int] = None
    critic_zero_stage: Optional[int] = None
    offload_reference_model: bool = False  # --offload_reference_model: ref weights in host memory
    # How its reference implementation runs the work (harness/core/engines.py, conf/engine/): the hybrid
    # engine (static rounds, eager fused kernels, synced under ZeRO-3, padded) and DeepSpeed ZeRO.
    generation_engine: str = "ds_hybrid"
    training_engine: str = "deepspeed"


def derived_mini_batch_size(num_devices: int, workload: WorkloadConfig) -> int:
    """DeepSpeed-Chat's mini-batch when ``system.mini_batch_size`` is not set: the smallest multiple
    of ``num_devices`` (at least one sample per GPU of the ZeRO-3 data parallelism per micro-step,
    DeepSpeed-Chat's minimum) that is at least ``workload.mini_batch_size`` and divides
    ``workload.global_batch_size``. RLHFuse testbed (256 GPUs, mini-batch 64, batch 512): 256, as
    RLHFuse section 7 ran it; one 8-GPU node: 64; ``workload=tiny`` (mini-batch 4, batch 8) on 1, 2
    or 4 devices: 4, the workload's own; on 8 devices: 8."""
    n, gbs = num_devices, workload.global_batch_size
    if gbs % n:
        raise PlanError(f"deepspeed_chat trains with ZeRO-3 data parallelism over all {n} devices, at least one "
                        f"sample per device per step: workload.global_batch_size={gbs} must be a multiple of {n}")
    mini = n * max(1, -(-workload.mini_batch_size // n))
    while gbs % mini:
        mini += n
    return mini


def per_device_micro_batch_size(mini_batch_size: int, num_devices: int, workload: WorkloadConfig) -> int:
    """DeepSpeed-Chat's ``per_device_training_batch_size`` for a mini-batch of ``mini_batch_size``
    samples over ``num_devices`` ZeRO-3 data-parallel GPUs: the workload's micro-batch when it
    divides each GPU's share of the mini-batch, else the largest divisor of that share below it
    (the mini-batch is then per-device micro-batch x devices x gradient-accumulation steps, as
    DeepSpeed requires). ``workload=tiny`` (micro-batch 2, mini-batch 4): 2 on 1 or 2 devices, 1 on
    4."""
    share = mini_batch_size // num_devices
    return max(d for d in range(1, min(workload.micro_batch_size, share) + 1) if share % d == 0)


class DeepSpeedChat(System):
    cfg: DeepSpeedChatConfig

    def batch_sizes(self, ctx: PlanContext) -> tuple[int, int]:
        """(mini-batch, generation batch): the configured values, or those derived from the cluster
        and the workload (see the module docstring)."""
        cfg, gbs = self.cfg, ctx.workload.global_batch_size
        for key in ("mini_batch_size", "generation_batch_size"):
            value = getattr(cfg, key)
            if value is not None and value < 1:
                raise ConfigError(f"system.{key}={value} must be a positive number of samples")
        mini = cfg.mini_batch_size if cfg.mini_batch_size is not None else derived_mini_batch_size(ctx.num_devices,
                                                                                                   ctx.workload)
        if mini > gbs:
            raise PlanError(f"system.mini_batch_size={mini} is larger than the global batch "
                            f"workload.global_batch_size={gbs}")
        if gbs % mini:
            raise PlanError(f"system.mini_batch_size={mini} must divide the global batch {gbs}")
        if mini % ctx.num_devices:
            raise PlanError(f"system.mini_batch_size={mini} must be a multiple of the {ctx.num_devices} devices: "
                            f"deepspeed_chat trains with ZeRO-3 data parallelism (dp={ctx.num_devices}) over all of "
                            f"them, at least one sample per device per step")
        gen = cfg.generation_batch_size if cfg.generation_batch_size is not None else mini
        if gen > gbs:
            raise PlanError(f"system.generation_batch_size={gen} is larger than the global batch "
                            f"workload.global_batch_size={gbs}")
        return mini, gen

    def plan(self, ctx: PlanContext) -> Plan:
        cfg, n = self.cfg, ctx.num_devices
        per_node = ctx.cluster.gpus_per_node
        # 0: the largest tp inside a node that shards the actor's heads (a whole node for LLaMA 7B-65B
        # except 33B's 52 heads: 4)
        gen_tp = cfg.gen_tp or largest_tp(per_node, [ctx.models.actor], n)
        mesh = full_mesh(n)
        gbs = ctx.workload.global_batch_size
        mini_batch_size, generation_batch_size = self.batch_sizes(ctx)
        micro_batch_size = per_device_micro_batch_size(mini_batch_size, n, ctx.workload)
        stages = {role: cfg.zero_stage if own is None else own
                  for role, own in (("actor", cfg.actor_zero_stage), ("critic", cfg.critic_zero_stage))}
        for role, stage in stages.items():
            if stage not in (0, 1, 2, 3):
                raise ConfigError(f"system.{role}_zero_stage / system.zero_stage: ZeRO stage {stage} is not 0-3")
        if gen_tp < 1 or per_node % gen_tp or n % gen_tp:
            raise PlanError(f"deepspeed_chat generation (system.gen_tp): tp={gen_tp} must divide the {per_node} "
                            f"GPUs of a node (the hybrid engine's tensor parallelism stays on NVLink)")
        actor_alloc = Allocation(mesh, ParallelStrategy(dp=n, tp=1, pp=1, zero_stage=stages["actor"]))
        critic_alloc = Allocation(mesh, ParallelStrategy(dp=n, tp=1, pp=1, zero_stage=stages["critic"]))
        allocs = {"ref": actor_alloc, "update_actor": actor_alloc,
                  "reward": critic_alloc, "values": critic_alloc, "update_critic": critic_alloc}
        in_place = ctx.engines is not None and ctx.engines.generation.weights == "training_layout"
        if in_place:  # hybrid engine disabled: HF generate() on the ZeRO module, each GPU its own batch
            gen_tp = 1
            allocs["gen"] = actor_alloc
        else:  # the hybrid engine gathers ZeRO-3 shards into this layout
            gen = ParallelStrategy(dp=n // gen_tp, tp=gen_tp, pp=1)
            check_layout_fits(gen, n, per_node, ctx.models.actor.num_layers,
                              "deepspeed_chat generation (system.gen_tp)")
            allocs["gen"] = Allocation(mesh, gen)
        num_instances = n // gen_tp
        if generation_batch_size % num_instances:
            raise PlanError(f"system.generation_batch_size={generation_batch_size} must be a multiple of the "
                            f"{num_instances} generation instances (N / gen_tp)")
        # batching, kernels, syncing and padding come from the generation engine (the assembler)
        policy = GenerationPolicy(batching="static", max_batch_size=generation_batch_size // num_instances)
        return assemble_ppo_plan(
            ctx, cfg.name, allocs, policy, mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size,
            offloaded=("ref",) if cfg.offload_reference_model and ctx.algorithm.has_reference else (),
            notes={"hybrid_engine_tp": gen_tp, "generation_rounds": gbs // generation_batch_size,
                   "zero_stage": cfg.zero_stage, "actor_zero_stage": stages["actor"],
                   # the critic's stage, which the reward model follows: absent when neither runs
                   **({"critic_zero_stage": stages["critic"]}
                      if {"critic", "reward"} & set(ctx.roles) else {})})


register_system_config("deepspeed_chat", DeepSpeedChatConfig)
