"""The simulator across iterations: plans whose generation runs ahead of training (``Plan.off_policy``).

A synchronous plan's iterations do not overlap: iteration ``k + 1`` generates with the weights
iteration ``k`` trained, so each iteration is simulated on its own from time 0
(:mod:`harness.planning.simulate`). An off-policy plan (one-step off-policy: verl's
``one_step_off_policy`` recipe, NeMo-RL's asynchronous GRPO) lets iteration ``k``'s generation start
once the weights of version ``k - s`` have reached the generation engines (``s`` =
``OffPolicyPolicy.max_staleness``), so generation of the next batches overlaps the training of
this one. Here the plan's units are repeated for iterations ``0 .. H-1`` on one timeline and
started by the project's one scheduler (:func:`harness.planning.scheduler.run_timed`), each timed by
the same per-iteration handlers as a synchronous iteration (a :class:`PlanSimulator` per
iteration, on that iteration's batch):

- **dependencies**: each iteration's own, plus: iteration ``k``'s generate task waits for the task
  that delivers version ``k - s`` of its weights, the weights feeder of iteration ``k - s - 1``
  (the weight movement into the generation layout, ``param_sync``, or without one the actor's
  training task);
- **order on shared devices** (the scheduler starts units on shared devices in list order):
  iteration ``k``'s generation (and the inference streaming from it) is listed with iteration
  ``k - s``, before that iteration's training and weight sync. That is the trainer loop of verl's
  recipe: launch the next batch's generation, train on this one, then sync the weights into the
  engines once they have finished generating (NCCL broadcast to idle engines);
- **versions**: a batch is generated under the newest version whose feeder had ended when its
  generation started (>= ``k - s`` by the dependency above); every sample of iteration ``k`` then
  records that version (``SampleRecord.first_version`` / ``last_version``), and its staleness is
  ``k`` minus it (:mod:`harness.core.metrics`). The bound is checked on every simulated batch.

**Iteration windows.** Iteration ``k``'s StepTrace is the timeline between the end of iteration
``k - 1``'s training and the end of iteration ``k``'s (NeMo-RL's definition of an off-policy step:
the interval between training steps while generation runs on its own GPUs;
../shared/published/README.md). Every span is clipped to that window and shifted to start at 0, so
the window holds what ran in it, whichever iteration it belonged to (the generation of the batches
ahead), and its step time is the interval between training steps. Its samples, pipelines and
counters are iteration ``k``'s own (the batch it trained), shifted by the same offset; a sample
generated in an earlier window finishes at a negative time. Window 0 also holds the pipeline's
fill (the first generation, with nothing to overlap), so it is a warm-up iteration; windows from
``s`` on are in steady state for the first ``s`` batches of generation ahead.

A window depends only on iterations ``<= k + s`` (a later generation waits for a weight sync
after iteration ``k``'s training), so simulating further ahead never changes it
(:class:`OffPolicyTimeline` extends its horizon without changing earlier windows).

With ``max_staleness = 0`` every generation waits for the previous iteration's weights: the
timeline is the synchronous iterations laid end to end, and each steady-state window equals the
synchronous iteration (shifted: the previous iteration's weight sync opens the window instead of
closing it); a test holds that.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from harness.core.plan import Plan, Task, TaskKind
from harness.core.trace import UNITS, PipelineRun, SampleRecord, Span, StepTrace
from harness.core.units import Unit, execution_units
from harness.core.workload import Batch
from harness.errors import PlanError
from harness.planning.memory import MemoryReport
from harness.planning.scheduler import Timeline, Timing, UnitQueue, run_timed
from harness.planning.simulate import PlanSimulator
from harness.system import PlanContext


def tagged(name: str, iteration: int) -> str:
    """Task ``name`` of iteration ``iteration`` on the timeline."""
    return f"{name}@{iteration}"


def untagged(name: str) -> str:
    return name.rsplit("@", 1)[0]


def downstream_of(plan: Plan, name: str) -> set[str]:
    """``name`` and every task that reads, directly or not, from it."""
    deps = plan.dependencies()
    out = {name}
    for task in plan.topological_order():
        if any(d in out for d in deps[task]):
            out.add(task)
    return out


def weights_feeders(plan: Plan, gen: Task) -> list[str]:
    """The weight movements of ``gen``'s model into its layout that it waits for (``param_sync``, a
    ``realloc``); none when it generates with the training layout's weights."""
    deps = plan.dependencies()[gen.name]
    return [m.task for m in plan.weight_movements
            if m.model == gen.model and m.task in deps and plan.task(m.task).kind == TaskKind.WEIGHT_MOVEMENT]


