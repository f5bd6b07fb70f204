"""Continuous rollout across iterations: generation engines that never drain between batches
(``Plan.off_policy.rollout == "continuous"``), beside a trainer that takes batches as they are ready.

Asynchronous RL systems keep their generation engines busy: NeMo-RL's asynchronous GRPO launches
each prompt group as its own request while the engines still finish the last responses of earlier
groups (``AsyncTrajectoryCollector``, with up to prompts-per-step x ``max_trajectory_age_steps``
groups in flight), and AReaL's rollout workers do the same with a staleness bound on how many
groups may be submitted (Fu et al., arXiv 2505.24298, section 5). The long tail of one batch then
overlaps the bulk of the next. This module simulates that on the plan's generation instances
(one :class:`~harness.planning.taskmodels.generation.ContinuousInstance` per data-parallel
replica of the ``gen`` task, continuous batching with KV reserved per sample as everywhere in the
simulator) and the plan's other units as the trainer, on one clock:

- **launching**: prompt groups are launched in the order they are drawn (iteration by iteration,
  :func:`harness.core.workload.draw_batch`), each sample to the engine with the fewest unfinished
  samples. A group may launch while ``max_groups_in_flight`` (when set) allows and the staleness
  bound does: with ``batch_order="iteration"`` a group drawn for iteration ``k`` needs loaded weights
  of version ``>= k - s``; with ``batch_order="finish"`` the ``n``-th group launched (from 0) needs
  ``n // G <= version + s`` (``G`` groups a batch: AReaL's rule);
- **the trainer** runs the plan's units other than generation and the weight movement into it,
  one after another on its devices, for iteration ``k``'s batch once it is ready: the groups drawn
  for ``k`` (``iteration``), or the first ``G`` finished groups whose launch version is within the
  bound, staler finished ones dropped (``finish``); a group is ready when its last response has
  been scored by the rule-based verifier (one ``algo.rule_reward_s_per_sample`` after it finished);
- **new weights** (version ``k + 1``, when iteration ``k``'s training ends) reach the engines by
  the plan's weight movement (``param_sync``), timed by its task model, during which the engines
  pause; ``weight_update`` says what happens to the samples they hold: ``inflight`` (continue with
  their KV cache), ``interrupt`` (aborted and re-prefilled, prompt and tokens so far, under the new
  weights) or ``drain`` (no launches from the end of training until every launched group has
  finished; the weights move then);
- **versions**: a sample's ``first_version`` is the version loaded when its group launched, its
  ``last_version`` the version loaded when it finished; its staleness is ``k - first_version``.

The clock advances every engine together in steps no longer than the shortest possible training
step (the trainer's units on a batch of minimal lengths), so no engine runs past a weight update:
an update is the end of a training step that started no earlier than the last step's finishes.
Launches and batch-readiness are checked at those steps (a launch may wait up to one of them).

What :mod:`harness.planning.iterations` says about windows, warm-up and staleness holds here too;
:func:`run_continuous` returns the same :class:`~harness.planning.iterations.OffPolicyRun`, with its
decisions in the order taken (:class:`RolloutEvent`, each with the engines' decode steps by then),
which ``backend=ray`` executes for real (:mod:`harness.backends.ray.driver.continuous`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from harness.core import metrics as mk
from harness.core.plan import Plan, TaskKind
from harness.core.trace import SampleRecord, Span
from harness.core.units import Unit, execution_units
from harness.core.workload import Batch
from harness.errors import PlanError
from harness.planning.iterations import OffPolicyRun, check_off_policy_plan, tagged, weights_feeders
from harness.planning.memory import MemoryReport
from harness.planning.scheduler import Timeline
from harness.planning.simulate import PlanSimulator
from harness.planning.taskmodels.generation import ContinuousInstance, _Sample, kv_capacity_tokens
from harness.system import PlanContext


@dataclass(frozen=True)
class RolloutEvent:
    """One decision of a continuous rollout, recorded in the order they were taken (the schedule
    ``backend=ray`` executes: :mod:`harness.backends.ray.driver.continuous`). Sample ids are global:
    iteration ``j``'s batch of ``n`` samples holds ids ``j n .. (j + 1) n - 1``, in batch order.

    - ``launch``: a group's samples submitted to the engines, under weights ``version``;
    - ``finish``: a sample's last token generated;
    - ``train``: iteration ``version``'s training starts on ``sample_ids`` (``dropped``: finished
      groups staler than the bound, never trained);
    - ``update``: weights ``version`` moved into the engines (what happens to the samples they hold
      is the plan's ``weight_update``)."""

    kind: str
    version: int
    sample_ids: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    engines: tuple[int, ...] = ()  # launch: the engine (dp replica of gen) each sample went to
    engine_steps: tuple[int, ...] = ()  # each engine's decode steps so far, when the decision was taken


@dataclass
class _Group:
    iteration: int  # the iteration whose batch it was drawn in
    sample_ids: list[int]  # global sample ids
    launch_version: int = -1
    launched: bool = False
    num_finished: int = 0
    ready_s: float = math.inf  # its last response scored
    finish_versions: dict[int, int] = field(default_factory=dict)  # sample id -> version loaded at its finish
    finish_s: dict[int, float] = field(default_factory=dict)
    trained: bool = False


def batch_groups(base: PlanSimulator, batch: Batch, group_size: int) -> list[tuple[list[int], list[int]]]:
    """An iteration's batch as its prompt groups, in batch order: each group's prompt lengths (as
    generation sees them, :meth:`PlanSimulator._generated_prompt_lens`) and target output lengths."""
    prompts = base._generated_prompt_lens(batch.prompt_lens)
    return [([int(x) for x in prompts[g:g + group_size]], [int(x) for x in batch.output_lens[g:g + group_size]])
            for g in range(0, batch.num_samples, group_size)]


def _trainer_units(plan: Plan, gen_name: str, feeders: list[str]) -> tuple[list[Unit], list[Unit]]:
    """The plan's units the trainer runs (neither generation nor the moves into it), and those moves."""
    units = execution_units(plan)
    if any(u.stream_from is not None for u in units):
        raise PlanError(f"{plan.system}: continuous rollout feeds a trainer that takes whole batches; the plan's "
                        f"inference streams from generation")
    moves = [u for u in units if set(u.names) & set(feeders)]
    trainer = [u for u in units if gen_name not in u.names and u not in moves]
    return trainer, moves


def run_continuous(ctx: PlanContext, plan: Plan, memory: MemoryReport, batch_of: Callable[[int], Batch],
                   num_steps: int, record_spans: bool = True):
    """Iterations ``0 .. num_steps - 1`` of ``plan`` trained under continuous rollout (module
    docstring); iteration ``k``'s prompts drawn by ``batch_of(k)``."""
    check_off_policy_plan(plan)
    policy = plan.off_policy
    s = policy.max_staleness
    (gen,) = plan.tasks_of(TaskKind.GENERATE)
    feeders = weights_feeders(plan, gen)
    trainer_units, move_units = _trainer_units(plan, gen.name, feeders)
    gen_devices = set(gen.allocation.mesh)
    for unit in trainer_units:
        if gen_devices & set(unit.devices):
            raise PlanError(f"{plan.system}: continuous rollout keeps generation busy, but {unit.label} shares its "
                            f"devices; give generation devices of its own")
    algo = ctx.algorithm
    group_size = algo.group_size
    first = batch_of(0)
    if first.rounds is not None:
        raise PlanError(f"{plan.system}: continuous rollout of dynamic sampling's rounds is not modelled")
    per_batch = first.num_samples // group_size
    base = PlanSimulator(ctx, plan, memory, 0, first, record_spans=False)
    cm, model, st = base.cm, ctx.model(gen.model), gen.allocation.strategy
    kv_tokens = kv_capacity_tokens(cm, model, st.tp, st.pp, memory.kv_capacity_gb[gen.name])
    max_batch = plan.generation.max_batch_size or (1 << 30)
    finishes: list[list[SampleRecord]] = [[] for _ in range(st.dp)]
    engines = [ContinuousInstance(cm, model, gen.allocation.replica_devices(r), st.tp, st.pp, 0.0, max_batch,
                                  kv_tokens, ctx.workload.max_gen_len, finishes[r], gen.name, st.ep,
                                  plan.generation.kv_allocation == "on_demand")
               for r in range(st.dp)]
    seen = [0] * st.dp  # finishes already processed, per engine

    prompt_len: list[int] = []
    output_len: list[int] = []
    group_of: list[int] = []
    groups: list[_Group] = []
    drawn = 0  # iterations whose groups are queued

    def draw_next() -> None:
        nonlocal drawn
        batch = first if drawn == 0 else batch_of(drawn)
        if batch.num_samples != per_batch * group_size:
            raise PlanError(f"iteration {drawn} draws {batch.num_samples} samples, not {per_batch * group_size}")
        for prompts, outputs in batch_groups(base, batch, group_size):
            ids = list(range(len(prompt_len), len(prompt_len) + group_size))
            prompt_len.extend(prompts)
            output_len.extend(outputs)
            group_of.extend([len(groups)] * group_size)
            groups.append(_Group(drawn, ids))
        drawn += 1

    def trainer_run(step: int, batch: Batch, start_s: float, sim_record: bool) -> tuple[PlanSimulator, float]:
        sim = PlanSimulator(ctx, plan, memory, step, batch, record_spans=sim_record)
        table = sim.handlers()
        now = start_s
        for unit in trainer_units:
            sim.now_s, sim.consumer = now, None
            timing = table[unit.kind](unit)
            now = max(timing.end_s.values())
        return sim, now

    # the shortest possible training step: every response one token, every prompt its shortest
    w = ctx.workload
    floor_batch = Batch(0, np.full(first.num_samples, w.prompt_len.min, dtype=np.int64),
                        np.ones(first.num_samples, dtype=np.int64))
    _, floor_s = trainer_run(0, floor_batch, 0.0, False)
    if not floor_s > 0:
        raise PlanError(f"{plan.system}: the trainer's shortest step takes no time; continuous rollout needs one")
    chunk_s = floor_s

    version = 0  # loaded in the engines
    now = 0.0
    next_launch = 0  # index of the next group to launch
    in_flight = 0
    trainer_free = 0.0
    pending: tuple[float, int, int] | None = None  # (when, version, step): new weights ready to move
    draining = False
    steps_done = 0
    sims: list[PlanSimulator] = []
    train_end: list[float] = []
    timeline = Timeline(ctx.num_devices)
    started: list[str] = []
    interrupted = dropped = 0
    events: list[RolloutEvent] = []
    newly_dropped: list[int] = []  # dropped since the last training started
    counters: list[dict[str, float]] = []

    def launch() -> None:
        nonlocal next_launch, in_flight
        while not draining:
            if next_launch >= len(groups):
                draw_next()
            grp = groups[next_launch]
            if policy.max_groups_in_flight and in_flight >= policy.max_groups_in_flight:
                return
            bound = grp.iteration if policy.batch_order == "iteration" else next_launch // per_batch
            if bound > version + s:
                return
            grp.launched, grp.launch_version = True, version
            placed = []
            for gid in grp.sample_ids:
                r = min(range(len(engines)), key=lambda r: engines[r].num_unfinished)
                target = engines[r]
                target.now = max(target.now, now)
                target.waiting.append(_Sample(gid, prompt_len[gid], output_len[gid]))
                placed.append(r)
            events.append(RolloutEvent("launch", version, tuple(grp.sample_ids), engines=tuple(placed),
                                      engine_steps=tuple(e.steps for e in engines)))
            next_launch += 1
            in_flight += 1

    def move_weights(at_s: float, step: int) -> float:
        """The weights of version ``step + 1`` moved into the engines from ``at_s``; their end."""
        sim = sims[step]
        table = sim.handlers()
        end = at_s
        for unit in move_units:
            sim.now_s, sim.consumer = end, None
            end = max(table[unit.kind](unit).end_s.values())
            started.append(tagged(unit.label, step + 1))
            timeline.start_s[tagged(unit.label, step + 1)] = at_s
        return end

    def apply_update(at_s: float, new_version: int, step: int) -> None:
        nonlocal version, trainer_free, interrupted
        end = move_weights(at_s, step)
        for e in engines:
            if policy.weight_update == "interrupt":
                held = e.take_unfinished()
                interrupted += sum(1 for x in held if x.generated > 0)  # aborted mid-response
                for x in held:
                    x.has_kv = False  # re-prefilled under the new weights
                e.waiting = held
            if e.now < end:
                e.result.spans.append(Span(e.devices, "param_sync", "param_sync", max(e.now, at_s), end))
            e.now = max(e.now, end)
        version = new_version
        trainer_free = max(trainer_free, end)
        events.append(RolloutEvent("update", new_version, engine_steps=tuple(e.steps for e in engines)))

    def collect() -> None:
        nonlocal in_flight
        new = sorted((rec for r in range(len(engines)) for rec in finishes[r][seen[r]:]),
                     key=lambda rec: (rec.finish_s, rec.sample_id))
        for r in range(len(engines)):
            seen[r] = len(finishes[r])
        for rec in new:
            events.append(RolloutEvent("finish", version, (rec.sample_id,),
                                      engine_steps=tuple(e.steps for e in engines)))
            grp = groups[group_of[rec.sample_id]]
            grp.num_finished += 1
            grp.finish_s[rec.sample_id] = rec.finish_s
            grp.finish_versions[rec.sample_id] = version
            if grp.num_finished == len(grp.sample_ids):
                grp.ready_s = max(grp.finish_s.values()) + algo.rule_reward_s_per_sample
                in_flight -= 1

    def start_training() -> None:
        nonlocal pending, trainer_free, steps_done, dropped
        if pending is not None:  # the trainer moves the last step's weights before it trains again
            return
        k = steps_done
        if policy.batch_order == "iteration":
            chosen = [g for g in groups if g.iteration == k] if drawn > k else []
            if len(chosen) < per_batch or any(g.ready_s == math.inf for g in chosen):
                return
        else:
            done = sorted((g for g in groups if g.ready_s < math.inf and not g.trained), key=lambda g: g.ready_s)
            stale = [g for g in done if g.launch_version < k - s]
            for g in stale:
                g.trained = True  # dropped: never trained
                dropped += len(g.sample_ids)
                newly_dropped.extend(g.sample_ids)
            chosen = [g for g in done if g.launch_version >= k - s][:per_batch]
            if len(chosen) < per_batch:
                return
        ready = max(g.ready_s for g in chosen)
        if ready > now:
            return
        for g in chosen:
            g.trained = True
        ids = [gid for g in chosen for gid in g.sample_ids]
        events.append(RolloutEvent("train", k, tuple(ids), tuple(newly_dropped),
                                  engine_steps=tuple(e.steps for e in engines)))
        newly_dropped.clear()
        batch = Batch(k, np.array([prompt_len[i] for i in ids], dtype=np.int64),
                      np.array([output_len[i] for i in ids], dtype=np.int64))
        begin = max(trainer_free, ready)
        sim, end = trainer_run(k, batch, begin, record_spans)
        sim.trace.samples = [SampleRecord(j, prompt_len[gid], output_len[gid], groups[group_of[gid]].finish_s[gid],
                                          groups[group_of[gid]].launch_version,
                                          groups[group_of[gid]].finish_versions[gid])
                             for j, gid in enumerate(ids)]
        for unit in trainer_units:
            started.append(tagged(unit.label, k))
            timeline.start_s[tagged(unit.label, k)] = begin
        sims.append(sim)
        train_end.append(end)
        counters.append({mk.INTERRUPTED_SAMPLES: float(interrupted - sum(c[mk.INTERRUPTED_SAMPLES] for c in counters)),
                         mk.DROPPED_SAMPLES: float(dropped - sum(c[mk.DROPPED_SAMPLES] for c in counters))})
        trainer_free = end
        pending = (end, k + 1, k)
        steps_done += 1

    launch()
    idle_chunks = 0
    while steps_done < num_steps:
        if pending is not None and not draining and pending[0] <= now:
            if policy.weight_update == "drain":
                draining = True
            else:
                apply_update(now, pending[1], pending[2])
                pending = None
                launch()
        if draining and all(e.num_unfinished == 0 for e in engines):
            at = max([now] + [e.now for e in engines])
            draining = False
            apply_update(at, pending[1], pending[2])
            pending = None
            now = max(now, at)
            launch()
        if pending is None or draining:
            horizon = now + chunk_s
        else:
            horizon = min(now + chunk_s, pending[0])
        if horizon <= now:  # an update due now was applied above; move on by one chunk
            horizon = now + chunk_s
        busy = any(e.num_unfinished for e in engines) or pending is not None or draining
        # a group whose rewards are still being scored is on its way to a batch (an engine's last
        # step may end past the horizon, and its samples' scoring after that); looked for only when
        # nothing else runs
        idle = not busy and not any(now < g.ready_s < math.inf and not g.trained for g in groups)
        idle_chunks = idle_chunks + 1 if idle else 0
        if idle_chunks > 2:  # nothing runs, nothing is due, and no batch became ready: it never will
            raise PlanError(f"{plan.system}: continuous rollout stalled at {now:.1f} s before iteration {steps_done} "
                            f"(no group may launch and no batch is ready)")
        for e in engines:
            if e.num_unfinished:
                e.run(until_s=horizon)
            e.now = max(e.now, horizon)
        now = horizon
        collect()
        start_training()
        launch()
    for k, end in enumerate(train_end):
        timeline.end_s.update({tagged(n, k): end for u in trainer_units for n in u.names})
    timeline.record = {"started": started, "concurrent": []}
    gen_spans = [span for e in engines for span in e.result.spans]
    sims[0].trace.spans.extend(gen_spans)  # pooled: windows clip every span to their interval
    for sim, extra in zip(sims, counters):
        sim.trace.counters.update(extra)
    versions = [min((r.first_version for r in sim.trace.samples), default=0) for sim in sims]
    for k, sim in enumerate(sims):
        stale = [k - r.first_version for r in sim.trace.samples]
        if stale and not 0 <= max(stale) <= s:
            raise PlanError(f"{plan.system}: iteration {k} trains samples {max(stale)} versions stale; "
                            f"the plan's bound is {s}")
    return OffPolicyRun(timeline, sims, train_end, versions, events)
