"""The list scheduler: tasks + dependency edges + meshes -> start and end times.

A unit (:mod:`harness.interpreter`) may start when every task it reads from has ended and every
device of its meshes is free; devices are then busy until the unit releases them (all at its end,
or earlier per device: generation instances freed by long-tail migration, RLHFuse section 4).
Tasks on disjoint meshes therefore overlap and tasks on shared devices serialise. This is the one
scheduler of the project: the simulator (:mod:`harness.planning.simulate`) and the planners that
score candidate plans by their makespan (ReaLHF's search) both use it.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from harness.interpreter import Unit, execution_units
from harness.plan import Plan


class ListScheduler:
    def __init__(self, plan: Plan, num_devices: int):
        self.deps = plan.dependencies()
        self.end_s: dict[str, float] = {}
        self.device_free_s = np.zeros(num_devices)

    def ready_s(self, unit: Unit) -> float:
        """When the unit's inputs are ready: the last end among the tasks it depends on."""
        inside = set(unit.names)
        return max((self.end_s[d] for n in unit.names for d in self.deps[n] if d not in inside), default=0.0)

    def free_s(self, devices: Iterable[int]) -> float:
        devices = list(devices)
        return float(self.device_free_s[devices].max()) if devices else 0.0

    def start_s(self, unit: Unit) -> float:
        return max(self.ready_s(unit), self.free_s(unit.devices))

    def finish(self, end_s: dict[str, float], devices: Iterable[int], release_s: float,
               early_release_s: dict[int, float] | None = None) -> None:
        """Record the tasks' ends; ``devices`` are busy until ``release_s`` (or, for those in
        ``early_release_s``, until their own time)."""
        self.end_s.update(end_s)
        self.device_free_s[list(devices)] = release_s
        for device, t in (early_release_s or {}).items():
            self.device_free_s[device] = t

    @property
    def makespan_s(self) -> float:
        return max(self.end_s.values(), default=0.0)


def schedule_durations(plan: Plan, num_devices: int, duration_s: Callable[[Unit], float]) -> ListScheduler:
    """List-schedule ``plan`` with a fixed duration per unit (planners' quick makespan estimate)."""
    sched = ListScheduler(plan, num_devices)
    for unit in execution_units(plan):
        start = sched.start_s(unit)
        end = start + duration_s(unit)
        sched.finish({n: end for n in unit.names}, unit.devices, end)
    return sched
