"""The plan IR (docs/DESIGN.md section 3): what a system decides, as data.

A :class:`Plan` is everything a backend needs to execute one PPO iteration, and nothing a backend
may choose by itself:

- the **workflow**: tasks, each with a :class:`TaskKind` and a :class:`ModelRole` (semantics are
  never read from task names), whose dependency edges are derived from the data keys each task
  reads and writes (:meth:`Plan.dependencies`), and **stream edges** (``Task.stream_from``): an
  inference task that consumes a generate task's samples one by one as they finish, instead of
  waiting for the whole batch (RLHFuse section 4);
- an **allocation** per task: a device mesh and a parallel strategy (dp, tp, pp; and ep, the
  expert parallelism of a mixture-of-experts model), checked;
- **training stages**: pipeline schedules (``harness.schedule``) run once per mini-batch;
- a **generation policy** (static or continuous batching, synced and padded rounds, migration) as
  data, and the **execution engines** that run the plan (:class:`~harness.core.engines.Engines`:
  how the generation engine's kernels run, how the training engine trains), each fact held once;
- **weight movements** between layouts (:class:`MovementKind`: a reallocation task, a parameter
  sync to a separate pool, or a fetch by each replica of the consuming task as it starts), so their
  cost is simulated and their bytes moved for real;
- **resident states**: which model states stay in device memory all iteration (for the memory check);
- **offloaded** models: weights kept in host memory and copied in before each use (ReaLHF);
- **training stages**: a stage with several tasks is a fused pipeline (RLHFuse section 5).

:meth:`Plan.features` lists what a plan asks of a backend (streaming, migration, fused training,
offloading); a backend refuses the features it cannot execute before any work starts.

Device order inside a mesh is tp fastest, then pp, then dp: mesh index
``(dp_rank * pp + pp_rank) * tp + tp_rank``. Tensor-parallel groups therefore stay inside a node.
The mesh lists the devices in that order, so any rank order is a permutation of the mesh: a
system whose training engine is Megatron-core lays its devices out in Megatron-core's order, the
pipeline outermost (:meth:`Allocation.pipeline_outermost`).
Expert parallelism (``ParallelStrategy.ep``) is carved from data parallelism, as in Megatron-core:
dp replicas ``k * ep .. k * ep + ep - 1`` form one expert-parallel group (each holding ``1 / ep``
of the routed experts), so ``ep`` must divide ``dp``; a strategy with ``ep = 1`` prints and
serialises exactly as one without it. Each expert is split over the ``tp`` ranks of its replica
unless the strategy sets expert tensor parallelism ``etp`` (Megatron-core's
``expert_tensor_parallel_size``): then the MoE layers fold ``ep * etp`` over the ``dp * tp``
ranks of a stage, which must divide it: each run of ``ep * etp`` consecutive ranks of a stage (tp
fastest) is one expert-parallel domain, every expert split over ``etp`` of them, so ``ep`` need
not divide ``dp``. A strategy whose ``etp`` equals its ``tp`` is the plain one.

Plans round-trip through JSON (``to_json``/``from_json``) and are written to the run folder
before execution.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from enum import Enum
from typing import Any, Optional

from harness.core.engines import Engines
from harness.errors import PlanError
from harness.schedule.ir import Schedule
from harness.schedule.io import schedule_from_dict, schedule_to_dict

class _ValueEnum(str, Enum):
    """A string enum that prints (and serialises) as its value."""

    def __str__(self) -> str:
        return self.value


class TaskKind(_ValueEnum):
    """What a task does; backends dispatch on it (one handler per kind)."""

    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN = "train"
    WEIGHT_MOVEMENT = "weight_movement"


class ModelRole(_ValueEnum):
    """The four models of a PPO iteration."""

    ACTOR = "actor"
    CRITIC = "critic"
    REF = "ref"
    REWARD = "reward"


class MovementKind(_ValueEnum):
    """How a :class:`WeightMovement` runs."""

    REALLOC = "realloc"  # its own task, between layouts over (partly) shared devices (ReaLHF)
    PARAM_SYNC = "param_sync"  # its own task, to a separate generation pool's shadow copy
    PER_REPLICA = "per_replica"  # no task: each replica of the consuming task fetches its share as it starts


class Feature(_ValueEnum):
    """Plan features a backend may not execute (see :meth:`Plan.features`)."""

    STREAMING = "sample streaming from generation into inference (RLHFuse inter-stage fusion)"
    MIGRATION = "long-tail migration of unfinished samples (RLHFuse inter-stage fusion)"
    FUSED_TRAINING = "fused training stages (RLHFuse intra-stage fusion)"
    OFFLOAD = "offloading model weights to host memory"
    PER_REPLICA_MOVEMENT = "weight movements performed by the consuming task's replicas"
    OFF_POLICY = "generation running ahead of training on older weights (off-policy pipelining)"
    LENGTH_DISPATCH = "samples dispatched to generation instances by predicted length (StreamRL)"
    SEQUENCE_PACKING = "micro-batches packed to a token budget (sequence packing)"


MODEL_ROLES = tuple(r.value for r in ModelRole)
TASK_KINDS = tuple(k.value for k in TaskKind)


def _plain(value: Any) -> Any:
    """Enums as their values, recursively (for JSON)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


