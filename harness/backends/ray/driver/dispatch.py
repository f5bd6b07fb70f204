"""How the driver runs a plan's units on the workers: every unit's handler is a :data:`UnitRun`, and one
loop (:func:`drive`) starts units when the project's one scheduler says so
(:class:`harness.planning.scheduler.UnitQueue`) and drives every running handler with the
completions of the calls it waits on.

A handler starts calls on the workers (:class:`~harness.backends.ray.driver.calls.WorkerGroup`),
yields the list of calls it waits on, and is resumed with the first of them to finish (every
result in); it returns when its unit has finished. A handler waits on one call (a weight
movement, an inference pass, a training stage) or on several at a time (a streamed generation
and the inference that consumes it, :mod:`harness.backends.ray.driver.inter_stage`): the loop
collects the calls of every running unit at once, so units on disjoint devices overlap and no
handler blocks another. Everything runs in one thread, and a handler changes the iteration's data
only while the loop runs it.
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Callable

from harness.backends.ray.driver.calls import Call, WorkerGroup
from harness.backends.ray.replies import Result
from harness.core.units import Unit
from harness.planning.scheduler import UnitQueue

# A unit's handler: yields the calls it waits on, is resumed with the first of them to finish, and
# returns when the unit has finished.
UnitRun = Generator[list[Call], Call, None]


def outputs(results: list[Result]) -> list:
    """The outputs of the devices that report (in device order)."""
    return [r.out for r in results if r.out is not None]


@dataclass
class RunningUnit:
    """A started unit: its tasks (and its stream consumer's), the devices it holds, its handler and
    the calls the handler waits on."""
    names: tuple[str, ...]
    devices: set[int]
    run: UnitRun
    waiting: list[Call] = field(default_factory=list)

    def resume(self, done: Call | None) -> bool:
        """Run the handler up to its next wait (``done``: the call that finished, None at the start);
        True when the unit has finished."""
        try:
            self.waiting = self.run.send(done) if done is not None else next(self.run)
        except StopIteration:
            return True
        if not self.waiting:
            raise RuntimeError(f"the handler of tasks {list(self.names)} waits on no call")
        return False


class Dispatcher:
    """The one loop that runs a queue's units (:func:`drive`), resumable: :meth:`run` may stop
    between completions (``until``) with units still running on the workers, and a later
    :meth:`run` carries on with them. ``on_finish(names)`` hears each unit that has finished
    (its tasks, its stream consumer's), before any further unit starts; ``when_idle`` runs
    whenever no unit is running (the driver frees copies of weights whose phase has ended: a call
    on their devices)."""

    def __init__(self, group: WorkerGroup, queue: UnitQueue, start: Callable[[Unit], UnitRun],
                 when_idle: Callable[[], None] = lambda: None,
                 on_finish: Callable[[tuple[str, ...]], None] = lambda names: None):
        self.group, self.queue, self.start = group, queue, start
        self.when_idle, self.on_finish = when_idle, on_finish
        self.running: list[RunningUnit] = []  # in start order

    def _finished(self, entry: RunningUnit) -> None:
        self.running.remove(entry)
        self.queue.finish(entry.names, entry.devices)
        self.on_finish(entry.names)
        if not self.running:
            self.when_idle()

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Start and drive units until ``until()`` holds (checked after every completion, before
        any further unit starts) or every unit has finished."""
        queue, running = self.queue, self.running
        while queue.waiting or running:
            if until():
                return
            unit = queue.next_startable()
            while unit is not None:
                devices = queue.start(unit)
                entry = RunningUnit(queue.names_of(unit), devices, self.start(unit))
                running.append(entry)
                if entry.resume(None):
                    self._finished(entry)
                    if until():
                        return
                unit = queue.next_startable()
            if not running:
                if queue.waiting:
                    raise queue.stuck()
                break
            done = self.group.collect([c for entry in running for c in entry.waiting])
            entry = next(e for e in running if any(c is done for c in e.waiting))
            if entry.resume(done):
                self._finished(entry)


def drive(group: WorkerGroup, queue: UnitQueue, start: Callable[[Unit], UnitRun],
          when_idle: Callable[[], None] = lambda: None) -> None:
    """Run every unit of ``queue``: start each as soon as the readiness rule allows (``start(unit)``
    gives its handler), resume the handler whose call finished, and tell the queue when a unit has
    finished (its tasks ended, its devices free). ``when_idle`` runs whenever no unit is running
    (the driver frees copies of weights whose phase has ended: a call on their devices)."""
    Dispatcher(group, queue, start, when_idle).run()
