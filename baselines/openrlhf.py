"""OpenRLHF's Ray placement (Hu et al., "OpenRLHF: An Easy-to-use, Scalable and High-performance RLHF
Framework", arXiv 2405.11143) as a plan: ``+system=openrlhf``.

What the original does: each of the four models is a group of Ray actors on its own GPUs (Ray
placement groups): ``--ref_num_gpus_per_node``, ``--reward_num_gpus_per_node``,
``--actor_num_gpus_per_node`` and ``--critic_num_gpus_per_node``, plus, with vLLM,
``--vllm_num_engines`` engines of ``--vllm_tensor_parallel_size`` GPUs each. Every model is a
DeepSpeed engine, data-parallel over its GPUs (``--zero_stage``). The actor's ranks generate (on the
vLLM engines, or with Hugging Face ``generate`` on the actor's own GPUs without them), send the
samples to the ref, reward and critic groups, which compute their forward passes concurrently
(``RemoteExperienceMaker.make_experience``: ``.remote`` calls, then one ``ray.get``), then actor and
critic train at the same time on their own GPUs; with vLLM, the actor's rank 0 then broadcasts the
new weights to every engine (``_broadcast_to_vllm``). OpenRLHF's benchmark (``benchmark/README.md``
on branch ``wuxibin/benchmark``, commit dbdd43b0, 8 A800-80GB; the replay points P040, P041, P043,
P044 of ``../shared/published``) ran LLaMA-2 7B and 13B with the GPU split
``ref:reward:actor:critic:vLLM = 1:1:2:2:2`` ("ray+vllm") and ``1:1:4:2`` ("ray", no vLLM).

What we reproduce, as plan data:

- **Pools** (``system.split``): integer units per role, in the order ref, reward, actor, critic,
  gen (vLLM), scaled to the cluster: with T units in all, a unit is N / T devices, so the default
  1:1:2:2:2 is 1, 1, 2, 2, 2 GPUs on one 8-GPU node and 32, 32, 64, 64, 64 on 256. The pools are
  contiguous device ranges in that order, disjoint and together covering the cluster. Units that
  do not divide the cluster (T not dividing N) and empty pools are refused, naming
  ``system.split``; ``gen: 0`` means no vLLM (the "ray" rows).
- **Parallelism**: ref on the ref pool, reward on the reward pool, ``values`` (the critic's forward)
  and ``update_critic`` on the critic pool, ``update_actor`` on the actor pool, each purely
  data-parallel over its pool (tp = pp = 1), as DeepSpeed runs them. Actor and critic train with
  ``system.zero_stage`` (default 2: ``--zero_stage``'s default in ``examples/train_ppo_ray.py`` at
  dbdd43b0, and the 7B and 13B example scripts' ``--zero_stage 2``, ``examples/scripts/
  train_ppo_llama_ray.sh`` and ``train_ppo_llama_ray_slurm.sh`` until 2024-07); ref and
  reward run DeepSpeed inference engines with ZeRO-3 only when training uses ZeRO-3, else none
  (``DeepspeedStrategy.get_ds_eval_config``: ``stage=self.stage if self.stage == 3 else 0``),
  which ``system.inference_zero_stage: null`` reproduces (set a number to override).
- **Generation with vLLM** (``gen > 0``): the gen pool holds ``pool / system.vllm_tp`` vLLM
  engines of ``system.vllm_tp`` GPUs each (an engine stays inside a node), CUDA-graph decoding
  (vLLM's default, ``enforce_eager=False``) and continuous batching. The actor's weights reach the
  engines by a ``param_sync`` task every iteration (the broadcast after each actor update; the
  engines hold their own copy, resident all iteration), as ``+system=disaggregated`` does.
- **Generation without vLLM** (``gen: 0``): the actor generates on its own pool, in its training
  layout, with Hugging Face ``generate`` on its DeepSpeed module (eager: every kernel issued from
  Python, no CUDA graphs), each GPU in static rounds of ``system.generation_batch_size`` prompts
  (OpenRLHF's ``--micro_rollout_batch_size``, the benchmark's "gen mbs"), padded to the round's
  longest sequence for the later passes (``generate`` returns one padded tensor). ``gen`` has
  ``update_actor``'s allocation, so the plan assembler emits no weight movement: under ZeRO-1/2 the
  ranks hold full weights; under ZeRO-3 the shards are gathered layer by layer at every decode step
  (the generation engine's cost, ``harness/core/engines.py``) and rounds are synced
  (``generate(synced_gpus=True)``). ZeRO-3 without vLLM is a modelling extension: OpenRLHF v0.2
  refused it (``assert args.zero_stage != 3 or args.vllm_num_engines > 0`` in
  ``examples/train_ppo_ray.py``).
- **Engines** (``harness/core/engines.py``, ``conf/engine/``): ``system.generation_engine`` is ``vllm``
  with a gen pool and ``hf_generate_fa2`` (HF generate with flash-attention 2: OpenRLHF's scripts pass
  ``--flash_attn``) with ``gen: 0`` (derived from the split in the YAML; a run's
  ``engine.generation=...`` overrides it, and an engine that contradicts the split is refused);
  ``system.training_engine`` is ``deepspeed`` (ZeRO data parallelism; ``engine.training=
  deepspeed_offload`` adds the example scripts' ``--adam_offload``). Where the run carries engines,
  the generation engine sets the policy's batching, kernels, syncing and padding; the policies this
  module builds are the same facts, used when it does not.
- **Batches**: ``system.mini_batch_size`` (OpenRLHF's ``--train_batch_size``, samples per optimizer
  step across the data-parallel ranks; null = ``workload.mini_batch_size``) and
  ``system.micro_batch_size`` (``--micro_train_batch_size``, per GPU; null =
  ``workload.micro_batch_size``). DeepSpeed requires ``train_batch_size = micro_batch x dp x
  gradient_accumulation_steps``, and the actor and critic pools may differ in dp, so the mini-batch
  must be a multiple of micro-batch x dp of both; otherwise the plan is refused, naming the keys.
- **Concurrency**: ref, reward and values read only the responses and run on disjoint pools, so
  the scheduler runs them at the same time; so do ``update_actor`` and ``update_critic``
  (OpenRLHF trains both at once on their own GPUs). ``plan.notes["pools/<role>"]`` gives each
  pool's devices.

Not modelled: OpenRLHF's interleaving of generation and ref/reward/critic passes per
micro-rollout batch (each actor rank generates ``--micro_rollout_batch_size`` prompts, then waits for
their forward passes, then generates the next; here generation of the whole batch comes first);
in v0.2 each actor rank sends its micro-rollout batch to one engine (round robin) and waits for all
of it, so an engine decodes in bursts rather than continuously (here it batches continuously, up to
``system.vllm_max_num_seqs`` sequences; null = what the actor ranks send it at a time, the
micro-rollout batch times the actor ranks per engine); the actor's own log-prob pass over the
generated samples (the harness's ``gen`` writes ``old_logprobs``); the ``--colocate_*`` options that
share pools between roles; ``--ref_reward_offload``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import OmegaConf

from harness.core.config import SystemConfig
from harness.errors import ConfigError, PlanError, PlanMemoryError
from harness.core.option_effects import Condition, effective_when
from harness.core.plan import Allocation, GenerationPolicy, MovementKind, ParallelStrategy, Plan
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.memory import check_plan_memory
from harness.system import PlanContext, System, register_system_config

# Pool order on the devices, as OpenRLHF writes its split: "ref:reward:actor:critic:vLLM".
ROLES = ("ref", "reward", "actor", "critic", "gen")


@dataclass
class Split:
    """Integer units of devices per pool (``system.split``); a unit is N / (sum of units) devices."""

    ref: int = 1
    reward: int = 1
    actor: int = 2
    critic: int = 2
    gen: int = 2  # vLLM engines' pool; 0 = no vLLM, the actor generates on its own pool


# Options of the vLLM engines: set without a vLLM pool they are refused (harness/core/option_effects.py).
VLLM_ONLY = effective_when(Condition("system.split.gen", "!=", 0, says="system.split.gen > 0"),
                           why="vLLM engines run on the gen pool; without one the actor generates in place")


@dataclass
class OpenRLHFConfig(SystemConfig):
    name: str = "openrlhf"
    impl: str = "baselines.openrlhf.OpenRLHF"
    split: Split = field(default_factory=Split)  # ref:reward:actor:critic:vLLM = 1:1:2:2:2 (benchmark, ray+vllm)
    vllm_tp: int = field(default=1, metadata=VLLM_ONLY)  # --vllm_tensor_parallel_size: GPUs per vLLM engine
    # Continuous-batching slots per vLLM engine; None = what OpenRLHF v0.2's actor ranks send one
    # engine at a time (generation_batch_size x actor ranks per engine).
    vllm_max_num_seqs: Optional[int] = field(default=None, metadata=VLLM_ONLY)
    zero_stage: int = 2  # --zero_stage for actor and critic (train_ppo_ray.py's default; the example scripts' 2)
    inference_zero_stage: Optional[int] = None  # ref/reward; None = 3 if zero_stage == 3 else 0 (OpenRLHF's rule)
    mini_batch_size: Optional[int] = None  # --train_batch_size; None = workload.mini_batch_size
    micro_batch_size: Optional[int] = None  # --micro_train_batch_size (per GPU); None = workload.micro_batch_size
    generation_batch_size: int = 16  # --micro_rollout_batch_size (per actor rank; the benchmark's 7B "gen mbs")
    # Execution engines (harness/core/engines.py, conf/engine/): vLLM, or with system.split.gen=0 Hugging Face
    # generate with flash-attention 2 on the actor (the YAML derives it from the split); DeepSpeed ZeRO
    # for every model.
    generation_engine: str = "vllm"
    training_engine: str = "deepspeed"


def generation_engine_for(gen_units) -> str:
    """``system.generation_engine``'s default (the resolver ``openrlhf_generation_engine`` in
    conf/system/openrlhf.yaml): vLLM when the split gives it a pool, else HF ``generate``."""
    return "vllm" if int(gen_units) > 0 else "hf_generate_fa2"


OmegaConf.register_new_resolver("openrlhf_generation_engine", generation_engine_for, replace=True)


def split_pools(split: Split, num_devices: int, roles: tuple[str, ...] = ("actor", "critic", "ref", "reward")
                ) -> dict[str, tuple[int, ...]]:
    """Each role's devices: contiguous ranges in :data:`ROLES` order, ``units x N / T`` devices each
    (T = total units); ``gen`` is absent when its units are 0. Refuses splits that do not fit, and a
    pool for a model the algorithm does not run (``roles``: those it runs)."""
    units = {role: getattr(split, role) for role in ROLES}
    text = ":".join(str(units[r]) for r in ROLES)
    bad = {r: u for r, u in units.items() if not isinstance(u, int) or u < 0}
    if bad:
        raise ConfigError(f"system.split={text} (ref:reward:actor:critic:gen): units must be non-negative "
                          f"integers, got {bad}")
    empty = [r for r in ROLES[:-1] if units[r] == 0 and r in roles]
    if empty:
        raise PlanError(f"system.split={text} (ref:reward:actor:critic:gen): the {', '.join(empty)} pool would be "
                        f"empty; every model needs at least one unit (only gen may be 0: no vLLM)")
    unused = [r for r in ROLES[:-1] if units[r] > 0 and r not in roles]
    if unused:
        raise PlanError(f"system.split={text} (ref:reward:actor:critic:gen) gives GPUs to the {', '.join(unused)} "
                        f"model, which this algorithm does not run; give it none: "
                        + " ".join(f"system.split.{r}=0" for r in unused))
    total = sum(units.values())
    if num_devices % total:
        raise PlanError(f"system.split={text} (ref:reward:actor:critic:gen) has {total} units, which do not divide "
                        f"the cluster's {num_devices} devices: each unit must be a whole number of devices")
    per_unit, start, pools = num_devices // total, 0, {}
    for role in ROLES:
        size = units[role] * per_unit
        if size:
            pools[role] = tuple(range(start, start + size))
        start += size
    return pools


def device_range(mesh: tuple[int, ...]) -> str:
    return f"{mesh[0]}..{mesh[-1]} ({len(mesh)} device{'s' if len(mesh) > 1 else ''})"


class OpenRLHF(System):
    cfg: OpenRLHFConfig

    def batch_sizes(self, ctx: PlanContext, pools: dict[str, tuple[int, ...]]) -> tuple[int, int]:
        """(mini-batch, per-GPU micro-batch), checked against DeepSpeed's rule on both training pools."""
        cfg, w = self.cfg, ctx.workload
        for key in ("mini_batch_size", "micro_batch_size", "generation_batch_size"):
            value = getattr(cfg, key)
            if value is not None and value < 1:
                raise ConfigError(f"system.{key}={value} must be a positive number of samples")
        mini = w.mini_batch_size if cfg.mini_batch_size is None else cfg.mini_batch_size
        micro = w.micro_batch_size if cfg.micro_batch_size is None else cfg.micro_batch_size
        gbs = w.global_batch_size
        if mini > gbs or gbs % mini:
            raise PlanError(f"system.mini_batch_size={mini} (--train_batch_size) must divide the global batch "
                            f"workload.global_batch_size={gbs}")
        for role in ("actor", "critic")[:1 + ctx.algorithm.has_critic]:
            dp = len(pools[role])
            if mini % (micro * dp):
                raise PlanError(f"system.mini_batch_size={mini} (--train_batch_size) must be a multiple of "
                                f"system.micro_batch_size={micro} x the {role} pool's dp={dp} = {micro * dp} "
                                f"(DeepSpeed: train_batch_size = micro_batch x dp x gradient accumulation steps; "
                                f"pool sizes come from system.split)")
        return mini, micro

    def generation(self, ctx: PlanContext, pools: dict[str, tuple[int, ...]],
                   actor: Allocation) -> tuple[Allocation, GenerationPolicy]:
        """The generate task's allocation and policy. With engines (``ctx.engines``) the generation
        engine sets the policy's batching, kernels, syncing and padding (the assembler); the policy
        here is what OpenRLHF's own engines do, used as is when the context carries none."""
        cfg = self.cfg
        engines = getattr(ctx, "engines", None)
        engine = engines.generation if engines is not None else None
        if "gen" not in pools:  # no vLLM: HF generate on the actor's DeepSpeed module, in place
            if engine is not None and engine.weights != "training_layout":
                raise PlanError(f"system.split.gen=0 means no vLLM pool: OpenRLHF then generates with Hugging Face "
                                f"generate on the actor's GPUs, in its training layout, but this run's generation "
                                f"engine {engine.name} generates from its own copy of the weights; run it with "
                                f"system.generation_engine=hf_generate_fa2 (the default when system.split.gen=0)")
            policy = GenerationPolicy(batching="static", max_batch_size=cfg.generation_batch_size,
                                      synced_instances=cfg.zero_stage == 3, pad_to_longest=True)
            return actor, policy
        if engine is not None and engine.weights == "training_layout":
            raise PlanError(f"system.split.gen={cfg.split.gen} gives vLLM engines a pool of their own, but this run's "
                            f"generation engine {engine.name} generates on the actor's module in place; use "
                            f"system.split.gen=0 for that (OpenRLHF without vLLM) or system.generation_engine=vllm")
        mesh, tp, per_node = pools["gen"], cfg.vllm_tp, ctx.cluster.gpus_per_node
        if tp < 1 or per_node % tp or len(mesh) % tp:
            raise PlanError(f"system.vllm_tp={tp}: GPUs per vLLM engine must divide the gen pool's {len(mesh)} devices "
                            f"(system.split) and the {per_node} GPUs of a node")
        # The gen pool is the last len(mesh) devices and tp divides both len(mesh) and a node's GPUs,
        # so every engine's tp group starts on a multiple of tp and stays inside one node.
        num_engines = len(mesh) // tp
        slots = cfg.vllm_max_num_seqs
        if slots is None:  # actor ranks send their micro-rollout batches round robin, one engine each
            slots = cfg.generation_batch_size * -(-len(pools["actor"]) // num_engines)
        elif slots < 1:
            raise ConfigError(f"system.vllm_max_num_seqs={slots} must be a positive number of sequences")
        policy = GenerationPolicy(batching="continuous", max_batch_size=slots)
        return Allocation(mesh, ParallelStrategy(dp=num_engines, tp=tp)), policy

    def plan(self, ctx: PlanContext) -> Plan:
        """The placement of ``system.*``. OpenRLHF runs the layout it is given (out of memory if it
        does not fit), so a layout that does not fit in device memory is refused (by the runner's
        memory check), and where some of its options make it fit, here, naming the fewest of them
        (:meth:`fitting_overrides`)."""
        plan = self._assemble(ctx)
        try:
            check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
        except PlanMemoryError as e:
            fix = self.fitting_overrides(ctx)
            if fix is not None:
                raise PlanMemoryError(f"{e} With OpenRLHF's own options, {' '.join(fix)} makes it fit.") from None
        return plan

    def fitting_overrides(self, ctx: PlanContext) -> list[str] | None:
        """The overrides of ``system.vllm_tp`` (GPUs per vLLM engine, dividing a node's GPUs; only
        with a vLLM pool) and ``system.zero_stage`` (3: actor and critic sharded, and ref and reward
        with them) that give a plan that is valid and fits in device memory: the fewest changes,
        then the fewest GPUs per engine; None if none does."""
        from harness.planning.strategies import check_tensor_parallel
        from harness.errors import HarnessError

        cfg = self.cfg
        per_node = ctx.cluster.gpus_per_node
        tps = [cfg.vllm_tp] + ([tp for tp in range(1, per_node + 1) if per_node % tp == 0 and tp != cfg.vllm_tp]
                               if cfg.split.gen > 0 else [])
        zeros = [cfg.zero_stage] + ([3] if cfg.zero_stage != 3 else [])
        candidates = sorted(((tp, zero) for tp in tps for zero in zeros),
                            key=lambda c: ((c[0] != cfg.vllm_tp) + (c[1] != cfg.zero_stage), c[0], c[1]))
        for tp, zero in candidates[1:]:  # the first is the configuration that did not fit
            alternative = OpenRLHF(dataclasses.replace(cfg, vllm_tp=tp, zero_stage=zero))
            try:
                plan = alternative._assemble(ctx)
                plan.validate(ctx.num_devices)
                check_tensor_parallel(plan, ctx.models)
                check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
            except HarnessError:
                continue
            return ([f"system.vllm_tp={tp}"] if tp != cfg.vllm_tp else []) + \
                ([f"system.zero_stage={zero}"] if zero != cfg.zero_stage else [])
        return None

    def _assemble(self, ctx: PlanContext) -> Plan:
        cfg = self.cfg
        for key in ("zero_stage", "inference_zero_stage"):
            value = getattr(cfg, key)
            if value is not None and value not in (0, 1, 2, 3):
                raise ConfigError(f"system.{key}={value}: DeepSpeed ZeRO stages are 0, 1, 2 and 3")
        pools = split_pools(cfg.split, ctx.num_devices, ctx.roles)
        mini, micro = self.batch_sizes(ctx, pools)
        inference_zero = cfg.inference_zero_stage
        if inference_zero is None:
            inference_zero = 3 if cfg.zero_stage == 3 else 0

        def data_parallel(role: str, zero: int) -> Allocation:
            return Allocation(pools[role], ParallelStrategy(dp=len(pools[role]), zero_stage=zero))

        actor = data_parallel("actor", cfg.zero_stage)
        gen, policy = self.generation(ctx, pools, actor)
        allocs = {"gen": gen, "update_actor": actor}
        if "critic" in pools:
            allocs["values"] = allocs["update_critic"] = data_parallel("critic", cfg.zero_stage)
        allocs.update({role: data_parallel(role, inference_zero) for role in ("ref", "reward") if role in pools})
        vllm = "gen" in pools
        notes = {f"pools/{role}": device_range(mesh) for role, mesh in pools.items()}
        generation = (f"vLLM: {gen.strategy.dp} engine(s) of tp={gen.strategy.tp}, {policy.max_batch_size} "
                      f"sequences each" if vllm else
                      f"HF generate on the actor pool, {policy.max_batch_size} prompts per GPU per round")
        notes.update({"split": ":".join(str(getattr(cfg.split, r)) for r in ROLES), "generation": generation,
                      "zero_stage": cfg.zero_stage, "inference_zero_stage": inference_zero,
                      "micro_batch_size": micro})
        return assemble_ppo_plan(ctx, cfg.name, allocs, policy, mini_batch_size=mini, micro_batch_size=micro,
                                 actor_sync=MovementKind.PARAM_SYNC if vllm else MovementKind.REALLOC, notes=notes)


register_system_config("openrlhf", OpenRLHFConfig)