@dataclass(frozen=True)
class ParallelStrategy:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0  # ZeRO sharding of model states across dp (0 = none, 3 = all)
    # Expert parallelism of a mixture-of-experts model: its routed experts split over ep ranks carved
    # from dp (module docstring); 1 = none (and always 1 for a dense model; Plan checks it per model).
    ep: int = 1
    # Expert tensor parallelism (Megatron-core's expert_tensor_parallel_size): the ranks each routed
    # expert is split over, ep * etp of them folded over a stage's dp * tp ranks (module docstring).
    # None: every expert over its replica's tp ranks (Megatron-core's default, etp = tp).
    etp: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise PlanError(f"parallel strategy dp{self.dp}tp{self.tp}pp{self.pp}: ep={self.ep!r} must be an "
                            f"integer >= 1")
        if self.etp is not None:
            if not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 1:
                raise PlanError(f"parallel strategy dp{self.dp}tp{self.tp}pp{self.pp}ep{self.ep}: etp={self.etp!r} "
                                f"must be an integer >= 1")
            if self.etp == self.tp:
                object.__setattr__(self, "etp", None)  # the default, spelled out
        if self.etp is not None:
            if self.ep == 1:
                raise PlanError(f"parallel strategy dp{self.dp}tp{self.tp}pp{self.pp}etp{self.etp}: expert tensor "
                                f"parallelism needs expert parallelism (ep > 1)")
            if (self.dp * self.tp) % (self.ep * self.etp):
                raise PlanError(f"parallel strategy dp{self.dp}tp{self.tp}pp{self.pp}ep{self.ep}etp{self.etp}: "
                                f"ep*etp = {self.ep * self.etp} must divide dp*tp = {self.dp * self.tp} (the "
                                f"expert-parallel domains are folded over each stage's data- and tensor-parallel "
                                f"ranks)")
        elif self.dp % self.ep:
            raise PlanError(f"parallel strategy dp{self.dp}tp{self.tp}pp{self.pp}ep{self.ep}: ep={self.ep} must "
                            f"divide dp={self.dp} (expert-parallel ranks are carved from the data-parallel group; "
                            f"with expert tensor parallelism etp, ep*etp must divide dp*tp instead)")

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def expert_tp(self) -> int:
        """The ranks each routed expert is split over: ``etp`` where set, else ``tp``."""
        return self.tp if self.etp is None else self.etp

    def __str__(self) -> str:
        zero = f",zero{self.zero_stage}" if self.zero_stage else ""
        ep = f"ep{self.ep}" if self.ep != 1 else ""
        etp = f"etp{self.etp}" if self.etp is not None else ""
        return f"dp{self.dp}tp{self.tp}pp{self.pp}{ep}{etp}{zero}"

    def to_dict(self) -> dict[str, int]:
        """The strategy as plan.json writes it: ``ep`` only when it is not 1, ``etp`` only when set."""
        d = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "zero_stage": self.zero_stage}
        if self.ep != 1:
            d["ep"] = self.ep
        if self.etp is not None:
            d["etp"] = self.etp
        return d


