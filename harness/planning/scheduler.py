"""When a plan's units run: the one scheduler of the project, for every driver.

A unit (:mod:`harness.core.units`) may start when every task it reads from has ended and every
device it occupies is free, and no unit earlier in the plan's unit order that is still waiting
occupies any of them (a later unit never jumps an earlier one on shared devices); its devices are
then busy until it releases them (all at its end, or earlier per device: generation instances
freed by long-tail migration, RLHFuse section 4). Units on disjoint devices therefore overlap and
units on shared devices run in plan order.

The inference tasks that consume a generate task's stream (``Unit.stream_from``) ride with their
generator: one entry of the queue, in the consumer's place in the unit order (after everything
either reads from), ready when both units' inputs are, on the devices of both, started together
(the consumer takes samples as generation finishes them, on devices as generation releases them).

:class:`UnitQueue` is that rule without a clock, driven by events: a driver asks which units may
start now, and says when tasks have finished and devices were released. Two drivers:

- :func:`run_timed` drives it with predicted times: each started unit's handler returns when its
  tasks end and its devices are released (:class:`Timing`), and the queue is advanced event by
  event in time order. The simulator (:mod:`harness.planning.simulate`) and the planners that
  score candidate plans by their makespan (ReaLHF's search, :func:`schedule_durations`) use it.
- ``backend=ray``'s dispatcher (:mod:`harness.backends.ray.driver.iteration`) drives it with the
  completions of its workers' calls.

Which devices a unit occupies is :func:`unit_devices`, the same for both drivers. Inside a
streamed unit, which inference replica takes which finished samples is :class:`StreamFeed`, the
same for both drivers too (the simulator's streaming model and Ray's streamed generation).
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from harness.errors import PlanError
from harness.core.units import Unit, execution_units
from harness.core.plan import Plan


def unit_devices(plan: Plan, unit: Unit, consumer: Unit | None = None) -> set[int]:
    """The devices a unit occupies while it runs: its tasks' meshes, those of the stream consumer
    that rides with it, and for a weight movement the devices it sends from (its source layout's)."""
    devices = set(unit.devices) | (set(consumer.devices) if consumer is not None else set())
    for name in unit.names:
        move = plan.movement_of(name)
        if move is not None:
            devices |= set(move.source.mesh)
    return devices


class UnitQueue:
    """The readiness rule (module docstring) driven by events, with no clock. ``units`` in plan
    order (:func:`harness.core.units.execution_units`). The driver calls :meth:`next_startable`
    until it returns None and :meth:`start` on each unit it starts; then :meth:`finish` when tasks
    have finished and :meth:`release` when devices are free again (or both at once)."""

    def __init__(self, plan: Plan, units: Sequence[Unit]):
        self.deps = plan.dependencies()
        self.consumers = {u.stream_from: u for u in units if u.stream_from is not None}
        by_name = {u.names[0]: u for u in units if len(u.names) == 1}
        # a generator waits in its consumer's place (its own place left empty)
        self.waiting: list[Unit] = [by_name[u.stream_from] if u.stream_from is not None else u for u in units
                                    if self.consumer_of(u) is None]
        self.devices = {id(u): unit_devices(plan, u, self.consumer_of(u)) for u in self.waiting}
        self.finished: set[str] = set()
        self.busy: set[int] = set()
        # what ran when, for sim-vs-real parity (runner: units.jsonl): labels in start order, and the
        # pairs of units that were running at the same time (one started while the other had not
        # finished all its tasks)
        self.started: list[str] = []
        self.concurrent: set[tuple[str, str]] = set()
        self._running: dict[str, set[str]] = {}  # label -> its (and its consumer's) unfinished tasks

    def consumer_of(self, unit: Unit) -> Unit | None:
        """The inference unit consuming this generate unit's stream, if any (it starts with it)."""
        return self.consumers.get(unit.names[0]) if len(unit.names) == 1 else None

    def names_of(self, unit: Unit) -> tuple[str, ...]:
        """The tasks that start with ``unit``: its own and its stream consumer's."""
        consumer = self.consumer_of(unit)
        return unit.names + (consumer.names if consumer is not None else ())

    def ready(self, unit: Unit) -> bool:
        """Every task the unit (and its stream consumer) reads from outside them has finished."""
        names = self.names_of(unit)
        return all(d in self.finished for n in names for d in self.deps[n] if d not in names)

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
        """Mark ``unit`` (and its stream consumer) running; returns the devices it now holds."""
        self.waiting.remove(unit)
        devices = self.devices.pop(id(unit))
        self.busy |= devices
        self.concurrent.update(tuple(sorted((unit.label, other))) for other in self._running)
        self.started.append(unit.label)
        self._running[unit.label] = set(self.names_of(unit))
        return devices

    def finish(self, names: Iterable[str], devices: Iterable[int] = ()) -> None:
        """Tasks ``names`` have finished; ``devices`` are free again."""
        names = set(names)
        self.finished |= names
        for label in list(self._running):
            self._running[label] -= names
            if not self._running[label]:
                del self._running[label]
        self.release(devices)

    def release(self, devices: Iterable[int]) -> None:
        """``devices`` are free again (a unit's at its end, or some of them earlier)."""
        self.busy.difference_update(devices)

    def stuck(self) -> PlanError:
        return PlanError(f"no unit of {[u.label for u in self.waiting]} can ever start (plan dependencies)")

    def record(self) -> dict[str, list]:
        """What ran when: ``started`` (unit labels in start order) and ``concurrent`` (sorted label
        pairs of units running at the same time); the same for every driver of the same plan whose
        units finish in the same order."""
        return {"started": list(self.started), "concurrent": [list(p) for p in sorted(self.concurrent)]}


class StreamFeed:
    """Which inference replica takes which finished samples of a stream, with no clock (RLHFuse
    section 4: inference consumes samples as generation finishes them).

    A replica of the consumers' shared allocation becomes *available* once generation has released
    all its devices (and, in the simulator, it has fetched the weights it lacks): :meth:`available`.
    An available idle replica takes the next micro-batch (:meth:`take`): up to ``micro_batch_size``
    finished samples in finish order, of those finished by then; the replica idle longest goes first
    (ties: the order the driver reported them in). It is idle again when the driver says so
    (:meth:`done`: the simulator when the replica's first pipeline stage can take the next
    micro-batch, Ray when the replica's calls have returned)."""

    def __init__(self, num_replicas: int, micro_batch_size: int):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.queue: deque[int] = deque()  # finished samples not yet taken, in finish order
        self.idle: deque[int] = deque()  # available replicas with no micro-batch, longest idle first
        self.unavailable = set(range(num_replicas))
        self.num_busy = 0

    def finished(self, sample_ids: Iterable[int]) -> None:
        self.queue.extend(sample_ids)

    def available(self, replica: int) -> None:
        """``replica``'s devices are all free (idempotent)."""
        if replica in self.unavailable:
            self.unavailable.remove(replica)
            self.idle.append(replica)

    def done(self, replica: int) -> None:
        self.num_busy -= 1
        self.idle.append(replica)

    def take(self) -> list[tuple[int, list[int]]]:
        """Every micro-batch that may start now, as (replica, its samples)."""
        out = []
        while self.idle and self.queue:
            replica = self.idle.popleft()
            out.append((replica, [self.queue.popleft() for _ in range(min(self.micro_batch_size, len(self.queue)))]))
            self.num_busy += 1
        return out

    @property
    def drained(self) -> bool:
        """No sample waits and no replica computes."""
        return not self.queue and self.num_busy == 0


@dataclass
class Timing:
    """What a started unit's handler predicts: when each of its tasks ends and when each of its
    devices is released (every device it holds, once)."""
    end_s: dict[str, float]
    release_s: dict[int, float]


@dataclass
class Timeline:
    """The result of :func:`run_timed`: each unit's start, each task's end, each device's last
    release."""
    num_devices: int
    start_s: dict[str, float] = field(default_factory=dict)  # by unit label
    end_s: dict[str, float] = field(default_factory=dict)  # by task name
    device_free_s: np.ndarray = None  # type: ignore[assignment]
    record: dict[str, list] = field(default_factory=dict)  # UnitQueue.record()

    def __post_init__(self):
        if self.device_free_s is None:
            self.device_free_s = np.zeros(self.num_devices)

    @property
    def makespan_s(self) -> float:
        return max(self.end_s.values(), default=0.0)


def run_timed(plan: Plan, num_devices: int, start: Callable[[Unit, float, UnitQueue], Timing],
              units: Sequence[Unit] | None = None) -> Timeline:
    """Drive a :class:`UnitQueue` with predicted times: start every startable unit at the current
    time (``start(unit, now_s, queue)`` returns its :class:`Timing`), then advance to the next
    instant with events (tasks' ends, devices' releases) and apply all of them before starting
    anything at it."""
    queue = UnitQueue(plan, execution_units(plan) if units is None else units)
    timeline = Timeline(num_devices)
    events: list[tuple[float, int, tuple[str, ...], tuple[int, ...]]] = []
    order = itertools.count()
    now = 0.0
    while queue.waiting or events:
        unit = queue.next_startable()
        while unit is not None:
            held = queue.start(unit)
            timeline.start_s[unit.label] = now
            timing = start(unit, now, queue)
            if set(timing.release_s) != held:
                raise PlanError(f"{unit.label} holds devices {sorted(held)} but releases {sorted(timing.release_s)}")
            timeline.end_s.update(timing.end_s)
            for t, names in _by_time(timing.end_s.items()):
                heapq.heappush(events, (t, next(order), names, ()))
            for t, devices in _by_time(timing.release_s.items()):
                heapq.heappush(events, (t, next(order), (), devices))
                timeline.device_free_s[list(devices)] = t
            unit = queue.next_startable()
        if not events:
            if queue.waiting:
                raise queue.stuck()
            break
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, names, devices = heapq.heappop(events)
            queue.finish(names, devices)
    timeline.record = queue.record()
    return timeline


def _by_time(pairs) -> list[tuple[float, tuple]]:
    groups: dict[float, list] = {}
    for key, t in pairs:
        groups.setdefault(t, []).append(key)
    return sorted((t, tuple(keys)) for t, keys in groups.items())


def schedule_durations(plan: Plan, num_devices: int, duration_s: Callable[[Unit], float]) -> Timeline:
    """The plan timed with a fixed duration per unit (planners' quick makespan estimate)."""
    def start(unit: Unit, now: float, queue: UnitQueue) -> Timing:
        end = now + duration_s(unit)
        return Timing({n: end for n in queue.names_of(unit)},
                      {d: end for d in unit_devices(plan, unit, queue.consumer_of(unit))})
    return run_timed(plan, num_devices, start)
