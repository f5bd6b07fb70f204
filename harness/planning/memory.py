"""Device-memory feasibility of a plan (docs/DESIGN.md section 4), checked before anything runs.

For every task and every device of its mesh: memory = states resident on that device all
iteration (``Plan.resident``) + the task's working set:

- generate: the generation copy of the weights (unless resident; on ZeRO-3 shards in place, two gathered
  layers) + the KV cache of at least one
  maximum-length sample (prompt cap + ``max_gen_len``); the rest of memory is KV capacity, at most
  the engine's share of the device (``GenerationPolicy.memory_frac``, vLLM's
  ``gpu_memory_utilization``) less its weights;
- inference: weights (unless resident) + one layer's forward activations for a micro-batch (without
  the attention scores where the training engine's attention is fused: :func:`fused_attention`);
- train: weights, gradients and optimizer states (unless resident) + the schedule's peak in-flight
  activations (Korthikanti et al. 2022): the running sum over each rank's list of the plan's pipeline
  schedule (``list_order_peak_memory``, the peak ``simulate`` reports, without timing).

A plan that does not fit raises :class:`PlanMemoryError` naming the task, the device and every
term of the sum. The same numbers are what the simulator reports as per-device memory peaks.

Planners keep their choices inside these limits with a :class:`MemoryLedger`: the same terms,
counted as each layout is chosen (:class:`MemoryNeed`: what a choice keeps resident and what its
task holds beside that while it runs), plus a reservation for the cheapest way to make every choice
still to come, so that no choice leaves too little memory for the ones after it.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import numpy as np

from harness.costmodel import CostModel
from harness.errors import PlanError, PlanMemoryError
from harness.core.plan import Allocation, Plan, Task
from harness.schedule import PipeCosts, list_order_peak_memory
from harness.planning.packing import samples_at_longest


@dataclass
class MemoryReport:
    capacity_gb: float
    peak_gb: dict[int, float] = field(default_factory=dict)  # device -> worst task's total
    task_peak_gb: dict[str, float] = field(default_factory=dict)  # task -> its worst device's total
    kv_capacity_gb: dict[str, float] = field(default_factory=dict)  # generate task -> free memory for KV per device


def state_gb(cm: CostModel, model, s, what: str, optimizer_offload: bool = False) -> float:
    """A model's ``train`` state (weights, gradients, optimizer; without the optimizer states when the
    training engine offloads them to host memory, ZeRO-Offload) or ``weights`` in strategy ``s`` (a
    MoE model's routed experts split over ``s.ep``; ZeRO-3 shards the ep ranks' experts over the
    ``dp / ep`` ranks that hold the same ones, which is ``1 / dp`` of them as without ep)."""
    if what == "train":
        return cm.training_state_gb(model, s.dp, s.tp, s.pp, s.zero_stage, optimizer_offload, s.ep, s.etp)
    if s.zero_stage == 3:
        return cm.weights_gb(model, s.tp, s.pp) / s.dp
    return cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp)


def layout_label(s) -> str:
    """``tp<T> pp<P>`` (with `` ep<E>`` under expert parallelism, `` etp<X>`` with expert tensor
    parallelism): the layout a weights term names."""
    etp = f" etp{s.etp}" if s.etp is not None else ""
    return f"tp{s.tp} pp{s.pp}" + (f" ep{s.ep}" if s.ep != 1 else "") + etp


def _state_gb(cm: CostModel, model, alloc: Allocation, what: str, optimizer_offload: bool = False) -> float:
    return state_gb(cm, model, alloc.strategy, what, optimizer_offload)


def max_seq_len(ctx_workload) -> int:
    return int(ctx_workload.prompt_len.max + ctx_workload.max_gen_len)


def fused_attention(engines) -> bool:
    """Whether the training engine's attention is fused (FlashAttention-style: its score matrices
    never reach memory; ``attention_score_bytes_forward`` 0): what the forward passes on its
    layouts hold. False without engines (the cost model's ops as they are: eager attention)."""
    return engines is not None and engines.training.attention_score_bytes_forward == 0


def inference_activation_gb(cm: CostModel, model, s, workload, fused: bool = False) -> float:
    """Forward activations an inference task holds: one layer of one micro-batch at the longest
    sequence (its attention scores too unless the attention is ``fused``)."""
    return cm.activation_gb(model, microbatch_samples(workload), max_seq_len(workload), s.tp, 1, "none",
                            fused_attention=fused)


def microbatch_samples(workload) -> float:
    """Samples of the longest length one of the workload's micro-batches holds (a packed one: its
    token budget's worth, :func:`harness.planning.packing.samples_at_longest`)."""
    return samples_at_longest(workload.micro_batch_size, workload.micro_batch_tokens, max_seq_len(workload))


def kv_one_sample_gb(cm: CostModel, model, s, workload) -> float:
    """KV cache of one maximum-length sample: the least a generate task needs beside its weights."""
    return cm.kv_cache_gb(model, max_seq_len(workload), s.tp, s.pp)


def one_f_one_b_activation_gb(cm: CostModel, model, s, workload, num_mbs: int) -> float:
    """Peak in-flight activations of a single-pipe 1F1B stage: its first stage holds min(pp, M)
    micro-batches of ``layers / pp`` layers (what :func:`training_activation_gb` counts)."""
    return min(s.pp, num_mbs) * cm.activation_gb(model, microbatch_samples(workload), max_seq_len(workload), s.tp,
                                                 model.num_layers / s.pp, workload.activation_recompute)


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
            act = cm.activation_gb(getattr(models, pipe.model),
                                   samples_at_longest(stage.micro_batch_size, stage.micro_batch_tokens, seq), seq, s.tp,
                                   layers, workload.activation_recompute)
            costs[pipe.name] = PipeCosts.uniform(pipe.num_stages, 1.0, 2.0, act)
        peak = max(list_order_peak_memory(stage.schedule, costs).values())
        for name in stage.tasks:
            out[name] = peak
    return out


def _working_set_gb(task: Task, cm: CostModel, models, workload, resident_here: bool,
                    train_act_gb: dict[str, float], optimizer_offload: bool = False,
                    fused: bool = False) -> dict[str, float]:
    model = getattr(models, task.model)
    s = task.allocation.strategy
    terms: dict[str, float] = {}
    if task.kind == "generate":
        if s.zero_stage == 3 and resident_here:  # generate() on ZeRO-3 shards in place: the shards are the resident
            # training state; a layer is gathered at a time, the next one prefetched
            terms[f"{task.model} weights gathered (2 layers, zero3)"] = \
                2 * cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp) / model.num_layers
        elif not resident_here:
            terms[f"{task.model} weights ({layout_label(s)})"] = cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp)
        terms["KV cache of one max-length sample"] = kv_one_sample_gb(cm, model, s, workload)
    elif task.kind == "inference":
        if not resident_here:
            terms[f"{task.model} weights ({layout_label(s)})"] = _state_gb(cm, model, task.allocation, "weights")
        terms["forward activations (1 layer)"] = inference_activation_gb(cm, model, s, workload, fused)
    elif task.kind == "train":
        if not resident_here:
            terms[f"{task.model} train states ({s})"] = _state_gb(cm, model, task.allocation, "train",
                                                                   optimizer_offload)
        terms["peak in-flight activations"] = train_act_gb.get(task.name, 0.0)
    return terms


