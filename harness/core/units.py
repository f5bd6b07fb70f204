"""Execution units of a plan: what a backend starts as one piece of work.

A backend executes a plan as a set of *units*:

- a task on its own (``generate``, ``inference``, ``weight_movement``);
- a training stage: its tasks share one pipeline schedule (two of them when the stage is fused,
  RLHFuse section 5), so they run as one unit of kind ``train``;
- the inference tasks that consume one generate task's stream (``Task.stream_from``, RLHFuse
  section 4): they take samples as generation finishes them, so they run as one unit of kind
  ``inference`` with ``stream_from`` set.

:func:`execution_units` lists them in an order where each comes after the units it reads from.
When a unit starts is the one scheduler's rule (:mod:`harness.planning.scheduler`), which both
backends drive (the simulator with predicted times, the Ray driver with its workers' completions);
each backend then runs a unit through its handler of the unit's :class:`~harness.core.plan.TaskKind`
(:meth:`harness.planning.simulate.PlanSimulator.handlers`,
:meth:`harness.backends.ray.driver.iteration.Iteration.handlers`). Nothing here or in a handler may
branch on a system's or a task's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.errors import PlanError
from harness.core.plan import Plan, Task, TaskKind, TrainingStage


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


def _group(plan: Plan) -> list[Unit]:
    """Tasks grouped into units, in plan order of each unit's first task."""
    units: list[Unit] = []
    covered: set[str] = set()
    for task in plan.tasks:
        if task.name in covered:
            continue
        stage = plan.stage_of(task.name)
        if stage is not None:
            unit = Unit(TaskKind.TRAIN, tuple(plan.task(n) for n in stage.tasks), stage=stage)
        elif task.kind == TaskKind.TRAIN:
            raise PlanError(f"task {task.name} of kind {task.kind} is not part of any training stage")
        elif task.stream_from is not None:
            members = tuple(t for t in plan.tasks if t.stream_from == task.stream_from)
            unit = Unit(TaskKind.INFERENCE, members, stream_from=task.stream_from)
        else:
            unit = Unit(task.kind, (task,))
        covered.update(unit.names)
        units.append(unit)
    return units


def execution_units(plan: Plan) -> list[Unit]:
    """The plan's units in an order where every unit comes after all units its tasks read from.
    Among units whose inputs are ready, the one whose earliest task comes first in
    :meth:`Plan.topological_order` runs first (so plans without groups run in that order)."""
    units = _group(plan)
    position = {name: i for i, name in enumerate(plan.topological_order())}
    unit_of = {name: k for k, unit in enumerate(units) for name in unit.names}
    deps = plan.dependencies()
    needs = [{unit_of[d] for n in unit.names for d in deps[n]} - {k} for k, unit in enumerate(units)]
    key = [min(position[n] for n in unit.names) for unit in units]
    order: list[Unit] = []
    done: set[int] = set()
    while len(done) < len(units):
        ready = [k for k in range(len(units)) if k not in done and needs[k] <= done]
        if not ready:
            stuck = [units[k].label for k in range(len(units)) if k not in done]
            raise PlanError(f"the plan's units {stuck} depend on each other in a cycle (a training stage or a "
                            f"stream group needs the output of a task that needs one of its members)")
        k = min(ready, key=lambda j: key[j])
        done.add(k)
        order.append(units[k])
    return order
