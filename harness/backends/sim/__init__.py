"""``backend=sim``: execute a Plan as discrete events over the cost model (docs/DESIGN.md section 4).

The simulator's task models, the scheduler driver and the whole-plan simulation belong to the planning
library (:mod:`harness.planning.simulate`), because planners score candidate plans with the very
same code; this backend is one user of it. It checks the plan's memory once (the report gives KV
capacities and per-device peaks) and simulates each iteration on the harness's batch. It executes
every plan feature. An off-policy plan (``Plan.off_policy``: generation running ahead of training)
is simulated across iterations on one timeline (:mod:`harness.planning.iterations`); iteration
``k``'s trace is then its window of that timeline, and the batches of the iterations ahead are
drawn as the harness draws them (:func:`harness.core.workload.draw_batch`, a pure function of
the workload, seed and iteration).
"""
from __future__ import annotations

from harness.backends.base import Backend
from harness.core.plan import Plan
from harness.planning.offpolicy import OffPolicyTimeline
from harness.planning.memory import MemoryReport, check_plan_memory
from harness.planning.simulate import simulate_iteration
from harness.core.trace import StepTrace
from harness.core.workload import Batch, draw_batch


class SimBackend(Backend):
    simulated = True
    memory: MemoryReport | None = None
    timeline: OffPolicyTimeline | None = None

    def setup(self, plan: Plan) -> None:
        self.memory = check_plan_memory(plan, self.ctx.cost_model, self.ctx.models, self.ctx.workload)
        self.timeline = None

    def run_iteration(self, plan: Plan, iteration: int, batch: Batch) -> StepTrace:
        if self.memory is None:
            self.setup(plan)
        if plan.off_policy is None:
            return simulate_iteration(self.ctx, plan, self.memory, iteration, batch)
        if self.timeline is None or self.timeline.plan is not plan:
            ctx = self.ctx
            self.timeline = OffPolicyTimeline(ctx, plan, self.memory,
                                              lambda k: draw_batch(ctx.workload, ctx.seed, k, ctx.algorithm),
                                              min_iterations=self.cfg.num_iterations)
        return self.timeline.window(iteration)