def check_plan_memory(plan: Plan, cm: CostModel, models, workload) -> MemoryReport:
    capacity = cm.hbm_capacity_gb
    offload = plan.engines is not None and plan.engines.training.optimizer_offload  # ZeRO-Offload
    resident: dict[int, list[tuple[str, float]]] = defaultdict(list)
    resident_keys: set[tuple[str, str]] = set()
    for r in plan.resident:
        task = plan.task(r.task)
        gb = _state_gb(cm, getattr(models, r.model), task.allocation, r.what, offload)
        resident_keys.add((r.model, r.task))
        term = f"resident {r.model} {r.what} ({task.allocation.strategy})"
        for d in task.allocation.mesh:
            resident[d].append((term, gb))
    # A device's resident total, summed once (in the order the states were listed), and each task's
    # devices as one array operation: at 4,096 devices the per-device, per-task Python loop was most
    # of ReaLHF's search. NumPy's float64 addition and maximum are Python's, so the
    # numbers are the same.
    resident_gb = {d: sum(gb for _, gb in held) for d, held in resident.items()}
    num_devices = 1 + max((max(t.allocation.mesh) for t in plan.tasks if t.allocation.mesh), default=-1)
    resident_arr = np.zeros(num_devices)
    for d, gb in resident_gb.items():
        resident_arr[d] = gb
    peak_arr = np.zeros(num_devices)
    seen = np.zeros(num_devices, dtype=bool)
    first_seen: list[np.ndarray] = []  # devices in the order the tasks first touch them
    all_devices = np.arange(num_devices)
    train_act = training_activation_gb(plan, cm, models, workload)
    report = MemoryReport(capacity_gb=capacity)
    for task in plan.tasks:
        if task.kind == "weight_movement":
            continue
        resident_here = (task.model, task.name) in resident_keys or any(  # e.g. generate() in place on
            r.model == task.model and plan.task(r.task).allocation == task.allocation  # the training module
            for r in plan.resident)
        working = _working_set_gb(task, cm, models, workload, resident_here, train_act, offload,
                                  fused_attention(plan.engines))
        working_gb = sum(working.values())
        mesh = _device_index(task.allocation.mesh)
        totals = resident_arr[mesh] + working_gb
        worst = max(0.0, float(totals.max())) if totals.size else 0.0
        if worst > capacity:
            d = next(d for d in task.allocation.mesh if resident_gb.get(d, 0) + working_gb > capacity)
            total = resident_gb.get(d, 0) + working_gb
            terms = [f"{name} {gb:.1f} GB" for name, gb in resident.get(d, ())]
            terms += [f"{name} {gb:.1f} GB" for name, gb in working.items()]
            raise PlanMemoryError(
                f"plan of {plan.system} does not fit in device memory: task {task.name} "
                f"({task.allocation.strategy}) on device {d} needs {total:.1f} GB but only "
                f"{capacity:.1f} GB is usable ({cm.gpu.hbm_gb:g} GB x "
                f"{cm.gpu.usable_memory_frac:g}); it holds: {'; '.join(terms)}. Use more devices "
                f"(cluster.num_nodes), a smaller model, a smaller micro-batch or more recomputation.")
        devices = all_devices[mesh]
        new = devices[~seen[devices]]
        if new.size:
            first_seen.append(new)
            seen[new] = True
        peak_arr[mesh] = np.maximum(peak_arr[mesh], totals)
        report.task_peak_gb[task.name] = worst
        if task.kind == "generate":
            used = float(resident_arr[mesh].max())
            weights = sum(v for k, v in working.items() if "weights" in k)
            report.kv_capacity_gb[task.name] = capacity - used - weights
            if plan.generation.memory_frac is not None:
                report.kv_capacity_gb[task.name] = min(report.kv_capacity_gb[task.name],
                                                       _engine_share_kv_gb(plan, task, cm, models, workload))
    for new in first_seen:
        report.peak_gb.update(zip(new.tolist(), peak_arr[new].tolist()))
    return report


