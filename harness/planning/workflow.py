"""The PPO workflow as tasks and data keys, weight-movement tasks, single-pipe training stages and
layout checks: the building blocks of :mod:`harness.planning.assembler`.

The PPO iteration (Ouyang et al. 2022; verl's task names) as tasks with the data keys they read
and write; dependency edges follow from the keys (see :meth:`harness.core.plan.Plan.dependencies`):

    gen            reads prompts, actor weights         writes responses, old_logprobs
    ref            reads responses                      writes ref_logprobs
    reward         reads responses                      writes rewards
    values         reads responses, critic weights      writes values
    update_actor   reads responses, old_logprobs, ref_logprobs, rewards, values   writes new actor weights
    update_critic  reads responses, old_logprobs, ref_logprobs, rewards, values   writes new critic weights

The training tasks' reads are not written here: they follow from what each loss consumes
(:func:`harness.planning.dataflow.training_reads`). Both read all five, because the advantages
(actor) and the returns (critic) come from the same KL-penalised rewards: ``rewards`` plus
``-kl_coef (old_logprobs - ref_logprobs)`` per token, then GAE with ``values``.

A weight movement ``realloc_<model>_<task>`` reads ``<model>_weights`` and writes
``<model>_weights@<task>``, which the consuming task then reads instead.

An algorithm other than PPO (:mod:`harness.core.algorithm`) runs a subset of these tasks
(:func:`workflow_tasks`): without a critic no ``values`` and no ``update_critic``, without a KL term
no ``ref``, with a rule-based reward no ``reward`` (``gen`` then writes ``rewards``: the verifier
scores each response on the driver as generation returns it).

A system whose framework recomputes the behaviour policy's log-probs with the training engine
(verl's ``compute_log_prob``, NeMo-RL's "get logprobs": the generation engine's numbers differ from
the training engine's) adds the task :data:`RECOMPUTE_LOGPROBS` (``recompute_logprobs``): a forward
pass of the actor in its training layout that writes ``old_logprobs``, which ``gen`` then does not.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional, Sequence

from harness.core.algorithm import PPO, AlgorithmConfig
from harness.costmodel.llama import expert_parallel_problem
from harness.errors import PlanError
from harness.core.workload import draw_batch
from harness.planning import packing
from harness.core.plan import Allocation, MovementKind, ParallelStrategy, Task, TrainingStage, WeightMovement
from harness.planning.dataflow import training_reads
from harness.schedule import PipeSpec, build

PPO_TASKS = {
    "gen": ("generate", "actor", ("prompts", "actor_weights"), ("responses", "old_logprobs")),
    "ref": ("inference", "ref", ("responses",), ("ref_logprobs",)),
    "reward": ("inference", "reward", ("responses",), ("rewards",)),
    "values": ("inference", "critic", ("responses", "critic_weights"), ("values",)),
    "update_actor": ("train", "actor", training_reads("actor"), ("new_actor_weights",)),
    "update_critic": ("train", "critic", training_reads("critic"), ("new_critic_weights",)),
}


# the actor's log-probs recomputed by the training engine (module docstring), after gen
RECOMPUTE_LOGPROBS = {"logprobs": ("inference", "actor", ("responses", "actor_weights"), ("old_logprobs",))}


def workflow_tasks(algorithm: AlgorithmConfig = PPO, recompute_logprobs: bool = False) -> tuple[str, ...]:
    """The tasks of an iteration of ``algorithm``, in :data:`PPO_TASKS` order: those of the models
    it runs (``algorithm.roles``), with ``logprobs`` after ``gen`` when ``recompute_logprobs``."""
    names = []
    for name, (_, model, _, _) in PPO_TASKS.items():
        if model in algorithm.roles:
            names.append(name)
        if name == "gen" and recompute_logprobs:
            names.extend(RECOMPUTE_LOGPROBS)
    return tuple(names)


def ppo_tasks(allocations: dict[str, Allocation], moved: dict[str, str] | None = None,
              stream_from: str | None = None, algorithm: AlgorithmConfig = PPO,
              recompute_logprobs: bool = False) -> list[Task]:
    """The tasks of ``algorithm``'s iteration (:func:`workflow_tasks`; PPO's six by default) on the
    given allocations. ``moved`` maps a task to the weight-movement task that prepares its weights;
    the task then reads the moved key. With ``stream_from`` the inference tasks (``logprobs`` among
    them: a forward pass per sample like the others) consume that generate task's samples as they
    finish."""
    moved = moved or {}
    tasks = []
    for name in workflow_tasks(algorithm, recompute_logprobs):
        kind, model, reads, writes = {**PPO_TASKS, **RECOMPUTE_LOGPROBS}[name]
        if kind == "train":
            reads = training_reads(model, algorithm)
        if name == "gen" and recompute_logprobs:
            writes = tuple(w for w in writes if w != "old_logprobs")  # the logprobs task writes them
        if name == "gen" and not algorithm.has_reward_model:
            writes = writes + ("rewards",)  # the rule-based verifier scores each response as it returns
        if name in moved:
            reads = tuple(f"{model}_weights@{name}" if r == f"{model}_weights" else r for r in reads)
            if f"{model}_weights@{name}" not in reads:
                reads = reads + (f"{model}_weights@{name}",)
        stream = stream_from if kind == "inference" else None
        tasks.append(Task(name, kind, model, allocations[name], reads, writes, stream))
    return tasks


def weight_movement(model: str, consumer: str, source: Allocation, target: Allocation,
                    kind: MovementKind = MovementKind.REALLOC) -> tuple[Task, WeightMovement]:
    """A weight-movement task (``realloc_<model>_<consumer>`` or ``param_sync``) and its movement."""
    kind = MovementKind(kind)
    name = "param_sync" if kind == MovementKind.PARAM_SYNC else f"realloc_{model}_{consumer}"
    task = Task(name, "weight_movement", model, target, (f"{model}_weights",), (f"{model}_weights@{consumer}",))
    return task, WeightMovement(name, model, source, target, kind)


def microbatches_per_replica(mini_batch_size: int, dp: int, micro_batch_size: int, what: str) -> int:
    per_replica, rest = divmod(mini_batch_size, dp * micro_batch_size)
    if rest or per_replica < 1:
        raise PlanError(
            f"{what}: mini-batch of {mini_batch_size} samples cannot be split over dp={dp} replicas "
            f"in micro-batches of {micro_batch_size} (needs mini_batch_size to be a positive multiple "
            f"of dp x micro_batch_size = {dp * micro_batch_size})")
    return per_replica


@lru_cache(maxsize=4096)
def single_pipe_stage(task: str, model: str, strategy: ParallelStrategy, mini_batch_size: int,
                      micro_batch_size: int, global_batch_size: int, schedule: str = "1f1b",
                      micro_batch_tokens: Optional[int] = None, packed_bins: Optional[int] = None) -> TrainingStage:
    """One training task as its own stage: a ``pp``-stage pipeline per dp replica, 1F1B by default,
    in micro-batches of ``micro_batch_size`` samples, or, with ``micro_batch_tokens`` (sequence
    packing), in ``packed_bins`` bins of at most that many tokens per mini-batch dealt over dp
    (:mod:`harness.planning.packing`; :func:`packed_stage_args` gives both from the context).
    Memoised: the same arguments give the same (immutable) stage object, so a layout search's
    candidates share the stages they have in common, and checks memoised on a schedule's identity
    (:func:`harness.planning.memory.training_activation_gb`) answer them once."""
    if micro_batch_tokens is None:
        num_mbs = microbatches_per_replica(mini_batch_size, strategy.dp, micro_batch_size, task)
    else:
        if packed_bins is None:
            raise PlanError(f"{task}: a packed stage (micro_batch_tokens={micro_batch_tokens}) needs its planned bins")
        # the mini-batch still splits over the replicas by samples (NeMo-RL shards it first), then its bins
        microbatches_per_replica(mini_batch_size, strategy.dp, 1, task)
        num_mbs = packing.per_replica(packed_bins, strategy.dp)
    pipe = PipeSpec(name=model[0].upper(), num_stages=strategy.pp, num_mbs=num_mbs,
                    stage_to_rank=tuple(range(strategy.pp)), model=model)
    return TrainingStage((task,), build(schedule, [pipe]), global_batch_size // mini_batch_size, micro_batch_size,
                         micro_batch_tokens)


def packed_stage_args(ctx, mini_batch_size: Optional[int] = None) -> dict[str, Optional[int]]:
    """``micro_batch_tokens`` and ``packed_bins`` of :func:`single_pipe_stage` for ``ctx``'s workload
    in mini-batches of ``mini_batch_size`` samples (None: the workload's): both None without sequence
    packing, else the budget and the bins the planning batch's fullest mini-batch needs
    (:func:`harness.planning.packing.planned_bins`)."""
    w = ctx.workload
    if w.micro_batch_tokens is None:
        return {"micro_batch_tokens": None, "packed_bins": None}
    mini = w.mini_batch_size if mini_batch_size is None else mini_batch_size
    key = (id(ctx), mini)
    cached = _PACKED_BINS.get(key)
    if cached is None or cached[0] is not ctx:
        batch = draw_batch(w, ctx.seed, 0, ctx.algorithm)  # the planning batch (harness.planning.estimate)
        bins = packing.planned_bins(batch.prompt_lens + batch.output_lens, mini, w.micro_batch_tokens)
        if len(_PACKED_BINS) >= 16:
            _PACKED_BINS.pop(next(iter(_PACKED_BINS)))
        cached = _PACKED_BINS[key] = (ctx, bins)
    return {"micro_batch_tokens": w.micro_batch_tokens, "packed_bins": cached[1]}


# (id(context), mini-batch samples) -> (context, planned bins): a layout search asks for every candidate
_PACKED_BINS: dict[tuple[int, int], tuple[Any, int]] = {}


def full_mesh(num_devices: int) -> tuple[int, ...]:
    return tuple(range(num_devices))


def check_layout_fits(strategy: ParallelStrategy, num_devices: int, gpus_per_node: int, num_layers: int,
                      what: str, models: Sequence[Any] = ()) -> None:
    """Raise PlanError naming the bad value when a layout cannot run on the cluster, or its expert
    parallelism on one of ``models`` (ep > 1 needs mixtures of experts whose experts it divides)."""
    for model in models:
        problem = expert_parallel_problem(model, strategy.ep)
        if problem:
            raise PlanError(f"{what}: layout {strategy}: {problem}")
    if strategy.size != num_devices:
        raise PlanError(f"{what}: layout {strategy} uses {strategy.size} devices, the cluster has {num_devices}")
    if strategy.tp > gpus_per_node or gpus_per_node % strategy.tp:
        raise PlanError(f"{what}: tp={strategy.tp} must divide the {gpus_per_node} GPUs of a node "
                        f"(tensor parallelism stays on NVLink)")
    if strategy.pp > num_layers:
        raise PlanError(f"{what}: pp={strategy.pp} exceeds the model's {num_layers} layers")
