"""The PPO plan assembler: a layout per task in, the whole PPO iteration plan out.

Every system builds its plan here; a system file keeps only its own decisions (which layouts,
which generation policy, whether inference streams, how the actor reaches generation, which
training stages). What is decided once, here, for all of them:

- **tasks and edges**: the six PPO tasks (:mod:`harness.planning.workflow`) with their data keys,
  so dependency edges follow from the keys; with ``stream_inference`` the three inference tasks
  get a stream edge from ``gen`` (RLHFuse section 4);
- **resharding** (:func:`needs_movement`): a model's weights move from its training layout to a
  consumer's layout when the two differ in mesh or (dp, tp, pp), or when the source is ZeRO-3
  sharded and the consumer is not (DeepSpeed-Chat's hybrid engine gathers; a ZeRO-1/2 layout holds
  full weights, so a consumer with the same (dp, tp, pp) on the same mesh reads them in place;
  a generation engine that reloads its weights at each refit, ``refit: reload``, is refit in any
  layout). The actor reaches ``gen`` by a ``realloc`` task, or by ``param_sync`` to a separate generation
  pool (always, since the pool holds its own shadow copy). The critic reaches ``values`` by a
  ``realloc`` task, or, when inference streams, by each inference replica fetching its share as it
  starts (``per_replica``: the replica's devices are only free once generation releases them);
- **residency**: actor and critic training states stay resident, ref and reward weights too,
  unless offloaded (in host memory between uses); a separate pool's shadow actor weights;
- **training**: each training task as its own 1F1B stage unless the system passes its stages
  (RLHFuse's fused pipeline);
- **the algorithm** (``ctx.algorithm``, :mod:`harness.core.algorithm`): only its tasks are built
  (:func:`harness.planning.workflow.workflow_tasks`; a system's layouts for the others are ignored),
  and only its models move, stay resident and train;
- **engines** (:mod:`harness.core.engines`): the plan records the run's execution engines; the generation
  engine sets the policy's batching, kernels, syncing and padding (the system keeps batch limits and
  migration), and a plan its engines cannot run is refused.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from harness.core.engines import check_compatible, policy_fields
from harness.errors import PlanError
from harness.core.plan import (Allocation, GenerationPolicy, MovementKind, Plan, ResidentState, TrainingStage,
                          WeightMovement)
from harness.planning.workflow import (packed_stage_args, ppo_tasks, single_pipe_stage, weight_movement,
                                       workflow_tasks)
from harness.system import PlanContext

# (model, consumer task, source task): where each moved model's weights come from and go to
MOVED_WEIGHTS = (("actor", "gen", "update_actor"), ("critic", "values", "update_critic"))
TRAINING_TASKS = (("update_actor", "actor"), ("update_critic", "critic"))


def needs_movement(source: Allocation, target: Allocation) -> bool:
    """Whether a consumer in layout ``target`` must receive weights held in layout ``source``."""
    s, t = source.strategy, target.strategy
    if source.mesh != target.mesh or (s.dp, s.tp, s.pp) != (t.dp, t.tp, t.pp):
        return True
    return s.zero_stage == 3 and t.zero_stage != 3


def single_pipe_stages(ctx: PlanContext, allocations: dict[str, Allocation], mini_batch_size: int,
                       micro_batch_size: Optional[int] = None) -> list[TrainingStage]:
    """Each training task as its own 1F1B stage, in micro-batches of ``micro_batch_size`` (None: the
    workload's)."""
    w = ctx.workload
    micro = w.micro_batch_size if micro_batch_size is None else micro_batch_size
    packed = packed_stage_args(ctx, mini_batch_size)
    return [single_pipe_stage(t, m, allocations[t].strategy, mini_batch_size, micro, w.global_batch_size, **packed)
            for t, m in TRAINING_TASKS if m in ctx.roles]


def assemble_ppo_plan(ctx: PlanContext, system: str, allocations: dict[str, Allocation], generation: GenerationPolicy,
                      *, training: Optional[list[TrainingStage]] = None, mini_batch_size: Optional[int] = None,
                      micro_batch_size: Optional[int] = None,
                      actor_sync: MovementKind = MovementKind.REALLOC, stream_inference: bool = False,
                      offloaded: Sequence[str] = (), notes: Optional[dict] = None,
                      layout_keys: Optional[dict[str, str]] = None, recompute_logprobs: bool = False) -> Plan:
    """The iteration plan for ``allocations`` (one per task of the run's algorithm:
    :func:`~harness.planning.workflow.workflow_tasks`; others are ignored). ``mini_batch_size``
    and ``micro_batch_size`` (None: the workload's) size the default training stages; ``layout_keys``
    names the system's key that pins each task's layout (``Plan.layout_keys``, for hints). With
    ``recompute_logprobs`` the actor's log-probs are recomputed after generation by a forward pass
    in its training layout (``update_actor``'s allocation; the task
    :data:`~harness.planning.workflow.RECOMPUTE_LOGPROBS`)."""
    algorithm = ctx.algorithm
    present = workflow_tasks(algorithm, recompute_logprobs)
    if recompute_logprobs:
        allocations = {**allocations, "logprobs": allocations["update_actor"]}
    allocations = {name: allocations[name] for name in present if name in allocations}
    missing = sorted(set(present) - set(allocations))
    if missing:
        raise PlanError(f"{system}: no layout for task(s) {missing}")
    if actor_sync == MovementKind.PER_REPLICA:
        raise PlanError(f"{system}: the actor reaches generation by realloc or param_sync, not per replica")
    mini_batch_size = ctx.workload.mini_batch_size if mini_batch_size is None else mini_batch_size
    if ctx.engines is not None:  # the generation engine decides batching, kernels, syncing, padding
        check_compatible(ctx.engines, allocations, generation.migration is not None)
        zero3_actor = allocations["update_actor"].strategy.zero_stage == 3
        generation = replace(generation, **policy_fields(ctx.engines, zero3_actor))
    movement_tasks, movements, moved = [], [], {}
    for model, consumer, source in MOVED_WEIGHTS:
        if model not in algorithm.roles:
            continue
        src, dst = allocations[source], allocations[consumer]
        kind = actor_sync if model == "actor" else MovementKind.REALLOC
        # a reloading engine refits the actor into generation every iteration, layouts alike or not
        reloads = (model == "actor" and consumer == "gen" and ctx.engines is not None
                   and ctx.engines.generation.refit == "reload")
        if kind != MovementKind.PARAM_SYNC and not reloads and not needs_movement(src, dst):
            continue
        if model == "critic" and stream_inference:  # fetched by each inference replica as it starts
            movements.append(WeightMovement(consumer, model, src, dst, MovementKind.PER_REPLICA))
            continue
        task, move = weight_movement(model, consumer, src, dst, kind=kind)
        movement_tasks.append(task)
        movements.append(move)
        moved[consumer] = task.name
    tasks = movement_tasks + ppo_tasks(allocations, moved, stream_from="gen" if stream_inference else None,
                                       algorithm=algorithm, recompute_logprobs=recompute_logprobs)
    resident = [ResidentState(m, t, "train") for t, m in TRAINING_TASKS if m in algorithm.roles and m not in offloaded]
    resident += [ResidentState(m, m, "weights") for m in ("ref", "reward") if m not in offloaded and m in algorithm.roles]
    if actor_sync == MovementKind.PARAM_SYNC:
        resident.append(ResidentState("actor", "gen", "weights"))  # the generation pool's shadow actor
    if training is None:
        training = single_pipe_stages(ctx, allocations, mini_batch_size, micro_batch_size)
    stray = sorted({t for stage in training for t in stage.tasks} - set(present))
    if stray:
        raise PlanError(f"{system}: training stages of task(s) {stray}, which algo={algorithm.name} does not run")
    return Plan(system=system, tasks=tasks, training=training,
                generation=generation, weight_movements=movements, resident=resident, offloaded=list(offloaded),
                engines=ctx.engines,
                global_batch_size=ctx.workload.global_batch_size, mini_batch_size=mini_batch_size,
                algorithm=algorithm.name,
                notes=dict(notes or {}), layout_keys=dict(layout_keys or {}))