def _engine_share_kv_gb(plan: Plan, task: Task, cm: CostModel, models, workload) -> float:
    """The KV cache the generation engine's share of a device holds (vLLM's
    ``gpu_memory_utilization`` x the device's memory less the engine's weights); raises
    PlanMemoryError when it holds less than one maximum-length sample."""
    s, model = task.allocation.strategy, getattr(models, task.model)
    frac = plan.generation.memory_frac
    weights_gb = cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp)
    kv_gb = frac * cm.gpu.hbm_gb - weights_gb
    one_sample_gb = kv_one_sample_gb(cm, model, s, workload)
    if kv_gb < one_sample_gb:
        raise PlanMemoryError(
            f"plan of {plan.system}: task {task.name} ({s}) gives its generation engine {frac:g} of each "
            f"device's {cm.gpu.hbm_gb:g} GB ({frac * cm.gpu.hbm_gb:.1f} GB), which holds the {task.model} weights "
            f"({weights_gb:.1f} GB) but not the KV cache of one maximum-length sample ({one_sample_gb:.2f} GB); "
            f"raise the generation engine's memory share (gpu_memory_utilization) or its tensor parallelism")
    return kv_gb


def _device_index(mesh: tuple[int, ...]):
    """``mesh`` as an index into per-device arrays: a slice when it is a contiguous ascending range
    (every mesh the planners build), else an integer array."""
    if mesh and mesh[-1] - mesh[0] + 1 == len(mesh) and mesh == tuple(range(mesh[0], mesh[-1] + 1)):
        return slice(mesh[0], mesh[-1] + 1)
    return np.asarray(mesh, dtype=np.int64)


