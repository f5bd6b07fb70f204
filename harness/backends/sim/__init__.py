"""``backend=sim``: execute a Plan as discrete events over the cost model (DESIGN sections 2, 4).

Tasks run in the plan's dependency order by list scheduling: a task starts when every task it
reads from has ended and every device of its mesh is free (unless the pair is in
``Plan.overlaps``). Each task kind has its own simulation (:mod:`.generation`, :mod:`.passes`);
all of them emit :class:`harness.trace.Span` records on the devices they occupy. Nothing here
depends on which system produced the plan.
"""
from __future__ import annotations

import numpy as np

from harness.backends.base import Backend
from harness.backends.sim.generation import simulate_generation
from harness.backends.sim.passes import (PassResult, simulate_inference, simulate_training,
                                         simulate_weight_movement)
from harness.errors import PlanError
from harness.memory_check import MemoryReport, check_plan_memory
from harness.plan import Plan
from harness.trace import StepTrace
from harness.workload import Batch


class SimBackend(Backend):
    memory: MemoryReport | None = None

    def setup(self, plan: Plan) -> None:
        self.memory = check_plan_memory(plan, self.ctx.cost_model, self.ctx.models, self.ctx.workload)

    def run_iteration(self, plan: Plan, iteration: int, batch: Batch) -> StepTrace:
        if self.memory is None:
            self.setup(plan)
        ctx, cm = self.ctx, self.ctx.cost_model
        trace = StepTrace(iteration=iteration, num_devices=ctx.num_devices)
        deps = plan.dependencies()
        end: dict[str, float] = {}
        device_free = np.zeros(ctx.num_devices)
        stages_by_task = {name: st for st in plan.training for name in st.tasks}
        moves = {m.task: m for m in plan.weight_movements}
        seq_lens = batch.prompt_lens + batch.output_lens
        done_stages: set[int] = set()
        for name in plan.topological_order():
            task = plan.task(name)
            ready = max((end[d] for d in deps[name]), default=0.0)
            mesh = list(task.allocation.mesh)
            start = max(ready, float(device_free[mesh].max()))
            if name in stages_by_task:
                stage = stages_by_task[name]
                if id(stage) in done_stages:
                    continue
                done_stages.add(id(stage))
                meshes = sorted({d for n in stage.tasks for d in plan.task(n).allocation.mesh})
                start = max([start, float(device_free[meshes].max())] +
                            [end[d] for n in stage.tasks for d in deps[n] if d in end])
                result = simulate_training(cm, plan, stage, ctx.models, seq_lens,
                                           ctx.workload.activation_recompute, start)
                for n in stage.tasks:
                    end[n] = result.end_s
                device_free[meshes] = result.end_s
            else:
                result = self._run_task(plan, name, start, batch, seq_lens, moves)
                end[name] = result.end_s
                device_free[mesh] = result.end_s
            trace.spans.extend(result.spans)
            trace.pipelines.extend(result.pipelines)
            trace.samples.extend(result.samples)
        trace.memory_gb = dict(self.memory.peak_gb)
        return trace

    def _run_task(self, plan: Plan, name: str, start: float, batch: Batch, seq_lens: np.ndarray,
                  moves: dict) -> PassResult:
        ctx, cm = self.ctx, self.ctx.cost_model
        task = plan.task(name)
        model = ctx.model(task.model)
        if task.kind == "generate":
            gen = simulate_generation(cm, task, plan.generation, model, batch.prompt_lens, batch.output_lens,
                                      start, self.memory.kv_capacity_gb[name], ctx.workload.max_gen_len)
            spans = [s for inst in gen.instances for s in inst.spans]
            return PassResult(spans, gen.end_s, [], gen.samples)
        if task.kind == "inference":
            return simulate_inference(cm, task, model, seq_lens, ctx.workload.micro_batch_size, start)
        if task.kind == "weight_movement":
            if name not in moves:
                raise PlanError(f"weight-movement task {name} has no WeightMovement in the plan")
            return simulate_weight_movement(cm, moves[name], model, start)
        raise PlanError(f"task {name} of kind {task.kind} is not part of any training stage")