@dataclass(frozen=True)
class Allocation:
    mesh: tuple[int, ...]
    strategy: ParallelStrategy

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", tuple(int(d) for d in self.mesh))
        if len(set(self.mesh)) != len(self.mesh):
            raise PlanError(f"mesh {list(self.mesh)[:8]}... lists a device twice")
        if self.strategy.size != len(self.mesh):
            raise PlanError(
                f"parallel strategy {self.strategy} needs dp*tp*pp = {self.strategy.size} devices "
                f"but its mesh has {len(self.mesh)}"
            )

    @classmethod
    def pipeline_outermost(cls, devices: tuple[int, ...], strategy: ParallelStrategy) -> "Allocation":
        """``strategy`` on ``devices`` in Megatron-core's rank order: tensor-parallel ranks fastest,
        then data-parallel ranks (whose consecutive runs of ``ep`` are the expert-parallel groups),
        the pipeline outermost (``initialize_model_parallel``'s default order ``tp-cp-ep-dp-pp``,
        the first dimension varying fastest). Stage ``p`` of replica ``k`` then takes
        ``devices[(p * dp + k) * tp:][:tp]``, so one stage's replicas sit side by side: their
        gradient all-reduce and an ep group's all-to-alls stay within ``dp * tp`` and ``ep * tp``
        devices, and the pipeline's hops cross them. With ``pp = 1`` it is the plain order."""
        s, devices = strategy, tuple(devices)
        if len(devices) != s.size:
            raise PlanError(f"parallel strategy {s} needs dp*tp*pp = {s.size} devices but {len(devices)} were given")
        mesh = [devices[(p * s.dp + k) * s.tp + t] for k in range(s.dp) for p in range(s.pp) for t in range(s.tp)]
        return cls(tuple(mesh), s)

    @classmethod
    def in_engine_order(cls, devices: tuple[int, ...], strategy: ParallelStrategy) -> "Allocation":
        """``strategy`` on ``devices`` as the searched 3D-parallel systems (RLHFuse, RLHFuse-Base,
        ReaLHF, the plan-level baselines) place it: with expert parallelism and a pipeline, in
        Megatron-core's order (:meth:`pipeline_outermost`), so that each expert-parallel group is
        ``ep * tp`` consecutive devices and its all-to-alls stay within them, as in RLHFuse's
        Megatron-LM training engine; otherwise in the plain order (a replica's stages side by side,
        its pipeline hops within a node), the layout these systems have always had. With ``pp = 1``
        the two orders are the same."""
        if strategy.ep > 1 and strategy.pp > 1:
            return cls.pipeline_outermost(devices, strategy)
        return cls(tuple(devices), strategy)

    def device(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        s = self.strategy
        return self.mesh[(dp_rank * s.pp + pp_rank) * s.tp + tp_rank]

    @cached_property
    def ep_span(self) -> int:
        """The devices an expert-parallel domain lies among, from its first member to its last, the
        widest over domains and stages; ``tp`` without expert parallelism. A domain is a run of
        ``ep * expert_tp`` consecutive ranks of one pipeline stage's ranks taken tp fastest (its
        ``ep`` replicas' tp ranks when ``etp`` is unset), where one MoE layer's all-to-alls run.
        The cost model takes the link of the all-to-alls from it (NVLink when it fits a node)."""
        s = self.strategy
        widest = s.tp
        size = s.ep * s.expert_tp
        for p in range(s.pp) if s.ep > 1 else ():
            ranks = [self.device(k, p, t) for k in range(s.dp) for t in range(s.tp)]
            for first in range(0, len(ranks), size):
                members = ranks[first:first + size]
                widest = max(widest, max(members) - min(members) + 1)
        return widest

    def stage_devices(self, dp_rank: int, pp_rank: int) -> tuple[int, ...]:
        """The tp devices of one stage of one replica (a slice of the mesh: ``device`` for every tp rank)."""
        s = self.strategy
        start = (dp_rank * s.pp + pp_rank) * s.tp
        return self.mesh[start:start + s.tp]

    def replica_devices(self, dp_rank: int) -> tuple[int, ...]:
        s = self.strategy
        start = dp_rank * s.pp * s.tp
        return self.mesh[start:start + s.pp * s.tp]


@dataclass(frozen=True)
class Task:
    name: str
    kind: TaskKind
    model: ModelRole
    allocation: Allocation
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    # Inference only: the generate task whose samples this task consumes one by one as they finish
    # (a stream edge). None = it waits for its inputs as a whole.
    stream_from: Optional[str] = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", TaskKind(self.kind))
        except ValueError:
            raise PlanError(f"task {self.name}: unknown kind {self.kind!r}, expected one of {TASK_KINDS}") from None
        try:
            object.__setattr__(self, "model", ModelRole(self.model))
        except ValueError:
            raise PlanError(f"task {self.name}: unknown model {self.model!r}, expected one of {MODEL_ROLES}") from None
        object.__setattr__(self, "reads", tuple(self.reads))
        object.__setattr__(self, "writes", tuple(self.writes))
        if self.stream_from is not None and self.kind != TaskKind.INFERENCE:
            raise PlanError(f"task {self.name}: only inference tasks consume a stream (stream_from="
                            f"{self.stream_from!r} on a {self.kind} task)")


@dataclass(frozen=True)
class WeightMovement:
    """Weights of ``model`` move from the ``source`` layout to the ``target`` layout. ``task`` is
    the weight-movement task that does it (``REALLOC``, ``PARAM_SYNC``), or, for ``PER_REPLICA``,
    the task whose replicas each fetch their share as they start (RLHFuse's critic resharding
    onto devices freed by generation)."""

    task: str
    model: ModelRole
    source: Allocation
    target: Allocation
    kind: MovementKind = MovementKind.REALLOC

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", ModelRole(self.model))
        object.__setattr__(self, "kind", MovementKind(self.kind))


@dataclass(frozen=True)
class TrainingStage:
    """Training tasks executed together through one pipeline schedule per mini-batch.

    ``schedule`` describes one data-parallel replica's pipeline over *logical* ranks 0..R-1; logical
    rank r of replica k runs on ``allocation.stage_devices(k, r)`` of each task in ``tasks``.
    """

    tasks: tuple[str, ...]
    schedule: Schedule
    num_minibatches: int
    micro_batch_size: int
    # sequence packing (harness/planning/packing.py): each micro-batch a bin of whole samples of at
    # most this many tokens, the schedule's micro-batch count planned on the planning batch; None:
    # ``micro_batch_size`` samples a micro-batch
    micro_batch_tokens: Optional[int] = None

    @property
    def fused(self) -> bool:
        """Several tasks share one pipeline schedule (RLHFuse section 5)."""
        return len(self.tasks) > 1


@dataclass(frozen=True)
class LengthDispatch:
    """Skewness-aware dispatch (StreamRL, Zhong et al., arXiv 2504.15930): an output-length ranker
    flags the ``long_frac`` of each batch it predicts longest, catching ``ranker_recall`` of the
    truly longest ``long_frac`` (its misses are samples of the rest); the flagged samples go to the
    first ``num_long_instances`` generation instances, which run them at a smaller batch, and the
    others to the remaining instances (:func:`harness.planning.taskmodels.generation.dispatch_samples`)."""

    num_long_instances: int
    long_frac: float = 0.2
    ranker_recall: float = 0.87

    def __post_init__(self) -> None:
        if not 0 < self.long_frac < 1:
            raise PlanError(f"length dispatch: long_frac={self.long_frac} must lie strictly between 0 and 1")
        if not 0 <= self.ranker_recall <= 1:
            raise PlanError(f"length dispatch: ranker_recall={self.ranker_recall} must lie in [0, 1]")
        if self.num_long_instances < 1:
            raise PlanError(f"length dispatch: num_long_instances={self.num_long_instances} must be at least 1")


@dataclass(frozen=True)
class MigrationPolicy:
    """RLHFuse section 4: when fewer than ``threshold_frac`` of the batch is unfinished, migrate
    the remaining samples to ``num_tail_instances`` instances, moving KV cache or tokens."""

    threshold_frac: float
    num_tail_instances: int
    transfer: str = "kv"  # kv | tokens


KV_ALLOCATIONS = ("reserve", "on_demand")


@dataclass(frozen=True)
class GenerationPolicy:
    """The schedule of the actor's generation in this plan, which backends execute:

    - ``batching``: ``continuous`` (Orca/vLLM) or ``static`` (every instance decodes a round until
      its longest sample ends);
    - ``max_batch_size``: samples per instance at a time; ``migration``: long-tail migration;
    - ``synced_instances``: static rounds end together, when the longest sample of the round on
      *any* instance ends (``generate(synced_gpus=True)`` under ZeRO-3);
    - ``pad_to_longest``: later passes (inference, training) see every sample padded to the
      longest prompt + response of its generation round (``generate`` returns one padded tensor);
    - ``memory_frac``: the share of each device's memory the generation engine takes for its
      weights and KV cache (vLLM's ``gpu_memory_utilization``), which caps the KV cache at
      ``memory_frac`` x the device's memory less the weights; None: whatever the plan leaves free;
    - ``kv_allocation``: how continuous batching holds KV memory: ``reserve`` (a sample's prompt +
      ``max_gen_len`` at admission) or ``on_demand`` (as tokens arrive, preempting the latest
      admitted when full: vLLM's paging; :mod:`harness.planning.taskmodels.generation`).

    With engines (``Plan.engines``), the plan assembler sets batching, syncing and padding by the
    generation engine's rules for the plan's layout (:func:`harness.core.engines.policy_fields`). How
    the engine's kernels run (CUDA graphs or an eager loop of so many launches per layer) is not
    here: the cost model reads it from the plan's engines (:mod:`harness.costmodel.engines`).
    """

    batching: str = "continuous"  # continuous | static (every instance decodes until its longest sample ends)
    max_batch_size: Optional[int] = None  # per instance; None = limited by KV capacity only
    migration: Optional[MigrationPolicy] = None
    synced_instances: bool = False
    pad_to_longest: bool = False
    dispatch: Optional[LengthDispatch] = None  # None: samples dealt to instances round-robin
    memory_frac: Optional[float] = None  # None: the KV cache takes what the plan leaves free
    kv_allocation: str = "reserve"  # reserve | on_demand (continuous batching's KV memory)

    def __post_init__(self) -> None:
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise PlanError(f"generation kv_allocation must be one of {list(KV_ALLOCATIONS)}, got {self.kv_allocation!r}")
        if self.memory_frac is not None and not 0.0 < self.memory_frac <= 1.0:
            raise PlanError(f"generation memory_frac={self.memory_frac} must lie in (0, 1]: the share of a "
                            f"device's memory the generation engine takes")
        if self.batching not in ("continuous", "static"):
            raise PlanError(f"generation batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.dispatch is not None and (self.batching != "continuous" or self.migration is not None):
            raise PlanError("length dispatch needs continuous batching without migration")
        if (self.synced_instances or self.pad_to_longest) and self.batching != "static":
            raise PlanError("generation synced_instances / pad_to_longest need static batching (rounds)")


ROLLOUTS = ("batched", "continuous", "partial", "tail_batching")
WEIGHT_UPDATES = ("drain", "inflight", "interrupt")
BATCH_ORDERS = ("iteration", "finish")
ROUND_TPS = ("fixed", "adaptive")


@dataclass(frozen=True)
class OffPolicyPolicy:
    """Generation running ahead of training (one-step off-policy: verl's ``one_step_off_policy``
    recipe, NeMo-RL's asynchronous GRPO with ``max_trajectory_age_steps``): iteration ``k``'s
    generation may start as soon as the weights of version ``k - max_staleness`` have reached the
    generation engines, instead of waiting for version ``k``, so it overlaps the training of the
    iterations before it on devices of its own. Version ``v`` is the policy after ``v`` updates;
    iteration ``k`` trains version ``k`` into ``k + 1``, so a sample generated under version ``g``
    and trained in iteration ``k`` is ``k - g`` versions stale (0 <= ``k - g`` <= ``max_staleness``;
    0 is on-policy). Executed across iterations by :mod:`harness.planning.iterations`.

    How generation runs ahead (:mod:`harness.planning.rollout` for ``continuous``):

    - ``rollout``: ``batched`` (each iteration's batch is generated to its last sample, then the
      engines take new weights, then the next batch: verl's one-step-off recipe) or ``continuous``
      (the engines take the next prompts while a batch's last responses finish; prompt groups are
      launched whenever the bound allows: NeMo-RL's asynchronous trajectory collector, AReaL's
      rollout workers);
    - ``weight_update`` (continuous): how new weights reach engines that are generating: ``drain``
      (stop launching, let every launched group finish, then load: NeMo-RL without in-flight
      updates), ``inflight`` (load between two decode steps; running samples keep their KV cache and
      continue under the new weights: NeMo-RL's ``in_flight_weight_updates``) or ``interrupt``
      (abort running samples, load, re-prefill each one's prompt and tokens so far under the new
      weights: AReaL's interruptible rollout);
    - ``batch_order`` (continuous): ``iteration`` (iteration ``k`` trains the groups drawn for it,
      waiting for the last: NeMo-RL's replay buffer by target step) or ``finish`` (iteration ``k``
      trains the first groups to finish that are within the bound; staler ones are dropped: AReaL);
    - ``max_groups_in_flight`` (continuous): launched groups not yet finished, at most (0: no
      limit; NeMo-RL: prompts per step x ``max_trajectory_age_steps``);
    - ``partial`` rollout (:mod:`harness.planning.partial`): synchronous iterations that launch
      ``oversample_factor`` times the groups they train, stop once enough have finished and carry the
      unfinished responses into the next iteration (APRIL); ``max_staleness`` then bounds how old a
      carried response's first token may be before it starts again;
    - ``tail_batching`` (:mod:`harness.planning.partial`, RollPacker): short rounds launch
      ``oversample_factor`` times the groups they train and stop once enough have finished, the
      other prompts queued; once a batch of prompts is queued, a long round generates them again to
      their full lengths. Nothing is carried: every trained sample is on-policy;
    - ``round_tp`` (tail batching): ``fixed`` (every round generates in the generate task's layout)
      or ``adaptive`` (RollPacker's parallelism planner: short and long rounds each keep a tensor
      parallelism, starting at the task's, doubled after a round whose preemptions rose and halved
      after four rounds without any; :func:`harness.planning.partial.round_tp_choices`)."""

    max_staleness: int = 1
    rollout: str = "batched"
    weight_update: str = "drain"
    batch_order: str = "iteration"
    max_groups_in_flight: int = 0
    oversample_factor: float = 1.0
    round_tp: str = "fixed"

    def __post_init__(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise PlanError(f"off-policy max_staleness must be an integer >= 0, got {self.max_staleness!r}")
        for key, allowed in (("rollout", ROLLOUTS), ("weight_update", WEIGHT_UPDATES), ("batch_order", BATCH_ORDERS)):
            if getattr(self, key) not in allowed:
                raise PlanError(f"off-policy {key}={getattr(self, key)!r}; expected one of {', '.join(allowed)}")
        if self.rollout != "continuous" and (self.weight_update, self.batch_order) != ("drain", "iteration"):
            raise PlanError(f"off-policy weight_update and batch_order apply to continuous rollout, not to "
                            f"{self.rollout} rollout")
        if not (math.isfinite(self.oversample_factor) and self.oversample_factor >= 1):
            raise PlanError(f"off-policy oversample_factor={self.oversample_factor}: launch at least the groups trained (>= 1)")
        if self.rollout not in ("partial", "tail_batching") and self.oversample_factor != 1.0:
            raise PlanError(f"off-policy oversample_factor applies to partial rollout and tail batching, not to "
                            f"{self.rollout} rollout")
        if self.max_groups_in_flight < 0:
            raise PlanError(f"off-policy max_groups_in_flight={self.max_groups_in_flight}: 0 (no limit) or more")
        if self.round_tp not in ROUND_TPS:
            raise PlanError(f"off-policy round_tp={self.round_tp!r}; expected one of {', '.join(ROUND_TPS)}")
        if self.round_tp != "fixed" and self.rollout != "tail_batching":
            raise PlanError(f"off-policy round_tp={self.round_tp!r} applies to tail batching's rounds, not to "
                            f"{self.rollout} rollout")


@dataclass(frozen=True)
class ResidentState:
    """The state of ``model`` laid out as in task ``task`` stays in device memory all iteration.
    ``what`` is ``train`` (weights, grads, optimizer states) or ``weights`` (bf16 weights only)."""

    model: ModelRole
    task: str
    what: str = "weights"

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", ModelRole(self.model))
        if self.what not in ("train", "weights"):
            raise PlanError(f"resident state of {self.model}: what={self.what!r}, expected train or weights")


@dataclass
class Plan:
    system: str
    tasks: list[Task]
    training: list[TrainingStage] = field(default_factory=list)
    generation: GenerationPolicy = field(default_factory=GenerationPolicy)
    weight_movements: list[WeightMovement] = field(default_factory=list)
    resident: list[ResidentState] = field(default_factory=list)
    offloaded: list[str] = field(default_factory=list)  # models kept in host memory, loaded per use
    # the execution engines that run this plan (harness/core/engines.py); None: the cost model's ops as is
    engines: Optional[Engines] = None
    global_batch_size: int = 512  # samples per iteration (prompts x the algorithm's responses per prompt)
    mini_batch_size: int = 64  # samples per gradient step
    # the RL algorithm whose iteration this is (conf/algo/; harness/core/algorithm.py): which tasks
    # the plan has follows from it
    algorithm: str = "ppo"
    notes: dict[str, Any] = field(default_factory=dict)  # system-specific facts shown in plan.json
    # generation ahead of training by up to so many weight versions (None: on-policy, each iteration
    # generating with the weights the previous one trained); shown in plan.json only when set
    off_policy: Optional[OffPolicyPolicy] = None
    # task -> the command-line key that pins its layout in the system that made the plan (e.g.
    # ``system.layouts.gen``, ``system.layout``), for hints in refusals; not what runs, so neither
    # written to plan.json nor compared
    layout_keys: dict[str, str] = field(default_factory=dict, compare=False)

    # ---- queries -------------------------------------------------------------------------
    def task(self, name: str) -> Task:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(f"plan of {self.system} has no task {name!r}; tasks: {[t.name for t in self.tasks]}")

    def dependencies(self) -> dict[str, list[str]]:
        """Task -> tasks it waits for: those that write a key it reads (derived, not declared)."""
        writers: dict[str, str] = {}
        for t in self.tasks:
            for key in t.writes:
                if key in writers:
                    raise PlanError(f"data key {key!r} is written by both {writers[key]} and {t.name}")
                writers[key] = t.name
        return {t.name: sorted({writers[k] for k in t.reads if k in writers}) for t in self.tasks}

    def topological_order(self) -> list[str]:
        deps = self.dependencies()
        done: list[str] = []
        pending = [t.name for t in self.tasks]
        while pending:
            ready = [n for n in pending if all(d in done for d in deps[n])]
            if not ready:
                raise PlanError(f"workflow has a dependency cycle among {pending}")
            done.append(ready[0])
            pending.remove(ready[0])
        return done

    def tasks_of(self, kind: TaskKind) -> list[Task]:
        return [t for t in self.tasks if t.kind == kind]

    def stream_edges(self) -> list[tuple[str, str]]:
        """(generate task, inference task) pairs: samples flow one by one along each edge."""
        return [(t.stream_from, t.name) for t in self.tasks if t.stream_from is not None]

    def stage_of(self, task: str) -> Optional[TrainingStage]:
        return next((st for st in self.training if task in st.tasks), None)

    def movement_of(self, task: str) -> Optional[WeightMovement]:
        return next((m for m in self.weight_movements if m.task == task), None)

    def features(self) -> list[Feature]:
        """What this plan asks of a backend beyond sequential tasks on meshes."""
        out = []
        if self.stream_edges():
            out.append(Feature.STREAMING)
        if self.generation.migration is not None:
            out.append(Feature.MIGRATION)
        if any(st.fused or len(st.schedule.pipes) > 1 for st in self.training):
            out.append(Feature.FUSED_TRAINING)
        if self.offloaded:
            out.append(Feature.OFFLOAD)
        if any(m.kind == MovementKind.PER_REPLICA for m in self.weight_movements):
            out.append(Feature.PER_REPLICA_MOVEMENT)
        if self.off_policy is not None:
            out.append(Feature.OFF_POLICY)
        if self.generation.dispatch is not None:
            out.append(Feature.LENGTH_DISPATCH)
        if any(st.micro_batch_tokens is not None for st in self.training):
            out.append(Feature.SEQUENCE_PACKING)
        return out

    def devices(self) -> list[int]:
        return sorted({d for t in self.tasks for d in t.allocation.mesh})

    def validate(self, num_devices: int) -> None:
        """Structural checks against a cluster of ``num_devices``; raises PlanError."""
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise PlanError(f"duplicate task names in {names}")
        for t in self.tasks:
            bad = [d for d in t.allocation.mesh if not 0 <= d < num_devices]
            if bad:
                raise PlanError(
                    f"task {t.name} uses devices {bad[:4]} but the cluster has {num_devices} devices (0..{num_devices - 1})"
                )
        dispatch = self.generation.dispatch
        for t in self.tasks_of(TaskKind.GENERATE) if dispatch is not None else ():
            if dispatch.num_long_instances >= t.allocation.strategy.dp:
                raise PlanError(f"task {t.name}: length dispatch gives {dispatch.num_long_instances} of its "
                                f"{t.allocation.strategy.dp} instances to the long samples; the others need at least one")
        self.topological_order()
        for stage in self.training:
            for name in stage.tasks:
                if self.task(name).kind != "train":
                    raise PlanError(f"training stage lists {name}, which is not a train task")
        names_set = set(names)
        for source, target in self.stream_edges():
            if source not in names_set or self.task(source).kind != TaskKind.GENERATE:
                raise PlanError(f"task {target} streams from {source!r}, which is not a generate task of the plan")
        for m in self.weight_movements:
            if m.task not in names_set:
                raise PlanError(f"weight movement of {m.model} names task {m.task!r}, which the plan does not have")
            owner = self.task(m.task)
            if (owner.kind == TaskKind.WEIGHT_MOVEMENT) == (m.kind == MovementKind.PER_REPLICA):
                raise PlanError(f"weight movement {m.task} of kind {m.kind} is attached to a {owner.kind} task")
        resident_models = {r.model for r in self.resident}
        both = resident_models & set(self.offloaded)
        if both:
            raise PlanError(f"models {sorted(both)} are listed both as resident and as offloaded")

    # ---- JSON ----------------------------------------------------------------------------
    def generation_kernels(self) -> dict[str, Any]:
        """How the generation engine's kernels run, as plan.json's ``generation`` shows it: ``engine``
        (``graph``: CUDA graphs, the cost model's steps without engines; ``eager``: a host loop) and
        ``eager_launches_per_layer`` (its kernel launches per layer per step). Read from the plan's
        engines, where the facts are held."""
        gen = self.engines.generation if self.engines is not None else None
        if gen is None or gen.kernels != "eager":
            return {"engine": "graph", "eager_launches_per_layer": None}
        return {"engine": "eager", "eager_launches_per_layer": gen.launches_per_layer}

    def to_dict(self) -> dict[str, Any]:
        d = _plain(asdict(self))
        d.pop("layout_keys")
        if self.off_policy is None:  # on-policy plans' plan.json as before the field existed
            d.pop("off_policy")
        elif self.off_policy.round_tp == "fixed":  # likewise: written only when rounds adapt it
            d["off_policy"].pop("round_tp")
        for task, t in zip(self.tasks, d["tasks"]):  # strategies without ep when it is 1
            t["allocation"]["strategy"] = task.allocation.strategy.to_dict()
        for move, m in zip(self.weight_movements, d["weight_movements"]):
            m["source"]["strategy"] = move.source.strategy.to_dict()
            m["target"]["strategy"] = move.target.strategy.to_dict()
        g = d["generation"]  # in plan.json's order, with the engine's kernels shown where they always were
        d["generation"] = {"batching": g["batching"], "max_batch_size": g["max_batch_size"],
                           "migration": g["migration"], **self.generation_kernels(),
                           "synced_instances": g["synced_instances"], "pad_to_longest": g["pad_to_longest"]}
        for key in ("dispatch", "memory_frac"):  # written only when set, so older plans' plan.json stays as it was
            if g[key] is not None:
                d["generation"][key] = g[key]
        if g["kv_allocation"] != "reserve":  # likewise
            d["generation"]["kv_allocation"] = g["kv_allocation"]
        d["engines"] = None if self.engines is None else self.engines.to_dict()
        d["training"] = [
            {**{k: v for k, v in asdict(s).items()
                if k != "schedule" and not (k == "micro_batch_tokens" and v is None)},  # only when set
             "schedule": schedule_to_dict(s.schedule)}
            for s in self.training
        ]
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        def alloc(a: dict) -> Allocation:
            return Allocation(tuple(a["mesh"]), ParallelStrategy(**a["strategy"]))

        gen = dict(d["generation"])
        for shown in ("engine", "eager_launches_per_layer"):  # the engines' kernels (generation_kernels)
            gen.pop(shown, None)
        if gen.get("migration"):
            gen["migration"] = MigrationPolicy(**gen["migration"])
        if gen.get("dispatch"):
            gen["dispatch"] = LengthDispatch(**gen["dispatch"])
        else:
            gen.pop("dispatch", None)
        # plan.json written before the explicit IR: streaming was a generation flag, movements
        # had no kind (param_sync by name; attached to a non-movement task = per replica)
        legacy_streaming = gen.pop("stream_to_inference", False)
        kinds = {t["name"]: t["kind"] for t in d["tasks"]}
        gen_task = next((t["name"] for t in d["tasks"] if t["kind"] == "generate"), None)

        def movement_kind(w: dict) -> str:
            if "kind" in w:
                return w["kind"]
            if kinds.get(w["task"]) != "weight_movement":
                return MovementKind.PER_REPLICA
            return MovementKind.PARAM_SYNC if w["task"] == "param_sync" else MovementKind.REALLOC

        def stream_from(t: dict) -> Optional[str]:
            if "stream_from" in t:
                return t["stream_from"]
            return gen_task if legacy_streaming and t["kind"] == "inference" else None

        return Plan(
            system=d["system"],
            tasks=[Task(t["name"], t["kind"], t["model"], alloc(t["allocation"]),
                        tuple(t["reads"]), tuple(t["writes"]), stream_from(t)) for t in d["tasks"]],
            training=[TrainingStage(tuple(s["tasks"]), schedule_from_dict(s["schedule"]),
                                    s["num_minibatches"], s["micro_batch_size"], s.get("micro_batch_tokens"))
                      for s in d["training"]],
            generation=GenerationPolicy(**gen),
            weight_movements=[WeightMovement(w["task"], w["model"], alloc(w["source"]), alloc(w["target"]),
                                             movement_kind(w)) for w in d["weight_movements"]],
            resident=[ResidentState(**r) for r in d["resident"]],
            offloaded=list(d.get("offloaded", [])),
            engines=Engines.from_dict(d["engines"]) if d.get("engines") else None,
            global_batch_size=d["global_batch_size"],
            mini_batch_size=d["mini_batch_size"],
            algorithm=d.get("algorithm", "ppo"),  # plan.json written before algorithms were configurable: PPO
            notes=d.get("notes", {}),
            off_policy=OffPolicyPolicy(**d["off_policy"]) if d.get("off_policy") else None,
        )

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))
