"""Execution units of a plan, and the one interpreter every backend runs them through.

A backend executes a plan as a sequence of *units*, in dependency order:

- a task on its own (``generate``, ``inference``, ``weight_movement``);
- a training stage: its tasks share one pipeline schedule (two of them when the stage is fused,
  RLHFuse section 5), so they run as one unit of kind ``train``;
- the inference tasks that consume one generate task's stream (``Task.stream_from``, RLHFuse
  section 4): they take samples as generation finishes them, so they run as one unit of kind
  ``inference`` with ``stream_from`` set.

:class:`PlanInterpreter` walks the units and calls one handler per :class:`~harness.plan.TaskKind`.
Backends (the simulator, the Ray driver) subclass it; nothing here or in a handler may branch on a
system's or a task's name.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional

from harness.errors import PlanError
from harness.plan import Plan, Task, TaskKind, TrainingStage


@dataclass(frozen=True)
class Unit:
    kind: TaskKind
    tasks: tuple[Task, ...]
    stage: Optional[TrainingStage] = None  # kind == train
    stream_from: Optional[str] = None  # kind == inference, consuming a stream

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    @property
    def devices(self) -> list[int]:
        return sorted({d for t in self.tasks for d in t.allocation.mesh})

    @property
    def label(self) -> str:
        return "+".join(self.names)


def execution_units(plan: Plan) -> list[Unit]:
    """The plan's units, each placed where its first task falls in :meth:`Plan.topological_order`."""
    units: list[Unit] = []
    covered: set[str] = set()
    for name in plan.topological_order():
        if name in covered:
            continue
        task = plan.task(name)
        stage = plan.stage_of(name)
        if stage is not None:
            unit = Unit(TaskKind.TRAIN, tuple(plan.task(n) for n in stage.tasks), stage=stage)
        elif task.kind == TaskKind.TRAIN:
            raise PlanError(f"task {name} of kind {task.kind} is not part of any training stage")
        elif task.stream_from is not None:
            members = tuple(t for t in plan.tasks if t.stream_from == task.stream_from)
            unit = Unit(TaskKind.INFERENCE, members, stream_from=task.stream_from)
        else:
            unit = Unit(task.kind, (task,))
        covered.update(unit.names)
        units.append(unit)
    return units


class PlanInterpreter(abc.ABC):
    """Runs a plan's units in order through one handler per task kind."""

    @abc.abstractmethod
    def handlers(self) -> dict[TaskKind, Callable[[Unit], Any]]:
        """The handler of each task kind this interpreter executes."""

    def run_units(self, plan: Plan) -> None:
        table = self.handlers()
        for unit in execution_units(plan):
            table[unit.kind](unit)
