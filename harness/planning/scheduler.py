"""When a plan's units run: the one readiness rule of the project, for every driver.

A unit (:mod:`harness.interpreter`) may start when every task it reads from has ended and every
device it occupies is free, and no unit earlier in the plan's unit order that is still waiting
occupies any of them (a later unit never jumps an earlier one on shared devices); its devices are
then busy until it releases them (all at its end, or earlier per device: generation instances
freed by long-tail migration, RLHFuse section 4). Units on disjoint devices therefore overlap and
units on shared devices run in plan order.

Two drivers, one rule:

- :class:`ListScheduler` times it: each unit in order starts at ``max(inputs ready, devices
  free)``. The simulator (:mod:`harness.planning.simulate`) and the planners that score candidate
  plans by their makespan (ReaLHF's search, :func:`schedule_durations`) use it.
- :class:`UnitQueue` is the same rule without a clock, driven by events: the real backend asks
  which units may start now and says when each has finished (``backend=ray``'s dispatcher).

For fixed durations the two give the same start times (tested on every system's plan:
``tests/harness/planning/test_scheduler.py``). Which devices a unit occupies is the driver's
one input (a weight movement also occupies its source on ``backend=ray``; issue 27 notes it).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

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


class UnitQueue:
    """The readiness rule (module docstring) driven by events, with no clock. ``units`` in plan
    order (:func:`harness.interpreter.execution_units`); ``devices_of(unit)`` the devices a unit
    occupies. The driver calls :meth:`next_startable` until it returns None, :meth:`start` on each
    unit it starts, and :meth:`finish` when one has finished."""

    def __init__(self, plan: Plan, units: Sequence[Unit], devices_of: Callable[[Unit], Iterable[int]]):
        self.deps = plan.dependencies()
        self.waiting: list[Unit] = list(units)
        self.devices = {id(u): set(devices_of(u)) for u in self.waiting}
        self.finished: set[str] = set()
        self.busy: set[int] = set()
        self.num_running = 0

    def ready(self, unit: Unit) -> bool:
        """Every task the unit reads from (outside the unit) has finished."""
        inside = set(unit.names)
        return all(d in self.finished for n in unit.names for d in self.deps[n] if d not in inside)

    def next_startable(self) -> Unit | None:
        """The first waiting unit that may start now, or None."""
        claimed: set[int] = set()  # devices of earlier units still waiting
        for unit in self.waiting:
            devices = self.devices[id(unit)]
            if self.ready(unit) and not devices & (self.busy | claimed):
                return unit
            claimed |= devices
        return None

    def start(self, unit: Unit) -> set[int]:
        """Mark ``unit`` running; returns the devices it now holds."""
        self.waiting.remove(unit)
        devices = self.devices.pop(id(unit))
        self.busy |= devices
        self.num_running += 1
        return devices

    def finish(self, names: Iterable[str], devices: Iterable[int]) -> None:
        """Tasks ``names`` have finished and ``devices`` are free again (a unit's, at its end)."""
        self.finished.update(names)
        self.busy.difference_update(devices)
        self.num_running -= 1