def check_off_policy_plan(plan: Plan) -> None:
    """Refuse an off-policy plan that cannot run ahead: one generate task, and with a staleness bound
    above 0 its devices its own (no training task on them: generation overlaps training)."""
    if plan.generation.dispatch is not None and plan.off_policy.rollout != "batched":
        raise PlanError(f"{plan.system}: length dispatch deals each batch to the engines; {plan.off_policy.rollout} "
                        f"rollout launches groups across batches, and the two are not modelled together")
    gens = plan.tasks_of(TaskKind.GENERATE)
    if len(gens) != 1:
        raise PlanError(f"{plan.system}: an off-policy plan has one generate task, not {len(gens)}")
    gen = gens[0]
    if plan.off_policy.max_staleness > 0:
        shared = {d for t in plan.tasks_of(TaskKind.TRAIN) for d in t.allocation.mesh} & set(gen.allocation.mesh)
        if shared:
            raise PlanError(f"{plan.system}: generation runs ahead of training (off_policy.max_staleness="
                            f"{plan.off_policy.max_staleness}) but shares devices {sorted(shared)[:8]} with it; "
                            f"give generation devices of its own")


class _UnrolledPlan:
    """What the scheduler reads of a plan (its dependencies, its weight movements), for the plan's
    tasks repeated over iterations ``0 .. num_iterations - 1`` (module docstring: dependencies)."""

    def __init__(self, plan: Plan, num_iterations: int):
        self.plan = plan
        s = plan.off_policy.max_staleness
        (gen,) = plan.tasks_of(TaskKind.GENERATE)
        after_gen = downstream_of(plan, gen.name)
        trains = [t.name for t in plan.tasks_of(TaskKind.TRAIN)]
        deps = plan.dependencies()
        self.deps: dict[str, list[str]] = {}
        for k in range(num_iterations):
            for name, before in deps.items():
                if name == gen.name:  # the weights of version k - s
                    own = [tagged(d, max(0, k - s)) if d not in after_gen else tagged(d, k) for d in before]
                    if not weights_feeders(plan, gen) and k - s - 1 >= 0:
                        own += [tagged(t, k - s - 1) for t in trains]
                elif name not in after_gen:  # before generation: moves the weights iteration k - 1 trained
                    own = [tagged(d, k) for d in before] + ([tagged(t, k - 1) for t in trains] if k else [])
                else:
                    own = [tagged(d, k) for d in before]
                self.deps[tagged(name, k)] = own

    def dependencies(self) -> dict[str, list[str]]:
        return self.deps

    def movement_of(self, name: str):
        return self.plan.movement_of(untagged(name))


def _tag_unit(unit: Unit, k: int) -> Unit:
    tasks = tuple(dataclasses.replace(t, name=tagged(t.name, k),
                                      stream_from=None if t.stream_from is None else tagged(t.stream_from, k))
                  for t in unit.tasks)
    return dataclasses.replace(unit, tasks=tasks,
                               stream_from=None if unit.stream_from is None else tagged(unit.stream_from, k))


