"""Partial rollout and tail batching on ``backend=ray`` (driver side): over-provisioned generation
that stops once a batch is complete, the unfinished responses either carried into the next
iteration and continued under its weights (``Plan.off_policy.rollout == "partial"``: APRIL in slime)
or dropped, their prompts generated again in a long round once a batch of them is queued
(``"tail_batching"``: RollPacker). The model is :mod:`harness.planning.partial`.

What is decided and what is run. As for a continuous rollout (:mod:`.continuous`), the decisions are
the simulator's for the plan (:func:`harness.planning.partial.run_partial`, one
:class:`~harness.planning.partial.PartialRound` per iteration): which samples each generation
engine is given and in which order, with which prompt and target length, how many decode steps it
runs before generation stops, and which samples form the batch. A run is then a pure function of
its config and seed. Everything else runs for real. Each iteration is a synchronous iteration of
the plan's units (:class:`.iteration.Iteration`) whose generate unit is the rollout:

- a generation session is opened on every engine; the samples carried from the last iteration are
  imported first, in the simulator's order, each prefilled again from its prompt and the tokens it
  had, its sampler continuing where it stopped (:class:`~harness.backends.ray.protocol.Migrate`
  without KV); a carried sample too stale to continue (its first token more than the plan's
  ``max_staleness`` iterations old) starts again from nothing; the new samples are submitted, a
  drawn prompt's sampler seeded as a synchronous iteration seeds it, a prompt generated again
  (tail batching's long round) seeded afresh for that attempt;
- every engine runs the decode steps the simulator's engine ran before the stop (each step one
  token of every running sample, in both), after which every sample of the batch has finished (else
  the run has diverged from the simulator's, an error);
- the engines' unfinished samples are exported with their tokens; partial rollout keeps them, and
  the finished ones outside the batch, for the next iteration; tail batching drops both and queues
  their prompts. The session is closed, and the batch (its samples' prompts and responses, in batch
  order) goes on to the iteration's log-prob, reference and training units;
- a tail-batching round with a tensor parallelism of its own (RollPacker's parallelism planner,
  :class:`~harness.planning.partial.RoundTpPlanner`) runs the plan with generation in that layout
  (:func:`~harness.planning.partial.round_plan`): the weights resharded into it by the plan's
  movement, its engines the layout's replicas (their process groups set up with the plan's).

Versions: a sample's first version is the iteration in which it generated its first token, its last
the iteration it finished in, as the simulator counts them. The staleness metrics, the counters of
carried and restarted samples (``gen/carried_samples``, ``gen/dropped_samples``) and tail
batching's long rounds and queued prompts (``gen/long_round``, ``gen/queued_prompts``, counted by
the driver from what it dropped and generated again) are the simulator's for the same plan (tested).
"""
from __future__ import annotations

import time

import numpy as np

from harness.backends.ray.driver import experience as ex
from harness.backends.ray.driver.dispatch import UnitRun
from harness.backends.ray.driver.iteration import Iteration
from harness.backends.ray.protocol import (CloseSession, Export, ExportedSample, KvMove, Migrate, OpenSession, Steps,
                                           Submit)
from harness.core import metrics as mk
from harness.core.plan import Plan, Task, TaskKind
from harness.core.trace import SampleRecord, StepTrace
from harness.core.units import Unit
from harness.core.workload import Batch, draw_batch
from harness.planning.memory import check_plan_memory
from harness.planning.partial import PartialRound, round_plan, run_partial
from harness.real.engine import sample_seed


def _wait_all(calls: list) -> UnitRun:
    """Wait (as a unit's handler) until every one of ``calls`` has finished."""
    pending = list(calls)
    while pending:
        done = yield pending
        pending = [c for c in pending if c is not done]


