"""Off-policy plans on ``backend=ray`` (driver side): generation running ahead of training on older
weights, for real (``Plan.off_policy`` with batched rollout: verl's one-step off-policy recipe,
NeMo-RL's asynchronous GRPO).

The driver runs the same unrolled units as the simulator
(:func:`harness.planning.iterations.unrolled_units`: the plan's units repeated for every iteration
of the run, iteration ``k``'s generation waiting for the weight movement that carries version
``k - s``, listed with iteration ``k - s`` so that it runs beside that iteration's training on
devices of its own), started by the project's one scheduler as their calls complete
(:class:`~.dispatch.Dispatcher`). Each unit is run by the handler of its kind of its own
iteration (an :class:`~.iteration.Iteration` per iteration, all on one clock), so while
iteration ``k`` trains, the generation workers already generate iteration ``k + 1``'s batch with
the weights they hold, and the movement of the new weights into them (the plan's
``param_sync``) runs once they have finished it and training has ended: the weights are pushed
to the generation workers while the next generations run ahead of them.

Versions and the bound: a generation never refreshes its copy of the weights
(:meth:`~.iteration.Iteration.stale_weights`); the version it holds (the training steps before
the movement that filled it) is recorded on every sample (``SampleRecord.first_version`` /
``last_version``), and a version more than ``max_staleness`` behind the iteration is an error.
The order is the simulator's, so the versions are the simulator's for the same plan (tested).

Windows: iteration ``k``'s StepTrace is the window between the end of iteration ``k - 1``'s
training and the end of iteration ``k``'s, built as the simulator builds it
(:func:`harness.planning.iterations.window_trace`): every span reported on the run's clock,
clipped to it. :meth:`OffPolicyExecution.window` drives the units until iteration ``k``'s
training has ended and every unit started before then has finished (so their spans are in),
then returns; units started since keep running on the workers, and the next call carries on
with them. The weight digest of iteration ``k`` is taken the moment its training has finished,
before any further unit starts. Weight copies stay where the movements put them for the whole
run (the generation workers keep their weights, as the recipe's rollout engines do).
"""
from __future__ import annotations

import time

from harness.backends.ray.driver.dispatch import Dispatcher, UnitRun
from harness.backends.ray.driver.iteration import Iteration
from harness.core import metrics as mk
from harness.core.plan import Plan, TaskKind
from harness.core.trace import StepTrace
from harness.core.units import Unit
from harness.core.workload import draw_batch
from harness.planning.iterations import tagged, unrolled_units, window_trace
from harness.planning.scheduler import UnitQueue


class OffPolicyExecution:
    """Iterations ``0 .. num_iterations - 1`` of off-policy ``plan`` on ``backend``'s workers
    (:class:`~.backend.RayBackend`), one window at a time (module docstring)."""

    def __init__(self, backend, plan: Plan, num_iterations: int):
        self.backend, self.plan, self.num_iterations = backend, plan, num_iterations
        self.unrolled = unrolled_units(plan, num_iterations)
        self.queue = UnitQueue(self.unrolled.plan, self.unrolled.order)  # type: ignore[arg-type]
        self.dispatcher = Dispatcher(backend.group, self.queue, self._start, on_finish=self._finished)
        self.trains = [t.name for t in plan.tasks_of(TaskKind.TRAIN)]
        self.iterations: dict[int, Iteration] = {}
        self.unit_start_s: dict[str, float] = {}  # label -> when the driver started it, on the run's clock
        self.unfinished: set[str] = set()  # labels started and not finished
        self.label_of = {name: u.label for u in self.unrolled.order for name in u.names}
        self.t0 = time.time()
        self.next_window = 0

    def iteration(self, k: int) -> Iteration:
        """Iteration ``k``'s data and trace, made when its first unit starts: its batch is drawn as
        the harness draws it (a pure function of the workload, seed and iteration)."""
        if k not in self.iterations:
            ctx = self.backend.ctx
            it = Iteration(self.backend, self.plan, k, draw_batch(ctx.workload, ctx.seed, k, ctx.algorithm), self.t0)
            it.prepare()
            self.iterations[k] = it
        return self.iterations[k]

    def _start(self, unit: Unit) -> UnitRun:
        k, own = self.unrolled.original[unit.label]
        self.unit_start_s[unit.label] = time.time() - self.t0
        self.unfinished.add(unit.label)
        return self.iteration(k).handlers()[own.kind](own)

    def _finished(self, names: tuple[str, ...]) -> None:
        self.unfinished.discard(self.label_of[names[0]])
        k, _ = self.unrolled.original[self.label_of[names[0]]]
        it = self.iterations[k]
        if self.backend.opts.digest and self._trained(k):  # the weights this training made, before anything else
            it.digest()

    def _trained(self, k: int) -> bool:
        return all(tagged(n, k) in self.queue.finished for n in self.trains)

    def train_end_s(self, k: int) -> float:
        """When iteration ``k``'s training ended on the workers (its spans' end), on the run's clock."""
        return max(span.end_s for span in self.iterations[k].trace.spans if span.task in self.trains)

    def window(self, k: int) -> StepTrace:
        """Iteration ``k``'s window (module docstring); windows are asked for in order."""
        if k != self.next_window or k >= self.num_iterations:
            raise RuntimeError(f"backend=ray runs an off-policy plan's {self.num_iterations} iterations in order "
                               f"(backend.num_iterations); iteration {k} was asked for, {self.next_window} is next")
        calls_before = self.backend.group.num_calls

        def done() -> bool:
            if not self._trained(k):
                return False
            end = self.train_end_s(k)
            return not any(self.unit_start_s[label] < end for label in self.unfinished)

        self.dispatcher.run(until=done)
        self.next_window += 1
        lo, hi = (self.train_end_s(k - 1) if k else 0.0), self.train_end_s(k)
        return recorded_window(k, lo, hi, [it.trace for it in self.iterations.values()], self.iterations[k].trace,
                               self.iterations[k].gen_version, self.unit_start_s, sorted(self.queue.concurrent),
                               self.backend.group.num_calls - calls_before)


    def close(self) -> None:
        """Nothing of the run stays open on the workers between its units."""


def recorded_window(k: int, lo: float, hi: float, recordings: list[StepTrace], own: StepTrace, version: int | None,
                    unit_start_s: dict[str, float], concurrent: list, driver_calls: int) -> StepTrace:
    """Iteration ``k``'s window [``lo``, ``hi``) of a real off-policy run: the simulator's
    :func:`~harness.planning.iterations.window_trace` over every span the workers reported
    (``recordings``: every trace recorded so far), with their memory peaks so far (whichever
    iteration's tasks they were), the driver's calls in the window, and iteration ``k``'s own extras."""
    spans = [span for recorded in recordings for span in recorded.spans]
    trace = window_trace(k, lo, hi, spans, own, version, unit_start_s, concurrent)
    for recorded in recordings:
        for rank, gb in recorded.memory_gb.items():
            trace.memory_gb[rank] = max(trace.memory_gb.get(rank, 0.0), gb)
    trace.counters[mk.DRIVER_CALLS] = float(driver_calls)
    trace.extra.update({key: value for key, value in own.extra.items() if key not in trace.extra})
    return trace