@dataclasses.dataclass
class UnrolledUnits:
    """A batched off-policy plan's units repeated for iterations ``0 .. num_iterations - 1``
    (module docstring): ``order``, the tagged units in the order the scheduler lists them;
    ``original``, a tagged unit's label -> (its iteration, the plan's own unit); ``plan``, what the
    scheduler reads of the unrolled plan. The simulator and ``backend=ray`` run the same list."""

    order: list[Unit]
    original: dict[str, tuple[int, Unit]]
    plan: _UnrolledPlan


def unrolled_units(plan: Plan, num_iterations: int) -> UnrolledUnits:
    """The units of iterations ``0 .. num_iterations - 1`` of batched off-policy ``plan``, ordered
    (module docstring: order on shared devices)."""
    check_off_policy_plan(plan)
    s = plan.off_policy.max_staleness
    units = execution_units(plan)
    (gen,) = plan.tasks_of(TaskKind.GENERATE)
    after_gen = downstream_of(plan, gen.name)
    ahead = {u.label for u in units if u.kind == TaskKind.GENERATE or u.stream_from is not None}
    keyed = []
    original: dict[str, tuple[int, Unit]] = {}
    for k in range(num_iterations):
        for position, unit in enumerate(units):
            t = _tag_unit(unit, k)
            original[t.label] = (k, unit)
            if unit.label in ahead:  # listed with iteration k - s (after the move of version 0)
                key = (max(k - s, 0), 0, position)
            elif set(unit.names) & after_gen:
                key = (k, 1, position)
            else:  # the moves before generation: listed after iteration k - 1's training
                key = (k - 1, 2, position)
            keyed.append((key, t))
    order = [t for _, t in sorted(keyed, key=lambda pair: pair[0])]
    return UnrolledUnits(order, original, _UnrolledPlan(plan, num_iterations))


@dataclasses.dataclass
class OffPolicyRun:
    """A simulated off-policy timeline: the scheduler's timeline (task names tagged ``name@k``),
    each iteration's simulator (its trace holds the iteration's spans in timeline time), and per
    iteration the end of its training (``train_end_s``) and the weights version it generated with."""

    timeline: Timeline
    sims: list[PlanSimulator]
    train_end_s: list[float]
    gen_version: list[int]
    # continuous rollout's decisions in the order it took them
    # (:class:`harness.planning.rollout.RolloutEvent`; empty for other rollouts)
    events: list = dataclasses.field(default_factory=list)


def run_off_policy(ctx: PlanContext, plan: Plan, memory: MemoryReport, batch_of: Callable[[int], Batch],
                   num_iterations: int, record_spans: bool = True) -> OffPolicyRun:
    """Iterations ``0 .. num_iterations - 1`` of off-policy ``plan`` on one timeline (module docstring),
    iteration ``k`` on ``batch_of(k)``."""
    unrolled = unrolled_units(plan, num_iterations)
    s = plan.off_policy.max_staleness
    units = execution_units(plan)
    consumers = {u.stream_from: u for u in units if u.stream_from is not None}
    sims = [PlanSimulator(ctx, plan, memory, k, batch_of(k), record_spans=record_spans)
            for k in range(num_iterations)]
    handlers = [sim.handlers() for sim in sims]
    (gen,) = plan.tasks_of(TaskKind.GENERATE)
    original = unrolled.original

    def start(unit: Unit, now_s: float, queue: UnitQueue) -> Timing:
        k, own = original[unit.label]
        sim = sims[k]
        sim.now_s = now_s
        sim.consumer = consumers.get(own.names[0]) if len(own.names) == 1 else None
        timing = handlers[k][own.kind](own)
        return Timing({tagged(n, k): t for n, t in timing.end_s.items()}, timing.release_s)

    timeline = run_timed(unrolled.plan, ctx.num_devices, start, units=unrolled.order)  # type: ignore[arg-type]
    feeders, trains = weights_feeders(plan, gen), [t.name for t in plan.tasks_of(TaskKind.TRAIN)]
    train_end = [max(timeline.end_s[tagged(n, k)] for n in trains) for k in range(num_iterations)]
    versions = []
    for k in range(num_iterations):
        started = timeline.start_s[tagged(gen.name, k)]  # its unit's label (a consumer starts with it)
        if feeders:  # the newest weights moved into the engines by then: feeder j carries version j
            delivered = [j for j in range(num_iterations)
                         if all(timeline.end_s.get(tagged(f, j), float("inf")) <= started for f in feeders)]
            version = max(delivered) if delivered else 0
        else:  # generating with the training layout's weights: training j makes version j + 1
            version = sum(1 for end in train_end if end <= started)
        if not 0 <= k - version <= s:
            raise PlanError(f"{plan.system}: iteration {k} generated with weights version {version}, "
                            f"{k - version} versions stale; the plan's bound is {s}")
        versions.append(version)
    return OffPolicyRun(timeline, sims, train_end, versions)