class PartialExecution:
    """Iterations ``0 .. num_iterations - 1`` of partial-rollout ``plan`` on ``backend``'s workers
    (:class:`~.backend.RayBackend`), one iteration at a time (module docstring)."""

    def __init__(self, backend, plan: Plan, num_iterations: int):
        self.backend, self.plan, self.num_iterations = backend, plan, num_iterations
        ctx = self.ctx = backend.ctx
        memory = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
        self.batches: dict[int, Batch] = {}
        self.rounds: list[PartialRound] = []
        run_partial(ctx, plan, memory, self._batch, num_iterations, record_spans=False, rounds=self.rounds)
        (self.gen,) = plan.tasks_of(TaskKind.GENERATE)
        self.tail = plan.off_policy.rollout == "tail_batching"
        self.group_size = ctx.algorithm.group_size
        # sample id -> (iteration its prompt was drawn in, index in that batch, target length, attempt)
        self.source: dict[int, tuple[int, int, int, int]] = {}
        self.queued: list[tuple[int, int]] = []  # tail batching: prompts (iteration, group) waiting for a long round
        self.prompts: dict[tuple[int, int], list[int]] = {}
        self.drawn: set[int] = set()
        self.carried: dict[int, ExportedSample] = {}  # unfinished samples, with the tokens they have
        self.responses: dict[int, tuple[list[int], list[float]]] = {}  # finished, not yet trained
        self.finished_at: dict[int, float] = {}  # wall-clock time each finished
        self.first_version: dict[int, int] = {}
        self.next_iteration = 0

    def _batch(self, k: int) -> Batch:
        if k not in self.batches:
            self.batches[k] = draw_batch(self.ctx.workload, self.ctx.seed, k, self.ctx.algorithm)
        return self.batches[k]

    def prompt(self, g: int) -> list[int]:
        """Sample ``g``'s prompt tokens: those of the batch its prompt was drawn in, as a synchronous
        iteration draws them (a prompt generated again by tail batching keeps its tokens)."""
        j, q = self.source[g][:2]
        if j not in self.drawn:
            self.drawn.add(j)
            tokens = ex.prompt_tokens(self.ctx.seed, j, self._batch(j), self.backend.args["actor"].vocab_size,
                                      self.ctx.algorithm.group_size)
            self.prompts.update({(j, i): p for i, p in enumerate(tokens)})
        return self.prompts[(j, q)]

    def target_len(self, g: int) -> int:
        return self.source[g][2]

    def generator_seed(self, g: int) -> int:
        """A drawn prompt's sample seeded as a synchronous iteration seeds it; a generation again, afresh."""
        j, q, _, attempt = self.source[g]
        if attempt == 0:
            return sample_seed(ex.stable_seed("sampling", self.ctx.seed, j), q)
        return sample_seed(ex.stable_seed("sampling", self.ctx.seed, j, f"attempt{attempt}"), q)

    def window(self, k: int) -> StepTrace:
        """Iteration ``k``: its units in turn, the generate unit the partial rollout (module docstring)."""
        if k != self.next_iteration or k >= self.num_iterations:
            raise RuntimeError(f"backend=ray runs a partial rollout's {self.num_iterations} iterations in order "
                               f"(backend.num_iterations); iteration {k} was asked for, {self.next_iteration} is next")
        self.next_iteration += 1
        rnd = self.rounds[k]
        self.source.update({g: (j, q, target, attempt) for g, j, q, target, attempt in rnd.sources})
        return PartialIteration(self, rnd).run()

    def close(self) -> None:
        """Nothing stays open on the workers between iterations (each closes its sessions)."""

    # ---- one iteration's rollout ------------------------------------------------------------
    def rollout(self, it: "PartialIteration", task: Task) -> UnitRun:
        rnd, group, alloc = it.round, it.group, task.allocation  # the round's layout (round_plan of its tp)
        k = rnd.iteration
        instances = [list(alloc.replica_devices(r)) for r in range(alloc.strategy.dp)]
        w, policy, opts = self.ctx.workload, self.plan.generation, self.backend.opts
        base = dict(sample_ids=[], prompts=[], target_lens=[], max_batch_size=policy.max_batch_size or 1 << 16,
                    temperature=opts.temperature, sampling_seed=ex.stable_seed("sampling", self.ctx.seed),
                    kv_capacity=int(w.prompt_len.max + w.max_gen_len))
        engines = range(len(instances))
        start = time.time()  # samples finished in earlier iterations count as finished now, as simulated
        opened = [group.start(OpenSession(task.name, "actor", alloc, **base), instances[r]) for r in engines]
        yield from _wait_all(opened)
        restarted = set(rnd.restarted)
        kept = sorted(g for g in self.responses if g not in restarted)
        if kept != sorted(set(rnd.complete) - restarted):
            raise RuntimeError(f"partial rollout, iteration {k}: finished samples {kept[:8]} wait for their groups, "
                               f"the simulator's {sorted(rnd.complete)[:8]}")
        for g in restarted:  # generated again from nothing: whatever it had is dropped
            self.carried.pop(g, None)
            self.responses.pop(g, None)
            self.finished_at.pop(g, None)
            self.first_version.pop(g, None)
        calls = []
        for r in engines:
            # in the simulator's order: runs of carried samples imported (prefilled again from prompt and
            # tokens), runs of new or restarted ones submitted; a worker runs its calls in the order started
            runs: list[tuple[bool, list[int]]] = []
            for g, had in rnd.engines[r]:
                held = len(self.carried[g].tokens) if g in self.carried else 0
                if held != had:
                    raise RuntimeError(f"partial rollout, iteration {k}: sample {g} has {held} tokens, the "
                                       f"simulator's {had}")
                imported = g in self.carried
                if runs and runs[-1][0] == imported:
                    runs[-1][1].append(g)
                else:
                    runs.append((imported, [g]))
            for imported, ids in runs:
                if imported:
                    moves = tuple(KvMove(d, d, self.carried.pop(g), {}) for g in ids for d in instances[r])
                    request = Migrate(task.name, "actor", alloc, moves=moves, with_kv=False)
                else:
                    request = Submit(task.name, "actor", alloc, sample_ids=tuple(ids),
                                     prompts=tuple(self.prompt(g) for g in ids),
                                     target_lens=tuple(self.target_len(g) for g in ids),
                                     generator_seeds=tuple(self.generator_seed(g) for g in ids))
                calls.append(group.start(request, instances[r]))
        yield from _wait_all(calls)
        for c in calls:
            it.record(task.name, c.results)
        stepped = {r: group.start(Steps(task.name, "actor", alloc, max_steps=rnd.stop_steps[r]), instances[r])
                   for r in engines if rnd.stop_steps[r] > 0}
        yield from _wait_all(list(stepped.values()))
        for r, call in stepped.items():
            it.record(task.name, call.results)
            report = next(res for res in call.results if res.rank == instances[r][0]).out
            if report.engine_steps != rnd.stop_steps[r]:
                raise RuntimeError(f"partial rollout, iteration {k}: engine {r} ran {report.engine_steps} decode "
                                   f"steps, the simulator's {rnd.stop_steps[r]}")
            for sample in report.finished:
                g = sample.sample_id
                self.responses[g] = (sample.tokens, sample.logprobs)
                self.finished_at[g] = sample.finish_time_s
                self.first_version.setdefault(g, k)
        exported = {r: group.start(Export(task.name, "actor", alloc, with_kv=False), instances[r])
                    for r in engines}
        yield from _wait_all(list(exported.values()))
        for r, call in exported.items():
            for sample in next(res for res in call.results if res.rank == instances[r][0]).out.samples:
                self.carried[sample.sample_id] = sample
                if sample.tokens:
                    self.first_version.setdefault(sample.sample_id, k)
        yield from _wait_all([group.start(CloseSession(task.name, "actor", alloc), instances[r])
                              for r in engines])
        missing = [g for g in rnd.batch if g not in self.responses]
        if missing:
            raise RuntimeError(f"partial rollout, iteration {k}: samples {missing[:8]} of the batch have not finished "
                               f"when the simulator's generation stopped")
        trace = it.trace
        trace.samples = [SampleRecord(j, len(self.prompt(g)), len(self.responses[g][0]),
                                      max(self.finished_at.pop(g), start) - it.t0, self.first_version.pop(g), k)
                         for j, g in enumerate(rnd.batch)]
        firsts = tuple(r.first_version for r in trace.samples)
        if firsts != rnd.first_version:
            raise RuntimeError(f"partial rollout, iteration {k}: the batch's first versions {firsts} are not the "
                               f"simulator's {rnd.first_version}")
        it.set_rollout({j: self.responses.pop(g) for j, g in enumerate(rnd.batch)}, "partial rollout")
        if self.tail:  # nothing carried: the prompts not trained wait for a long round, their responses dropped
            long_round = any(self.source[g][3] > 0 for engine in rnd.engines for g, _ in engine)
            if long_round:
                regenerated = {self._prompt_key(g) for engine in rnd.engines for g, _ in engine}
                self.queued = [key for key in self.queued if key not in regenerated]
            dropped = sorted({self._prompt_key(g) for g in [*self.carried, *self.responses]})
            self.queued += dropped
            self.carried.clear()
            self.responses.clear()
            self.finished_at.clear()
            self.first_version.clear()
            trace.counters[mk.LONG_ROUND] = float(long_round)
            trace.counters[mk.QUEUED_PROMPTS] = float(len(self.queued))
            trace.counters[mk.ROUND_TP] = float(alloc.strategy.tp)
            return
        trace.counters[mk.DROPPED_SAMPLES] = float(len(restarted))
        # carried into the next iteration with tokens: the unfinished ones that have some, and the finished
        # ones outside the batch (their groups not complete, or not among the first to complete)
        trace.counters[mk.CARRIED_SAMPLES] = float(sum(1 for s in self.carried.values() if s.tokens)
                                                   + len(self.responses))

    def _prompt_key(self, g: int) -> tuple[int, int]:
        """The prompt of sample ``g``: the iteration it was drawn in and its group there."""
        j, q = self.source[g][:2]
        return j, q // self.group_size


class PartialIteration(Iteration):
    """A synchronous iteration of the plan whose generate unit is the partial rollout of
    ``run`` (:class:`PartialExecution`) for ``rnd``, its batch the samples the rollout trains."""

    def __init__(self, run: PartialExecution, rnd: PartialRound):
        self.execution, self.round = run, rnd
        batch = Batch(rnd.iteration, np.array([len(run.prompt(g)) for g in rnd.batch], dtype=np.int64),
                      np.array([run.target_len(g) for g in rnd.batch], dtype=np.int64))
        # a tail-batching round with a tp of its own runs the plan with generation in that layout
        plan = round_plan(run.plan, rnd.tp) if rnd.tp else run.plan
        super().__init__(run.backend, plan, rnd.iteration, batch, time.time())

    def prepare(self) -> None:
        self.prompts = [self.execution.prompt(g) for g in self.round.batch]

    def _generate_unit(self, unit: Unit) -> UnitRun:
        (task,) = unit.tasks
        yield from self.ensure_current(task.name, "actor", task.allocation)
        self.gen_version = self.iteration
        yield from self.execution.rollout(self, task)
