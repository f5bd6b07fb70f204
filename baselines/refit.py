"""Time-sliced colocation with a weight refit into the generation engine: the plan shared by
``+system=verl`` (baselines/verl.py) and ``+system=nemo_rl`` (baselines/nemo_rl.py).

What both frameworks do in their default (colocated, on-policy) mode, as plan data:

- **One pool, stages in turn.** Every model lives on every GPU; generation, then the log-prob
  passes, then (PPO) reward and critic inference, then training run one after another on all of
  them (verl: HybridFlow, Sheng et al., EuroSys'25, arXiv 2409.19256, section 5's colocated
  placement of the actor, rollout and reference in one worker group; NeMo-RL: its colocated GRPO,
  ``policy.generation.colocated.enabled``).
- **Training in the training engine's layout**: with a ZeRO-style engine (FSDP: verl's default
  actor strategy, NeMo-RL's DTensor policy) parameters, gradients and optimizer states are sharded
  over all N GPUs (dp = N, ZeRO-3), each GPU training its share of a mini-batch in micro-batches
  of at most ``workload.micro_batch_size`` (the largest that divides the share); with
  Megatron-core, a (dp, tp, pp) layout pinned by ``system.train_layout`` or searched, its ranks in
  Megatron-core's order (tensor-parallel fastest, the pipeline outermost:
  :meth:`~harness.core.plan.Allocation.pipeline_outermost`), so a stage's replicas, their
  gradient all-reduce and a MoE model's expert-parallel groups sit side by side. The reference
  model, the reward model and the critic (PPO) use the same layout.
- **Generation in vLLM's own layout**: ``N / tp`` engines of ``system.rollout_tp`` GPUs each
  (searched when 0: the fastest whole iteration among the tensor-parallel degrees that fit a node
  and shard the actor's heads; when no engine of at most a node fits, among engines over 2, 4, ...
  whole nodes, as NeMo-RL runs DeepSeek-V3 on vLLM engines of 32 or 64 GPUs, their tensor-parallel
  all-reduces then crossing the NICs), continuous batching of up to ``system.max_num_seqs``
  sequences, CUDA graphs (the ``vllm`` generation engine).
- **Refit**: after each actor update the new weights are gathered from the training layout and
  loaded into the generation layout on the same GPUs (verl's sharding manager, its
  "3D-HybridEngine", section 5.3; NeMo-RL's refit through CUDA IPC handles): a weight movement every
  iteration (``realloc_actor_gen``), layouts alike or not, timed as the actor's bytes resharded
  between the two layouts plus the generation engine's reload (vLLM's ``refit: reload``: the
  training states put in host memory, vLLM's weights and KV cache woken, every parameter gathered,
  converted and loaded; fitted fixed seconds plus seconds per GB of the model's weights,
  :meth:`harness.costmodel.engines.EngineCosts.refit_reload_s`). The copy in the generation layout
  is not kept resident: it is freed after generation, as the frameworks release vLLM's weights and
  KV cache while training runs (verl's and NeMo-RL's sleep of the inference engine), so generation
  and training each have the GPUs' memory.
- **Training states in host memory while generating** (the ``offload_for_generation`` knob,
  colocated only): NeMo-RL's colocated policy moves its optimizer states and then its weights to
  host memory around the refit (``offload_before_refit``, ``offload_after_refit``) and keeps the
  reference model's weights in host memory, swapping them in for the reference pass. As plan
  data the actor and the reference model are ``offloaded``: generation's memory holds neither,
  each pass copies its model's weights in over PCIe first, and training copies the actor's
  states in and back out.
- **Log-probs recomputed by the training engine**: after generation the behaviour policy's
  log-probs come from a forward pass of the actor in its training layout (task ``logprobs``: verl's
  ``compute_log_prob``, NeMo-RL's "get logprobs"), not from vLLM, whose numbers differ; the
  reference model's follow on the same devices.

What is modelled only through the fitted reload: the seconds of waking and sleeping vLLM around
generation (reallocating the KV cache, reloading weights), which the frameworks' published step
times include (../shared/published/README.md: verl's "gen" covers waking vLLM and loading weights);
the reload's constants are fitted on NeMo-RL's published refit seconds and shared by verl's refit,
whose own are not published. A broadcast to generation GPUs of their own (``param_sync``) is timed
as its bytes alone: NCCL's path converts the weights too, but no measurement of it exists. Sequence
packing (NeMo-RL's default) is the workload's ``workload.micro_batch_tokens``
(:mod:`harness.planning.packing`); unset, micro-batches are ``workload.micro_batch_size`` samples.

Off-policy: with generation GPUs of their own and ``max_staleness`` set, the plan is off-policy
(``Plan.off_policy``): each iteration's generation runs on weights up to that many versions old,
beside the training of the iterations before it, and the weights are broadcast to the engines
once they have finished generating (verl's ``one_step_off_policy`` recipe, NeMo-RL's asynchronous
GRPO; :mod:`harness.planning.iterations`). Fully asynchronous rollout, with generation interrupted
by new weights, is not this plan.
"""
from __future__ import annotations