def clip_span(span: Span, start_s: float, end_s: float) -> Span | None:
    """``span`` inside [start_s, end_s), shifted to start from ``start_s``; FLOPs and bytes in
    proportion to the time kept. None when nothing of it is inside."""
    lo, hi = max(span.start_s, start_s), min(span.end_s, end_s)
    if hi <= lo:
        return None
    kept = (hi - lo) / span.duration_s if span.duration_s > 0 else 1.0
    return Span(span.devices, span.task, span.kind, lo - start_s, hi - start_s, span.flops * kept, span.bytes * kept)


def window_trace(k: int, lo: float, hi: float, spans: list[Span], own: StepTrace, version: int,
                 unit_start_s: dict[str, float], concurrent: list) -> StepTrace:
    """Iteration ``k``'s window [``lo``, ``hi``) of an off-policy timeline (module docstring:
    iteration windows): every span of the timeline clipped to it; the samples, pipelines and
    counters of iteration ``k``'s own trace ``own``, shifted by ``lo``, its samples generated with
    weights ``version`` where they record none of their own; the units started in it
    (``unit_start_s``: label -> start) and their concurrent pairs. The simulator's windows and
    ``backend=ray``'s are built by this one function."""
    trace = StepTrace(iteration=k, num_devices=own.num_devices)
    trace.spans = [c for c in (clip_span(span, lo, hi) for span in spans) if c is not None]
    trace.samples = [SampleRecord(r.sample_id, r.prompt_len, r.response_len, r.finish_s - lo,
                                  version if r.first_version is None else r.first_version,
                                  version if r.last_version is None else r.last_version)
                     for r in own.samples]
    trace.pipelines = [dataclasses.replace(p, start_s=p.start_s - lo) for p in own.pipelines]
    trace.counters = dict(own.counters)
    trace.memory_gb = dict(own.memory_gb)
    labels = [label for label, start in unit_start_s.items() if lo <= start < hi]
    trace.extra[UNITS] = {"started": labels,
                          "concurrent": [p for p in concurrent if p[0] in labels or p[1] in labels]}
    return trace


def iteration_windows(run: OffPolicyRun, memory: MemoryReport, num_windows: int, lookahead: int) -> list[StepTrace]:
    """StepTraces of iterations ``0 .. num_windows - 1`` of ``run`` (module docstring: iteration
    windows). ``num_windows`` must leave the ``lookahead`` iterations after the last one in ``run``
    whose generation runs inside its window (``max_staleness`` of them for batched rollout)."""
    sims, ends = run.sims, run.train_end_s
    if num_windows + lookahead > len(sims):
        raise ValueError(f"{num_windows} windows need {num_windows + lookahead} simulated iterations, not {len(sims)}")
    spans = [span for sim in sims for span in sim.trace.spans]
    starts = {label: run.timeline.start_s[label] for label in run.timeline.record.get("started", [])}
    concurrent = run.timeline.record.get("concurrent", [])
    traces = []
    for k in range(num_windows):
        trace = window_trace(k, ends[k - 1] if k else 0.0, ends[k], spans, sims[k].trace, run.gen_version[k],
                             starts, concurrent)
        trace.memory_gb = dict(memory.peak_gb)
        traces.append(trace)
    return traces
