"""Partial rollout: over-provisioned generation that stops once a batch is complete, the unfinished
responses carried into the next iteration (``Plan.off_policy.rollout == "partial"``).

APRIL (Zhou et al., "APRIL: Active Partial Rollouts in Reinforcement Learning to Tame Long-tail
Generation", arXiv 2509.18521, in slime) attacks the long tail inside a synchronous iteration:
each iteration launches more prompt groups than it trains on; as soon as the batch's number of
groups has finished, the responses still being generated are aborted and kept, and the next
iteration resumes them first, under its new weights, before launching new prompts (Kimi k1.5,
arXiv 2501.12599, section 2.6.2, carries unfinished responses over in the same way under a
per-iteration token budget, which is not modelled here). The iteration thus ends at the batch's
completion, not at its longest response; the price is that a response continued across
iterations holds tokens of older weights.

Here each iteration runs the plan's units in order; the generate unit is replaced by that rollout
on the plan's generation instances (one :class:`ContinuousInstance` per data-parallel replica,
samples dealt round-robin, resumed ones first):

- the pool: the carried samples (each re-prefills its prompt and the tokens it had, its KV cache
  having been dropped at the abort) and new prompt groups drawn in order from the workload
  (:func:`harness.core.workload.draw_batch` of iterations 0, 1, ...), up to
  ``ceil(oversample_factor x P)`` groups in all (``P`` the groups a batch trains; at least the
  carried ones);
- generation stops when the ``P``-th group has finished its last response (the instances are
  independent, so a full run finds that time and a replay stops there, as long-tail migration is
  replayed); the ``P`` groups finished first are the batch; every other sample is carried, with the
  tokens it has;
- versions: a sample's ``first_version`` is the iteration it first generated a token in, its
  ``last_version`` the one it finished in; a carried sample whose first version would be more than
  ``max_staleness`` behind when its turn comes starts again from nothing (``gen/dropped_samples``
  counts the tokens' samples thrown away);
- the later units (log-probs, training, the weight movement of the next iteration) run on the
  batch's samples.

Iteration ``k``'s window runs from the end of iteration ``k - 1``'s training to the end of its own
(:mod:`harness.planning.iterations`); the first iteration has nothing carried.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from harness.core import metrics as mk
from harness.core.plan import Plan, TaskKind
from harness.core.trace import SampleRecord
from harness.core.units import execution_units
from harness.core.workload import Batch
from harness.errors import PlanError
from harness.planning.iterations import OffPolicyRun, tagged
from harness.planning.memory import MemoryReport
from harness.planning.scheduler import Timeline
from harness.planning.simulate import PlanSimulator, verified_times
from harness.planning.taskmodels.generation import ContinuousInstance, _Sample, kv_capacity_tokens
from harness.system import PlanContext


@dataclass
class _Carried:
    group: int  # global group id
    sample_id: int  # global sample id
    generated: int  # tokens it has
    first_version: int | None  # the iteration of its first token (None: none yet)


def run_partial(ctx: PlanContext, plan: Plan, memory: MemoryReport, batch_of: Callable[[int], Batch],
                num_iterations: int, record_spans: bool = True) -> OffPolicyRun:
    """Iterations ``0 .. num_iterations - 1`` of ``plan`` under partial rollout (module docstring)."""
    policy = plan.off_policy
    gens = plan.tasks_of(TaskKind.GENERATE)
    if len(gens) != 1:
        raise PlanError(f"{plan.system}: partial rollout needs one generate task, not {len(gens)}")
    (gen,) = gens
    units = execution_units(plan)
    if any(u.stream_from is not None for u in units):
        raise PlanError(f"{plan.system}: partial rollout trains whole batches; the plan's inference streams from "
                        f"generation")
    algo, group_size, s = ctx.algorithm, ctx.algorithm.group_size, policy.max_staleness
    first = batch_of(0)
    if first.rounds is not None:
        raise PlanError(f"{plan.system}: partial rollout of dynamic sampling's rounds is not modelled")
    per_batch = first.num_samples // group_size
    launched_per_iteration = math.ceil(policy.oversample_factor * per_batch)
    base = PlanSimulator(ctx, plan, memory, 0, first, record_spans=False)
    cm, model, st = base.cm, ctx.model(gen.model), gen.allocation.strategy
    kv_tokens = kv_capacity_tokens(cm, model, st.tp, st.pp, memory.kv_capacity_gb[gen.name])

    prompt_len: list[int] = []
    output_len: list[int] = []
    group_samples: list[list[int]] = []
    drawn = 0

    def draw_groups(upto: int) -> None:
        """Groups ``0 .. upto`` drawn: the workload's iterations' prompts, in order."""
        nonlocal drawn
        while upto >= len(group_samples):
            batch = first if drawn == 0 else batch_of(drawn)
            prompts = base._generated_prompt_lens(batch.prompt_lens)
            for g in range(per_batch):
                ids = list(range(len(prompt_len), len(prompt_len) + group_size))
                for i in range(g * group_size, (g + 1) * group_size):
                    prompt_len.append(int(prompts[i]))
                    output_len.append(int(batch.output_lens[i]))
                group_samples.append(ids)
            drawn += 1

    next_group = 0
    carried: list[_Carried] = []
    sims: list[PlanSimulator] = []
    train_end: list[float] = []
    timeline = Timeline(ctx.num_devices)
    started: list[str] = []
    now = 0.0

    for k in range(num_iterations):
        # the pool: carried samples (too stale ones restarted), then new groups
        dropped = 0
        pool: list[_Carried] = []
        for c in carried:
            if c.first_version is not None and c.first_version < k - s:
                dropped += 1
                c = _Carried(c.group, c.sample_id, 0, None)
            pool.append(c)
        groups = sorted({c.group for c in pool})
        while len(groups) < launched_per_iteration:
            draw_groups(next_group)
            groups.append(next_group)
            pool += [_Carried(next_group, i, 0, None) for i in group_samples[next_group]]
            next_group += 1
        by_sample = {c.sample_id: c for c in pool}
        waiting_done = [c for c in pool if c.generated >= output_len[c.sample_id]]  # finished, group not yet
        to_generate = [c for c in pool if c.generated < output_len[c.sample_id]]
        sim_before = PlanSimulator(ctx, plan, memory, k, first, record_spans=record_spans)
        gen_unit = next(u for u in units if gen.name in u.names)
        before = units[:units.index(gen_unit)]
        after = units[units.index(gen_unit) + 1:]

        def run_in_turn(sim: PlanSimulator, todo: list, start_s: float) -> float:
            """``todo``'s units one after another from ``start_s`` (the iteration is synchronous); their end."""
            table = sim.handlers()
            for unit in todo:
                sim.now_s, sim.consumer = start_s, None
                started.append(tagged(unit.label, k))
                timeline.start_s[tagged(unit.label, k)] = start_s
                start_s = max(table[unit.kind](unit).end_s.values())
            return start_s

        now = run_in_turn(sim_before, before, now)

        def instances() -> tuple[list[ContinuousInstance], list[SampleRecord]]:
            finishes: list[SampleRecord] = []
            out = [ContinuousInstance(cm, model, gen.allocation.replica_devices(r), st.tp, st.pp, now,
                                      plan.generation.max_batch_size or max(1, len(to_generate)), kv_tokens,
                                      ctx.workload.max_gen_len, finishes, gen.name, st.ep) for r in range(st.dp)]
            for j, c in enumerate(to_generate):
                out[j % st.dp].waiting.append(_Sample(c.sample_id, prompt_len[c.sample_id], output_len[c.sample_id],
                                                      generated=c.generated))
            return out, finishes

        engines, finishes = instances()
        for e in engines:
            e.run()
        done_at: dict[int, float] = {}
        remaining = {g: len(group_samples[g]) for g in groups}
        completions = [(now, c.sample_id) for c in waiting_done] + sorted((r.finish_s, r.sample_id) for r in finishes)
        for t, sid in completions:
            g = by_sample[sid].group
            remaining[g] -= 1
            if remaining[g] == 0:
                done_at[g] = t
        if len(done_at) < per_batch:
            raise PlanError(f"{plan.system}: iteration {k} finished {len(done_at)} groups of the {per_batch} it trains")
        batch_groups = sorted(done_at, key=lambda g: (done_at[g], g))[:per_batch]
        stop_s = done_at[batch_groups[-1]]
        engines, finishes = instances()  # replayed up to the stop: the instances are independent
        for e in engines:
            e.run(until_s=stop_s)
        finished = {c.sample_id: now for c in waiting_done}
        finished.update({r.sample_id: r.finish_s for r in finishes if r.finish_s <= stop_s})
        carried = []
        chosen = set(batch_groups)
        for e in engines:
            for x in e.take_unfinished():
                c = by_sample[x.sample_id]
                first_version = c.first_version if c.first_version is not None else (k if x.generated > 0 else None)
                carried.append(_Carried(c.group, x.sample_id, x.generated, first_version))
        for sid, t in finished.items():  # finished samples of groups outside the batch wait, done, in the pool
            c = by_sample[sid]
            if c.group not in chosen:
                carried.append(_Carried(c.group, sid, output_len[sid], c.first_version if c.first_version is not None
                                        else k))
        carried.sort(key=lambda c: c.sample_id)
        ids = [i for g in batch_groups for i in group_samples[g]]
        batch = Batch(k, np.array([prompt_len[i] for i in ids], dtype=np.int64),
                      np.array([output_len[i] for i in ids], dtype=np.int64))
        sim = PlanSimulator(ctx, plan, memory, k, batch, record_spans=record_spans)
        sim.trace.spans.extend(sim_before.trace.spans)
        sim.trace.spans.extend(span for e in engines for span in e.result.spans)
        returned = [finished.get(i, stop_s) for i in ids]
        scored = verified_times(returned, algo.rule_reward_s_per_sample, algo.num_reward_workers)
        gen_end = max([stop_s] + scored) if not algo.has_reward_model else stop_s
        sim.trace.samples = [SampleRecord(j, prompt_len[i], output_len[i], finished.get(i, stop_s),
                                          by_sample[i].first_version if by_sample[i].first_version is not None else k, k)
                             for j, i in enumerate(ids)]
        sim.trace.counters[mk.DROPPED_SAMPLES] = float(dropped)
        sim.trace.counters[mk.CARRIED_SAMPLES] = float(sum(1 for c in carried if c.generated > 0))
        started.append(tagged(gen_unit.label, k))
        timeline.start_s[tagged(gen_unit.label, k)] = now
        now = run_in_turn(sim, after, gen_end)
        sims.append(sim)
        train_end.append(now)
    timeline.record = {"started": started, "concurrent": []}
    versions = [min((r.first_version for r in sim.trace.samples), default=0) for sim in sims]
    return OffPolicyRun(timeline, sims, train_end, versions)