from typing import Optional

from harness.core.plan import (Allocation, GenerationPolicy, LengthDispatch, MovementKind, OffPolicyPolicy,
                               ParallelStrategy, Plan, TaskKind)
from harness.errors import ConfigError, PlanError
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.estimate import simulated_makespan_s
from harness.planning.strategies import candidate_strategies, divisors, parse_layout, search, tp_splits_heads
from harness.planning.workflow import check_layout_fits
from harness.system import PlanContext, System

# every task but generation runs in the training layout (the logprobs task too: the assembler gives
# it update_actor's)
TRAINING_LAYOUT_TASKS = ("ref", "reward", "values", "update_actor", "update_critic")


def refit_plan(ctx: PlanContext, system: str, *, rollout_tp: int, max_num_seqs: int,
               train_layout: Optional[str], zero_stage: int, generation_nodes: int = 0,
               generation_gpus: int = 0, off_policy: Optional[OffPolicyPolicy] = None,
               offload_for_generation: bool = False, stream_inference: bool = False,
               dispatch: Optional[LengthDispatch] = None, gpu_memory_utilization: Optional[float] = None,
               keys: dict[str, str]) -> Plan:
    """The plan of the module docstring for ``system``. ``generation_nodes`` > 0 gives generation
    that many nodes of its own (the last ones) and the training engine the rest, the new weights
    then broadcast to the generation engines each iteration (``param_sync``) instead of refit on
    the same GPUs. With ``offload_for_generation`` (colocated only) the policy's training states and
    the reference model's weights wait in host memory while vLLM generates (``Plan.offloaded``).
    ``generation_gpus`` > 0 does the same with that many GPUs (the last ones; verl's one-step-off
    recipe gives 4 of 16 GPUs to rollout). ``off_policy`` (not None) makes the plan off-policy
    (``Plan.off_policy``): each iteration's generation may run on weights up to ``max_staleness``
    versions old, overlapping training (:mod:`harness.planning.iterations`,
    :mod:`harness.planning.rollout`); it needs generation GPUs of its own when above 0, except for
    partial rollout, whose iterations do not overlap (:mod:`harness.planning.partial`).
    ``stream_inference``: finished samples stream into the inference tasks that read them
    (:func:`~harness.planning.assembler.assemble_ppo_plan`); ``dispatch``: the vLLM engines take
    samples by predicted length (``GenerationPolicy.dispatch``); ``gpu_memory_utilization``: the
    share of each GPU vLLM takes for its weights and KV cache (``GenerationPolicy.memory_frac``; None:
    what the plan leaves free). ``keys`` names the system's option of each knob (``rollout_tp``,
    ``train_layout``, ``generation_nodes`` or ``generation_gpus``, ``max_staleness``) for errors and hints."""
    n, per_node = ctx.num_devices, ctx.cluster.gpus_per_node
    parallelism = ctx.engines.training.parallelism if ctx.engines is not None else "zero"
    micro_batch_size = ctx.workload.micro_batch_size
    if generation_nodes and generation_gpus:
        raise ConfigError(f"{keys['generation_nodes']}={generation_nodes} and {keys['generation_gpus']}="
                          f"{generation_gpus} both size the generation pool; set one")
    if not 0 <= generation_nodes < ctx.cluster.num_nodes:
        raise ConfigError(f"{keys['generation_nodes']}={generation_nodes}: generation needs 0 (colocated) up "
                          f"to {ctx.cluster.num_nodes - 1} of the {ctx.cluster.num_nodes} nodes, training the rest")
    if not 0 <= generation_gpus < n:
        raise ConfigError(f"{keys['generation_gpus']}={generation_gpus}: generation needs 0 (colocated) up "
                          f"to {n - 1} of the {n} GPUs, training the rest")
    num_gen_gpus = generation_gpus or generation_nodes * per_node
    if off_policy is not None and off_policy.rollout != "partial" and off_policy.max_staleness > 0 and not num_gen_gpus:
        raise ConfigError(f"{keys['max_staleness']}={off_policy.max_staleness}: generation runs ahead of training only "
                          f"on GPUs of its own; set {keys['generation_gpus']} (or {keys['generation_nodes']})")
    split = n - num_gen_gpus
    train_mesh = tuple(range(split))
    gen_mesh = tuple(range(split, n)) if num_gen_gpus else train_mesh
    actor = ctx.model("actor")
    num_layers = min(ctx.model(role).num_layers for role in ctx.roles)

    if parallelism == "zero":  # FSDP / ZeRO-3 over every training GPU
        if train_layout:
            raise ConfigError(f"{keys['train_layout']}={train_layout} pins a Megatron layout, but the training "
                              f"engine shards over every GPU (dp={len(train_mesh)}, ZeRO-3); drop it or set "
                              f"engine.training=megatron")
        dp, w, g = len(train_mesh), ctx.workload, ctx.algorithm.group_size
        if w.mini_batch_size % dp:
            # the fewest prompts per mini-batch that give every GPU a whole share and divide the batch
            fits = [p for p in range(w.mini_batch_size // g, w.global_batch_size // g + 1)
                    if (w.global_batch_size // g) % p == 0 and (p * g) % dp == 0]
            fix = f"set workload.mini_batch_size={fits[0]} or" if fits else "use"
            raise ConfigError(f"{system}: the training engine runs data-parallel over all {dp} training GPUs, the "
                              f"same number of samples on each per step, so a mini-batch of {w.mini_batch_size} "
                              f"samples must be a multiple of {dp}; {fix} engine.training=megatron")
        # each GPU's micro-batch: the workload's, or the largest divisor of its share below it (verl's
        # ppo_micro_batch_size_per_gpu must divide the share)
        share = w.mini_batch_size // dp
        micro_batch_size = max(m for m in range(1, min(w.micro_batch_size, share) + 1) if share % m == 0)
        train_candidates = [ParallelStrategy(dp=dp, tp=1, pp=1, zero_stage=3)]
    elif train_layout:
        pinned = parse_layout(train_layout, zero_stage, keys["train_layout"])
        check_layout_fits(pinned, len(train_mesh), per_node, num_layers, f"{system} ({keys['train_layout']})",
                          [ctx.model(r) for r in ctx.roles])
        train_candidates = [pinned]
    else:
        train_candidates = list(candidate_strategies(len(train_mesh), per_node, num_layers, zero_stage,
                                                     models=[ctx.model(r) for r in ctx.roles]))
    if rollout_tp:
        whole_nodes = rollout_tp > per_node
        if ((rollout_tp % per_node if whole_nodes else per_node % rollout_tp) or len(gen_mesh) % rollout_tp
                or not tp_splits_heads(rollout_tp, [actor])):
            raise PlanError(f"{system} ({keys['rollout_tp']}={rollout_tp}): a vLLM engine's tensor parallelism "
                            f"must divide a node's {per_node} GPUs (or be a multiple of them: an engine over whole "
                            f"nodes), divide the {len(gen_mesh)} generation GPUs and split the actor's "
                            f"{actor.num_heads} heads")
        tp_candidates = [rollout_tp]
    else:
        tp_candidates = [tp for tp in divisors(per_node) if len(gen_mesh) % tp == 0 and tp_splits_heads(tp, [actor])]
    # engines over whole nodes (tp = 2, 4, ... nodes' GPUs), searched only when no engine of at most a node
    # fits: as NeMo-RL runs DeepSeek-V3 on vLLM engines of 32 or 64 GPUs (its v0.4-v0.5 performance recipes)
    multi_node_tps = [] if rollout_tp else [
        tp for tp in (per_node * 2 ** k for k in range(1, len(gen_mesh).bit_length()))
        if tp <= len(gen_mesh) and len(gen_mesh) % tp == 0 and tp_splits_heads(tp, [actor])]
    if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"{keys['gpu_memory_utilization']}={gpu_memory_utilization}: vLLM's share of each GPU's "
                          f"memory must lie in (0, 1]")
    policy = GenerationPolicy("continuous", max_num_seqs, dispatch=dispatch, memory_frac=gpu_memory_utilization)
    sync = MovementKind.PARAM_SYNC if num_gen_gpus else MovementKind.REALLOC
    offloaded = tuple(m for m in ("actor", "ref") if m in ctx.roles) if offload_for_generation and not num_gen_gpus else ()
    plans: dict[tuple[ParallelStrategy, int], Plan] = {}

    def assemble(train: ParallelStrategy, tp: int) -> Plan:
        if (train, tp) not in plans:
            # Megatron-core lays its ranks out pipeline outermost (its default order); FSDP is dp only
            train_alloc = (Allocation.pipeline_outermost(train_mesh, train) if parallelism == "megatron"
                           else Allocation(train_mesh, train))
            allocs = {task: train_alloc for task in TRAINING_LAYOUT_TASKS}
            allocs["gen"] = Allocation(gen_mesh, ParallelStrategy(dp=len(gen_mesh) // tp, tp=tp, pp=1))
            plan = assemble_ppo_plan(
                ctx, system, allocs, policy, actor_sync=sync, recompute_logprobs=True, stream_inference=stream_inference,
                micro_batch_size=micro_batch_size, offloaded=offloaded,
                layout_keys={"gen": keys["rollout_tp"], **{t: keys["train_layout"] for t in TRAINING_LAYOUT_TASKS}})
            plan.off_policy = off_policy
            plans[(train, tp)] = plan
        return plans[(train, tp)]

    # Two searches, not one over every pair: the training layout with the widest feasible vLLM
    # engines (the least generation memory), then the engines' width with that layout.
    def choose(tps: list[int]):
        widest = tps[-1]
        train = search(train_candidates, lambda s: simulated_makespan_s(ctx, assemble(s, widest)),
                       "the training layout", system=system)
        gen_tp = search([ParallelStrategy(dp=len(gen_mesh) // tp, tp=tp, pp=1) for tp in tps],
                        lambda s: simulated_makespan_s(ctx, assemble(train.strategy, s.tp)),
                        "the vLLM engines' tensor parallelism", system=system)
        return train, gen_tp

    try:
        train, gen_tp = choose(tp_candidates)
    except PlanError:
        if not multi_node_tps:
            raise
        train, gen_tp = choose(multi_node_tps)
    plan = plans[(train.strategy, gen_tp.strategy.tp)]
    plan.notes.update({
        "train_layout": f"{train.strategy}" + (f" ({train.num_candidates} candidates)" if len(train_candidates) > 1
                                               else ""),
        "rollout_tp": gen_tp.strategy.tp,
        "refit": ("param_sync: broadcast to the generation GPUs" if num_gen_gpus
                  else "realloc_actor_gen: training layout -> vLLM layout on the same GPUs, every iteration"
                  if plan.weight_movements else "none: the vLLM layout holds the training layout's full weights"),
        "logprobs": "recomputed by the training engine after generation",
    })
    if offloaded:
        plan.notes["offloaded"] = (f"{' and '.join(offloaded)} in host memory between uses: the policy's training states "
                                   "leave the GPUs while vLLM generates")
    return plan


class RefitSystem(System):
    """A system planned by :func:`refit_plan`. ``KNOBS`` maps each knob (``rollout_tp``,
    ``max_num_seqs``, ``train_layout``, ``zero_stage``, ``generation_nodes``,
    ``gpu_memory_utilization``, ...) to the field of the
    system's config that sets it (the framework's own name for it); a knob it does not map is off."""

    KNOBS: dict[str, str] = {}

    def plan(self, ctx: PlanContext) -> Plan:
        return self.refit(ctx)

    def off_policy(self, ctx: PlanContext, max_staleness: Optional[int]) -> Optional[OffPolicyPolicy]:
        """How the system's generation runs ahead, given its staleness knob (None: on-policy):
        batched rollout by default (each batch generated to its end before the next)."""
        return None if max_staleness is None else OffPolicyPolicy(max_staleness)

    def pooled(self, ctx: PlanContext) -> Plan:
        """The refit plan on the generation pool the config sizes (its ``generation_gpus`` or
        ``generation_nodes`` knob), or, when it sizes none, on the fastest split
        (:func:`fastest_split`): systems whose generation runs on GPUs of its own."""
        sized = any(getattr(self.cfg, self.KNOBS[k]) for k in ("generation_gpus", "generation_nodes") if k in self.KNOBS)
        return self.refit(ctx) if sized else fastest_split(self, ctx)

    def refit(self, ctx: PlanContext, **knobs) -> Plan:
        """:func:`refit_plan` with the config's knobs, those in ``knobs`` replaced."""
        knob = {name: getattr(self.cfg, field) for name, field in self.KNOBS.items()} | knobs
        keys = {name: f"system.{field}" for name, field in self.KNOBS.items()}
        for name in ("generation_nodes", "generation_gpus", "max_staleness"):  # named only when set
            keys.setdefault(name, f"system.{name}")
        return refit_plan(ctx, self.cfg.name, rollout_tp=knob["rollout_tp"], max_num_seqs=knob["max_num_seqs"],
                          train_layout=knob["train_layout"], zero_stage=knob["zero_stage"],
                          generation_nodes=knob.get("generation_nodes", 0),
                          generation_gpus=knob.get("generation_gpus", 0),
                          off_policy=self.off_policy(ctx, knob.get("max_staleness")),
                          offload_for_generation=bool(knob.get("offload_for_generation", False)),
                          stream_inference=bool(knob.get("stream_inference", False)), dispatch=knob.get("dispatch"),
                          gpu_memory_utilization=knob.get("gpu_memory_utilization"), keys=keys)


def fastest_split(system: RefitSystem, ctx: PlanContext) -> Plan:
    """``system``'s refit plan with generation on a quarter, half or three quarters of the GPUs (its
    own, the last ones), whichever gives the shortest step as planners score it (the steady-state
    step of an off-policy plan); the note ``rollout_gpus`` names the choice."""
    n = ctx.num_devices
    splits = sorted({n * q // 4 for q in (1, 2, 3)} - {0})
    best, failures = None, []
    for gpus in splits:
        try:
            plan = system.refit(ctx, generation_gpus=gpus)
        except (ConfigError, PlanError) as e:
            failures.append(f"{gpus} GPUs: {e}")
            continue
        step = simulated_makespan_s(ctx, plan)
        if best is None or step < best[0]:
            best = (step, plan)
    if best is None:
        raise PlanError(f"{system.cfg.name}: no split of the {n} GPUs between generation and training fits: "
                        + "; ".join(failures))
    best[1].notes["rollout_gpus"] = f"{len(best[1].tasks_of(TaskKind.GENERATE)[0].allocation.mesh)} (searched among {splits})"
    return best[1]