# ---- planning: the same terms, counted while layouts are chosen ------------------------------

@dataclass(frozen=True)
class MemoryNeed:
    """What one planning choice holds on every device of its pool (the worst device of its layout,
    as :func:`check_plan_memory` counts it): ``resident`` states by model, which stay all iteration,
    and the ``working`` set by task, which the task holds beside every resident state while it runs
    (tasks on the same devices run one at a time, so working sets do not add up)."""

    resident: Mapping[str, float] = field(default_factory=dict)
    working: Mapping[str, float] = field(default_factory=dict)

    def __add__(self, other: "MemoryNeed") -> "MemoryNeed":
        return MemoryNeed({**self.resident, **other.resident}, {**self.working, **other.working})

    @property
    def resident_gb(self) -> float:
        return sum(self.resident.values())

    @property
    def working_gb(self) -> float:
        return max(self.working.values(), default=0.0)


class MemoryShortfall(PlanError):
    """A candidate layout that does not fit; ``need_gb`` is what it needs per device."""

    def __init__(self, need_gb: float, capacity_gb: float, terms: str):
        self.need_gb, self.capacity_gb, self.terms = need_gb, capacity_gb, terms
        super().__init__(f"needs {need_gb:.1f} GB per device ({terms}), {capacity_gb:.1f} GB usable")


class NoLayoutFits(PlanError):
    """No candidate of a planning step fits in device memory (the message names the smallest
    requirement)."""


def pareto(options: Iterable[MemoryNeed]) -> list[MemoryNeed]:
    """The options no other one beats on both resident and working memory (ties: the first)."""
    opts = list(options)
    keep: list[MemoryNeed] = []
    for i, o in enumerate(opts):
        if any(p.resident_gb <= o.resident_gb and p.working_gb <= o.working_gb and
               (p.resident_gb < o.resident_gb or p.working_gb < o.working_gb or j < i)
               for j, p in enumerate(opts) if j != i):
            continue
        keep.append(o)
    return keep


