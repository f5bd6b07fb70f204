"""The plan IR (DESIGN section 3): what a system decides, as data.

A :class:`Plan` is everything a backend needs to execute one PPO iteration, and nothing a backend
may choose by itself:

- the **workflow**: tasks (``gen``, ``ref``, ``reward``, ``values``, ``update_actor``,
  ``update_critic``, and weight-movement tasks ``param_sync``/``realloc_*``) whose dependency
  edges are derived from the data keys each task reads and writes;
- an **allocation** per task: a device mesh and a parallel strategy (dp, tp, pp), checked;
- **training stages**: pipeline schedules (``harness.schedule``) run once per mini-batch;
- a **generation policy** (static or continuous batching, streaming, migration) as data;
- **weight movements** between layouts, so their cost is simulated and their bytes moved for real;
- **resident states**: which model states stay in device memory all iteration (for the memory check);
- **offloaded** models: weights kept in host memory and copied in before each use (ReaLHF);
- **overlaps**: pairs of tasks allowed to share devices at the same time.

Device order inside a mesh is tp fastest, then pp, then dp: mesh index
``(dp_rank * pp + pp_rank) * tp + tp_rank``. Tensor-parallel groups therefore stay inside a node.

Plans round-trip through JSON (``to_json``/``from_json``) and are written to the run folder
before execution.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from harness.errors import PlanError
from harness.schedule.ir import Schedule
from harness.schedule.io import schedule_from_dict, schedule_to_dict

MODEL_ROLES = ("actor", "critic", "ref", "reward")
TASK_KINDS = ("generate", "inference", "train", "weight_movement")


@dataclass(frozen=True)
class ParallelStrategy:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0  # ZeRO sharding of model states across dp (0 = none, 3 = all)

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        zero = f",zero{self.zero_stage}" if self.zero_stage else ""
        return f"dp{self.dp}tp{self.tp}pp{self.pp}{zero}"


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

    def device(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        s = self.strategy
        return self.mesh[(dp_rank * s.pp + pp_rank) * s.tp + tp_rank]

    def stage_devices(self, dp_rank: int, pp_rank: int) -> tuple[int, ...]:
        return tuple(self.device(dp_rank, pp_rank, t) for t in range(self.strategy.tp))

    def replica_devices(self, dp_rank: int) -> tuple[int, ...]:
        s = self.strategy
        start = dp_rank * s.pp * s.tp
        return self.mesh[start:start + s.pp * s.tp]


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # one of TASK_KINDS
    model: str  # one of MODEL_ROLES
    allocation: Allocation
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise PlanError(f"task {self.name}: unknown kind {self.kind!r}, expected one of {TASK_KINDS}")
        if self.model not in MODEL_ROLES:
            raise PlanError(f"task {self.name}: unknown model {self.model!r}, expected one of {MODEL_ROLES}")


@dataclass(frozen=True)
class WeightMovement:
    """Weights of ``model`` move from the ``source`` layout to the ``target`` layout inside task
    ``task`` (``param_sync`` to a separate generation pool, or ``realloc`` between layouts over
    overlapping devices)."""

    task: str
    model: str
    source: Allocation
    target: Allocation


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


@dataclass(frozen=True)
class MigrationPolicy:
    """RLHFuse section 4: when fewer than ``threshold_frac`` of the batch is unfinished, migrate
    the remaining samples to ``num_tail_instances`` instances, moving KV cache or tokens."""

    threshold_frac: float
    num_tail_instances: int
    transfer: str = "kv"  # kv | tokens


@dataclass(frozen=True)
class GenerationPolicy:
    batching: str = "continuous"  # continuous | static (every instance decodes until its longest sample ends)
    max_batch_size: Optional[int] = None  # per instance; None = limited by KV capacity only
    stream_to_inference: bool = False  # finished samples go to inference at once (inter-stage fusion)
    migration: Optional[MigrationPolicy] = None

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise PlanError(f"generation batching must be 'continuous' or 'static', got {self.batching!r}")


@dataclass(frozen=True)
class ResidentState:
    """The state of ``model`` laid out as in task ``task`` stays in device memory all iteration.
    ``what`` is ``train`` (weights, grads, optimizer states) or ``weights`` (bf16 weights only)."""

    model: str
    task: str
    what: str = "weights"


@dataclass
class Plan:
    system: str
    tasks: list[Task]
    training: list[TrainingStage] = field(default_factory=list)
    generation: GenerationPolicy = field(default_factory=GenerationPolicy)
    weight_movements: list[WeightMovement] = field(default_factory=list)
    resident: list[ResidentState] = field(default_factory=list)
    offloaded: list[str] = field(default_factory=list)  # models kept in host memory, loaded per use
    overlaps: list[tuple[str, str]] = field(default_factory=list)
    global_batch_size: int = 512
    mini_batch_size: int = 64
    notes: dict[str, Any] = field(default_factory=dict)  # system-specific facts shown in plan.json

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
        self.topological_order()
        for stage in self.training:
            for name in stage.tasks:
                if self.task(name).kind != "train":
                    raise PlanError(f"training stage lists {name}, which is not a train task")
        for a, b in self.overlaps:
            self.task(a), self.task(b)
        resident_models = {r.model for r in self.resident}
        both = resident_models & set(self.offloaded)
        if both:
            raise PlanError(f"models {sorted(both)} are listed both as resident and as offloaded")

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["training"] = [
            {**{k: v for k, v in asdict(s).items() if k != "schedule"}, "schedule": schedule_to_dict(s.schedule)}
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
        if gen.get("migration"):
            gen["migration"] = MigrationPolicy(**gen["migration"])
        return Plan(
            system=d["system"],
            tasks=[Task(t["name"], t["kind"], t["model"], alloc(t["allocation"]),
                        tuple(t["reads"]), tuple(t["writes"])) for t in d["tasks"]],
            training=[TrainingStage(tuple(s["tasks"]), schedule_from_dict(s["schedule"]),
                                    s["num_minibatches"], s["micro_batch_size"]) for s in d["training"]],
            generation=GenerationPolicy(**gen),
            weight_movements=[WeightMovement(w["task"], w["model"], alloc(w["source"]), alloc(w["target"]))
                              for w in d["weight_movements"]],
            resident=[ResidentState(**r) for r in d["resident"]],
            offloaded=list(d.get("offloaded", [])),
            overlaps=[tuple(o) for o in d["overlaps"]],
            global_batch_size=d["global_batch_size"],
            mini_batch_size=d["mini_batch_size"],
            notes=d.get("notes", {}),
        )

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))
