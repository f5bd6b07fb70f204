"""``backend=sim``: execute a Plan as discrete events over the cost model (DESIGN sections 2, 4).

Tasks run in the plan's dependency order by list scheduling: a task starts when every task it
reads from has ended and every device of its mesh is free. With
``GenerationPolicy.stream_to_inference`` the inference tasks instead consume samples as they finish,
on devices as generation releases them (:mod:`.streaming`, RLHFuse section 4). Each task kind has its own simulation (:mod:`.generation`, :mod:`.passes`);
all of them emit :class:`harness.trace.Span` records on the devices they occupy. Nothing here
depends on which system produced the plan.
"""
from __future__ import annotations

import numpy as np

from harness.backends.base import Backend
from harness.backends.sim.generation import simulate_generation
from harness import metrics as mk
from harness.backends.sim.passes import (PassResult, simulate_inference, simulate_training,
                                         simulate_weight_movement)
from harness.backends.sim.streaming import StreamingResult, simulate_streaming_inference
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
        streaming = plan.generation.stream_to_inference
        gen_result = None
        for name in plan.topological_order():
            task = plan.task(name)
            if name in end:  # already simulated together with another task
                continue
            ready = max((end[d] for d in deps[name]), default=0.0)
            mesh = list(task.allocation.mesh)
            start = max(ready, float(device_free[mesh].max()))
            if streaming and task.kind == "inference":
                result = self._run_streaming(plan, gen_result, device_free, moves)
                trace.spans.extend(result.spans)
                for n, t_end in result.end_s.items():
                    end[n] = t_end
                inference_mesh = list(task.allocation.mesh)
                device_free[inference_mesh] = max(result.end_s.values())
                continue
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
                if task.kind == "generate":
                    gen_result = result.generation
                    for d, t_free in gen_result.device_free_s().items():
                        device_free[d] = t_free
                    self._generation_counters(plan, gen_result, trace)
            trace.spans.extend(result.spans)
            trace.pipelines.extend(result.pipelines)
            trace.samples.extend(result.samples)
        trace.memory_gb = dict(self.memory.peak_gb)
        return trace

    def _run_streaming(self, plan: Plan, gen, device_free: np.ndarray, moves: dict) -> StreamingResult:
        if gen is None:
            raise PlanError("stream_to_inference needs the generate task to run before the inference tasks")
        tasks = [t for t in plan.tasks if t.kind == "inference"]
        if len({t.allocation for t in tasks}) != 1:
            raise PlanError("stream_to_inference: ref, reward and values must share one allocation "
                            f"(got {[str(t.allocation.strategy) for t in tasks]})")
        free = {d: float(device_free[d]) for d in tasks[0].allocation.mesh}
        models = {t.model: self.ctx.model(t.model) for t in tasks}
        return simulate_streaming_inference(self.ctx.cost_model, tasks, models, gen.samples, free,
                                            self.ctx.workload.micro_batch_size, moves)

    @staticmethod
    def _generation_counters(plan: Plan, gen, trace: StepTrace) -> None:
        policy = plan.generation.migration
        if policy is None:
            return
        trace.counters[mk.MIGRATED_SAMPLES] = gen.migrated_samples
        trace.counters[mk.TAIL_INSTANCES] = gen.tail_instances
        trace.counters[mk.MIGRATION_THRESHOLD_FRAC] = policy.threshold_frac

    def _run_task(self, plan: Plan, name: str, start: float, batch: Batch, seq_lens: np.ndarray,
                  moves: dict) -> PassResult:
        ctx, cm = self.ctx, self.ctx.cost_model
        task = plan.task(name)
        model = ctx.model(task.model)
        if task.kind == "generate":
            gen = simulate_generation(cm, task, plan.generation, model, batch.prompt_lens, batch.output_lens,
                                      start, self.memory.kv_capacity_gb[name], ctx.workload.max_gen_len)
            spans = [s for inst in gen.instances for s in inst.spans]
            return PassResult(spans, gen.end_s, [], gen.samples, generation=gen)
        if task.kind == "inference":
            return simulate_inference(cm, task, model, seq_lens, ctx.workload.micro_batch_size, start,
                                      offloaded=task.model in plan.offloaded)
        if task.kind == "weight_movement":
            if name not in moves:
                raise PlanError(f"weight-movement task {name} has no WeightMovement in the plan")
            return simulate_weight_movement(cm, moves[name], model, start)
        raise PlanError(f"task {name} of kind {task.kind} is not part of any training stage")
