"""Device-memory feasibility of a plan (DESIGN section 4), checked before anything runs.

For every task and every device of its mesh: memory = states resident on that device all
iteration (``Plan.resident``) + the task's working set:

- generate: the generation copy of the weights (unless resident) + the KV cache of at least one
  maximum-length sample (prompt cap + ``max_gen_len``); the rest of memory is KV capacity;
- inference: weights (unless resident) + one layer's forward activations for a micro-batch;
- train: weights, gradients and optimizer states (unless resident) + the schedule's peak in-flight
  activations (Korthikanti et al. 2022), from ``simulate`` of the plan's pipeline schedule.

A plan that does not fit raises :class:`PlanMemoryError` naming the task, the device and every
term of the sum. The same numbers are what the simulator reports as per-device memory peaks.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from harness.costmodel import CostModel
from harness.errors import PlanMemoryError
from harness.plan import Allocation, Plan, Task
from harness.schedule import PipeCosts, simulate


@dataclass
class MemoryReport:
    capacity_gb: float
    peak_gb: dict[int, float] = field(default_factory=dict)  # device -> worst task's total
    task_peak_gb: dict[str, float] = field(default_factory=dict)  # task -> its worst device's total
    kv_capacity_gb: dict[str, float] = field(default_factory=dict)  # generate task -> free memory for KV per device


def _state_gb(cm: CostModel, model, alloc: Allocation, what: str) -> float:
    s = alloc.strategy
    if what == "train":
        return cm.training_state_gb(model, s.dp, s.tp, s.pp, s.zero_stage)
    weights = cm.weights_gb(model, s.tp, s.pp)
    return weights / s.dp if s.zero_stage == 3 else weights


def max_seq_len(ctx_workload) -> int:
    return int(ctx_workload.prompt_len.max + ctx_workload.max_gen_len)


def training_activation_gb(plan: Plan, cm: CostModel, models, workload) -> dict[str, float]:
    """Peak in-flight activation GB per device of each train task, from its stage's schedule."""
    out: dict[str, float] = {}
    seq = max_seq_len(workload)
    for stage in plan.training:
        costs = {}
        for pipe in stage.schedule.pipes.values():
            task = plan.task(next(t for t in stage.tasks if plan.task(t).model == pipe.model))
            s = task.allocation.strategy
            layers = getattr(models, pipe.model).num_layers / pipe.num_stages
            act = cm.activation_gb(getattr(models, pipe.model), stage.micro_batch_size, seq, s.tp,
                                   layers, workload.activation_recompute)
            costs[pipe.name] = PipeCosts.uniform(pipe.num_stages, 1.0, 2.0, act)
        peak = max(simulate(stage.schedule, costs, record_times=False).peak_memory.values())
        for name in stage.tasks:
            out[name] = peak
    return out


def _working_set_gb(task: Task, cm: CostModel, models, workload, resident_here: bool,
                    train_act_gb: dict[str, float]) -> dict[str, float]:
    model = getattr(models, task.model)
    s = task.allocation.strategy
    terms: dict[str, float] = {}
    if task.kind == "generate":
        if not resident_here:
            terms[f"{task.model} weights (tp{s.tp} pp{s.pp})"] = cm.weights_gb(model, s.tp, s.pp)
        terms["KV cache of one max-length sample"] = cm.kv_cache_gb(model, max_seq_len(workload), s.tp, s.pp)
    elif task.kind == "inference":
        if not resident_here:
            terms[f"{task.model} weights (tp{s.tp} pp{s.pp})"] = _state_gb(cm, model, task.allocation, "weights")
        terms["forward activations (1 layer)"] = cm.activation_gb(
            model, workload.micro_batch_size, max_seq_len(workload), s.tp, 1, "none")
    elif task.kind == "train":
        if not resident_here:
            terms[f"{task.model} train states ({s})"] = _state_gb(cm, model, task.allocation, "train")
        terms["peak in-flight activations"] = train_act_gb.get(task.name, 0.0)
    return terms


def check_plan_memory(plan: Plan, cm: CostModel, models, workload) -> MemoryReport:
    capacity = cm.hbm_capacity_gb
    resident: dict[int, list[tuple[str, float]]] = defaultdict(list)
    resident_keys: set[tuple[str, str]] = set()
    for r in plan.resident:
        task = plan.task(r.task)
        gb = _state_gb(cm, getattr(models, r.model), task.allocation, r.what)
        resident_keys.add((r.model, r.task))
        for d in task.allocation.mesh:
            resident[d].append((f"resident {r.model} {r.what} ({task.allocation.strategy})", gb))
    train_act = training_activation_gb(plan, cm, models, workload)
    report = MemoryReport(capacity_gb=capacity)
    for task in plan.tasks:
        if task.kind == "weight_movement":
            continue
        resident_here = (task.model, task.name) in resident_keys
        working = _working_set_gb(task, cm, models, workload, resident_here, train_act)
        worst = 0.0
        for d in task.allocation.mesh:
            total = sum(gb for _, gb in resident[d]) + sum(working.values())
            worst = max(worst, total)
            report.peak_gb[d] = max(report.peak_gb.get(d, 0.0), total)
            if total > capacity:
                terms = [f"{name} {gb:.1f} GB" for name, gb in resident[d]]
                terms += [f"{name} {gb:.1f} GB" for name, gb in working.items()]
                raise PlanMemoryError(
                    f"plan of {plan.system} does not fit in device memory: task {task.name} "
                    f"({task.allocation.strategy}) on device {d} needs {total:.1f} GB but only "
                    f"{capacity:.1f} GB is usable ({cm.gpu.hbm_gb:g} GB x "
                    f"{cm.gpu.usable_memory_frac:g}); it holds: {'; '.join(terms)}. Use more devices "
                    f"(cluster.num_nodes), a smaller model, a smaller micro-batch or more recomputation.")
        report.task_peak_gb[task.name] = worst
        if task.kind == "generate":
            used = max(sum(gb for _, gb in resident[d]) for d in task.allocation.mesh)
            weights = sum(v for k, v in working.items() if "weights" in k)
            report.kv_capacity_gb[task.name] = capacity - used - weights
    return report