class MemoryLedger:
    """Per-device memory of one pool while its layouts are chosen, counted as
    :func:`check_plan_memory` will count the plan: every resident state plus the largest working
    set of a task on these devices.

    ``later`` holds, for each choice still to make (a *step*), the cheapest ways to make it
    (:func:`pareto` options over its candidates); a candidate fits only if the cheapest way of
    making every later step still fits beside it. A later step's resident entry for a model that is
    already resident counts as the larger of the two: that step will replace the current entry (RLHFuse's
    shared inference layout replaces the inference layouts chosen before it)."""

    def __init__(self, capacity_gb: float):
        self.capacity_gb = capacity_gb
        self.resident: dict[str, float] = {}
        self.working: dict[str, float] = {}
        self.later: dict[str, list[MemoryNeed]] = {}

    def copy(self, drop_later: Iterable[str] = ()) -> "MemoryLedger":
        out = MemoryLedger(self.capacity_gb)
        out.resident, out.working = dict(self.resident), dict(self.working)
        out.later = {k: v for k, v in self.later.items() if k not in set(drop_later)}
        return out

    def expect(self, step: str, options: Iterable[MemoryNeed]) -> None:
        """Reserve memory for ``step``, made later in one of ``options``."""
        opts = pareto(options)
        if not opts:
            raise PlanError(f"no candidate layout for {step}")
        self.later[step] = opts

    def commit(self, step: str, need: MemoryNeed) -> None:
        """``step`` is made: its reservation goes, its resident and working entries replace any
        earlier ones of the same models and tasks."""
        self.later.pop(step, None)
        self.resident.update(need.resident)
        self.working.update(need.working)

    def account(self, need: MemoryNeed = MemoryNeed(), step: Optional[str] = None
                ) -> tuple[float, dict[str, float], dict[str, float], set[str]]:
        """(total GB per device, resident terms, working terms, reserved term names) with ``need``
        made for ``step`` and the cheapest way of making every other later step."""
        best = None
        later = [opts for s, opts in self.later.items() if s != step]
        for combo in itertools.product(*later):
            res = {**self.resident, **need.resident}
            work = {**self.working, **need.working}
            reserved = set()
            for opt in combo:
                for k, v in opt.resident.items():
                    if v > res.get(k, 0.0):
                        res[k] = v
                        reserved.add(k)
                for k, v in opt.working.items():
                    if v > work.get(k, 0.0):
                        work[k] = v
                        reserved.add(k)
            total = sum(res.values()) + max(work.values(), default=0.0)
            if best is None or total < best[0]:
                best = (total, res, work, reserved)
        return best

    def total_gb(self, need: MemoryNeed = MemoryNeed(), step: Optional[str] = None) -> float:
        return self.account(need, step)[0]

    def describe(self, need: MemoryNeed = MemoryNeed(), step: Optional[str] = None) -> str:
        total, res, work, reserved = self.account(need, step)
        mark = lambda k: " reserved" if k in reserved else ""  # noqa: E731
        parts = [f"{k} {v:.1f}{mark(k)}" for k, v in res.items() if v > 0]
        text = "resident: " + (", ".join(parts) if parts else "none")
        if work:
            k = max(work, key=work.get)
            text += f"; largest working set: {k} {work[k]:.1f}{mark(k)}"
        return text

    def require(self, need: MemoryNeed, step: Optional[str] = None) -> float:
        """The total; raises :class:`MemoryShortfall` when it exceeds the capacity."""
        total = self.total_gb(need, step)
        if total > self.capacity_gb + 1e-9:
            raise MemoryShortfall(total, self.capacity_gb, self.describe(need, step))
        return total

    def headroom_gb(self, need: MemoryNeed, step: Optional[str] = None) -> float:
        """The largest working set a task could hold beside ``need`` (its resident part), every
        other entry and the cheapest way of making the later steps; negative when even without it
        they do not fit."""
        best = -float("inf")
        later = [opts for s, opts in self.later.items() if s != step]
        for combo in itertools.product(*later):
            res = {**self.resident, **need.resident}
            work = dict(self.working)
            for k in need.working:
                work.pop(k, None)
            for opt in combo:
                for k, v in opt.resident.items():
                    res[k] = max(res.get(k, 0.0), v)
                for k, v in opt.working.items():
                    work[k] = max(work.get(k, 0.0), v)
            left = self.capacity_gb - sum(res.values())
            if max(work.values(), default=0.0) <= left + 1e-9:
                best = max(best, left)
        return best
