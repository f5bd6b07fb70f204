"""Off-policy plans in the simulator, whichever way their generation runs ahead: the windows the
sim backend reports (:class:`OffPolicyTimeline`) and the steady-state step planners score
(:func:`steady_step_s`), over a batched rollout (:mod:`harness.planning.iterations`), a continuous
one (:mod:`harness.planning.rollout`) or a partial one (:mod:`harness.planning.partial`)."""
from __future__ import annotations

import dataclasses
from typing import Callable

from harness.core.plan import Plan, TaskKind
from harness.core.trace import StepTrace
from harness.core.workload import Batch
from harness.planning.iterations import OffPolicyRun, iteration_windows, run_off_policy, weights_feeders
from harness.planning.memory import MemoryReport
from harness.planning.partial import run_partial
from harness.planning.rollout import run_continuous
from harness.planning.simulate import PlanSimulator
from harness.system import PlanContext


class OffPolicyTimeline:
    """The iteration windows of an off-policy plan, simulated once to a horizon and extended (from
    scratch, to at least twice the horizon) when an iteration past it is asked for; earlier windows
    do not change (module docstring)."""

    def __init__(self, ctx: PlanContext, plan: Plan, memory: MemoryReport, batch_of: Callable[[int], Batch],
                 min_iterations: int = 1):
        self.ctx, self.plan, self.memory, self.batch_of = ctx, plan, memory, batch_of
        self.min_iterations = max(1, min_iterations)
        self.windows: list[StepTrace] = []

    def window(self, iteration: int) -> StepTrace:
        if iteration >= len(self.windows):
            count = max(iteration + 1, self.min_iterations, 2 * len(self.windows))
            run, lookahead = simulate_off_policy(self.ctx, self.plan, self.memory, self.batch_of, count)
            self.windows = iteration_windows(run, self.memory, count, lookahead)
        return self.windows[iteration]


def simulate_off_policy(ctx: PlanContext, plan: Plan, memory: MemoryReport, batch_of: Callable[[int], Batch],
                        num_windows: int, record_spans: bool = True) -> tuple[OffPolicyRun, int]:
    """An off-policy run long enough for ``num_windows`` windows, by the plan's rollout (batched:
    :func:`run_off_policy`, ``max_staleness`` iterations beyond them; continuous:
    :func:`harness.planning.rollout.run_continuous`), and the iterations it holds beyond them."""
    if plan.off_policy.rollout == "continuous":
        return run_continuous(ctx, plan, memory, batch_of, num_windows, record_spans), 0
    if plan.off_policy.rollout in ("partial", "tail_batching"):
        return run_partial(ctx, plan, memory, batch_of, num_windows, record_spans), 0
    s = plan.off_policy.max_staleness
    return run_off_policy(ctx, plan, memory, batch_of, num_windows + s, record_spans), s


def steady_step_s(ctx: PlanContext, plan: Plan, memory: MemoryReport, batch: Batch) -> float:
    """What planners score an off-policy plan by: the period of its pipeline, from one synchronous
    iteration of the plan on ``batch`` (``F + max(G, R)``: the weight movement into generation, then
    generation beside the rest of the iteration, log-probs and training; the plain iteration time
    when generation may not run ahead or under partial rollout, whose iterations do not overlap).
    For batched rollout with the same batch every iteration this is the simulated steady-state step
    (tested against :func:`simulated_steady_step_s`); continuous rollout's is no longer (it overlaps
    more). One iteration's simulation, where the multi-iteration one would take a search at 4,096
    GPUs minutes."""
    sync = dataclasses.replace(plan, off_policy=None)
    simulator = PlanSimulator(ctx, sync, memory, 0, batch, record_spans=False)
    simulator.run()
    end = simulator.timeline.end_s
    makespan = simulator.timeline.makespan_s
    if plan.off_policy.max_staleness == 0 or plan.off_policy.rollout in ("partial", "tail_batching"):
        return makespan
    (gen,) = plan.tasks_of(TaskKind.GENERATE)
    moved = max((end[f] for f in weights_feeders(plan, gen)), default=0.0)
    return moved + max(end[gen.name] - moved, makespan - end[gen.name])


def simulated_steady_step_s(ctx: PlanContext, plan: Plan, memory: MemoryReport, batch: Batch) -> float:
    """The interval between training steps of off-policy ``plan`` in steady state, every iteration
    on ``batch``, simulated: the last of ``2 s + 2`` windows (``s`` = ``max_staleness``), when the
    pipeline has long been full (of 4 under partial rollout, whose carried pool settles within a
    few iterations)."""
    s = plan.off_policy.max_staleness
    count = 4 if plan.off_policy.rollout in ("partial", "tail_batching") else 2 * s + 2
    run, _ = simulate_off_policy(ctx, plan, memory, lambda k: batch, count, record_spans=False)
    return run.train_end_s[count - 1] - run.train_end_s[count - 2]
