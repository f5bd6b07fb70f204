"""Continuous rollout on ``backend=ray`` (driver side): generation engines that never drain between
batches, a trainer taking batches as they are ready, and weights pushed into the engines while they
generate (``Plan.off_policy.rollout == "continuous"``: AReaL's interruptible rollout, NeMo-RL's
asynchronous GRPO).

What is decided and what is run. A continuous rollout's decisions (which prompt group launches
under which weights version, which finished groups each training step takes and which it drops as
too stale, when new weights reach the engines) are the simulator's for the plan
(:func:`harness.planning.rollout.run_continuous`, its :class:`~harness.planning.rollout.RolloutEvent`
list), as the order of a synchronous plan's units is the scheduler's: a run is then a pure function
of its config and seed, as every run here is, where deciding by the wall clock would make every run
different. Everything else runs for real, in the events' order:

- ``launch``: the group's prompts are submitted to an open generation session on the engine the
  event names (:class:`~harness.backends.ray.protocol.Submit`), each sample's sampler seeded as a
  synchronous iteration seeds it (the iteration the prompt was drawn for, its index in that batch);
- before each event, every engine runs the decode steps the simulator's engine had run by then
  (each step one token of every running sample, in both), so generation goes on while training
  runs, and samples are as far along when weights move as in the simulator;
- ``finish``: the sample has generated its last token (should an engine differ from the
  simulator's, it is stepped on until it has);
- ``train``: iteration ``k``'s batch (the event's samples, in batch order) is verified and its
  log-probs, reference pass and update run on the training devices, started at once and driven
  while generation goes on;
- ``update``: once that training has finished, its weights move into the engines by the plan's
  weight movement (``param_sync``); under ``weight_update="interrupt"`` the engines' unfinished
  samples are exported first and re-imported after it, prefilled again from their prompt and tokens
  so far under the new weights (AReaL's interruption), under ``inflight`` they keep their KV cache,
  under ``drain`` there are none (the simulator drained them).

Versions are the workers' own: the driver counts the weight movements it has run, records on every
sample the version loaded when it launched and when it finished, and refuses (an error) a batch
with a sample staler than the plan's bound. Iteration ``k``'s StepTrace is the window between
training steps (:func:`harness.planning.iterations.window_trace`) over the spans the workers report
on the run's clock.

With ``max_staleness = 0`` every group of iteration ``k`` launches under version ``k`` and nothing
is in flight when weights move, so the run is the synchronous one: the same samples, the same
sampled tokens and the same weights, bit for bit (tested).
"""
from __future__ import annotations

import time

import numpy as np

from harness.backends.ray.driver import experience as ex
from harness.backends.ray.driver.calls import Call
from harness.backends.ray.driver.dispatch import RunningUnit, UnitRun
from harness.backends.ray.driver.iteration import Iteration
from harness.backends.ray.driver.off_policy import recorded_window
from harness.backends.ray.protocol import CloseSession, Export, KvMove, Migrate, OpenSession, Steps, Submit
from harness.backends.ray.replies import Result, SessionProgress
from harness.core import metrics as mk
from harness.core.plan import Plan, TaskKind
from harness.core.trace import SampleRecord, StepTrace
from harness.core.units import execution_units
from harness.core.workload import Batch, draw_batch
from harness.planning.iterations import tagged, weights_feeders
from harness.planning.memory import check_plan_memory
from harness.planning.rollout import RolloutEvent, run_continuous
from harness.real.engine import sample_seed


class ContinuousExecution:
    """Iterations ``0 .. num_iterations - 1`` of continuous-rollout ``plan`` on ``backend``'s workers
    (:class:`~.backend.RayBackend`), one window at a time (module docstring)."""

    def __init__(self, backend, plan: Plan, num_iterations: int):
        self.backend, self.plan, self.num_iterations = backend, plan, num_iterations
        ctx = backend.ctx
        self.ctx, self.group, self.opts = ctx, backend.group, backend.opts
        memory = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
        self.batches: dict[int, Batch] = {}
        run = run_continuous(ctx, plan, memory, self._batch, num_iterations, record_spans=False)
        self.events: list[RolloutEvent] = run.events
        (self.gen,) = plan.tasks_of(TaskKind.GENERATE)
        self.alloc = self.gen.allocation
        s = self.alloc.strategy
        self.instances = [list(self.alloc.replica_devices(r)) for r in range(s.dp)]
        feeders = set(weights_feeders(plan, self.gen))
        units = execution_units(plan)
        self.moves = [u for u in units if set(u.names) & feeders]
        self.trainer_units = [u for u in units if self.gen.name not in u.names and u not in self.moves]
        self.trains = [t.name for t in plan.tasks_of(TaskKind.TRAIN)]
        self.n = self._batch(0).num_samples  # samples a batch
        self.t0 = time.time()
        # the generation engines' spans and memory (an Iteration's recording, for no iteration)
        self.recorder = Iteration(backend, plan, 0, self._batch(0), self.t0)
        self.prompts: dict[int, list[int]] = {}  # global sample id -> prompt tokens
        self.drawn: set[int] = set()  # iterations whose prompts are drawn
        self.responses: dict[int, tuple[list[int], list[float]]] = {}
        self.finish_s: dict[int, float] = {}
        self.first_version: dict[int, int] = {}
        self.last_version: dict[int, int] = {}
        self.engine_of: dict[int, int] = {}
        self.left = [0] * len(self.instances)  # unfinished samples per engine
        self.next_finish = [1] * len(self.instances)
        self.engine_steps = [0] * len(self.instances)  # decode steps each engine has run
        self.version = 0  # loaded in the engines
        self.iterations: dict[int, Iteration] = {}
        self.train_end: dict[int, float] = {}
        self.unit_start_s: dict[str, float] = {}
        self.trainer: tuple[int, RunningUnit] | None = None  # the iteration training, and its run
        self.interrupted = self.dropped = 0
        self.position = 0  # next event
        self.opened = False

    def _batch(self, k: int) -> Batch:
        if k not in self.batches:
            ctx = self.ctx
            self.batches[k] = draw_batch(ctx.workload, ctx.seed, k, ctx.algorithm)
        return self.batches[k]

    # ---- calls ----------------------------------------------------------------------------
    def _each(self, request_of, engines) -> list[list[Result]]:
        """One request per engine, all started, waited for while the trainer's calls are driven."""
        calls = [self.group.start(request_of(r), self.instances[r]) for r in engines]
        self._wait(calls)
        return [c.results for c in calls]

    def _wait(self, calls: list[Call]) -> None:
        """Until every one of ``calls`` has finished, driving the running trainer meanwhile."""
        pending = list(calls)
        while pending:
            trainer_calls = self.trainer[1].waiting if self.trainer is not None else []
            done = self.group.collect(pending + trainer_calls)
            if any(done is c for c in pending):
                pending = [c for c in pending if c is not done]
            else:
                self._resume_trainer(done)

    def _report(self, r: int, results: list[Result[SessionProgress]]) -> SessionProgress:
        return next(res for res in results if res.rank == self.instances[r][0]).out

    # ---- the trainer ----------------------------------------------------------------------
    def _trainer_run(self, it: Iteration) -> UnitRun:
        table = it.handlers()
        for unit in self.trainer_units:
            self.unit_start_s[tagged(unit.label, it.iteration)] = time.time() - self.t0
            yield from table[unit.kind](unit)

    def _resume_trainer(self, done: Call | None) -> None:
        k, running = self.trainer
        if running.resume(done):
            self.trainer = None
            it = self.iterations[k]
            self.train_end[k] = max(sp.end_s for sp in it.trace.spans if sp.task in self.trains)
            if self.opts.digest:  # the weights this step made, before they move anywhere
                it.digest()

    def _finish_trainer(self) -> None:
        while self.trainer is not None:
            self._resume_trainer(self.group.collect(self.trainer[1].waiting))

    # ---- events ---------------------------------------------------------------------------
    def _open(self) -> None:
        """Fill the engines' copy of the weights (version 0) and open a session on every engine."""
        it0 = self.recorder
        for unit in self.moves:
            self._run_alone(it0.handlers()[unit.kind](unit))
            self.unit_start_s.setdefault(tagged(unit.label, 0), 0.0)
        w, policy = self.ctx.workload, self.plan.generation
        base = dict(sample_ids=[], prompts=[], target_lens=[], max_batch_size=policy.max_batch_size or 1 << 16,
                    temperature=self.opts.temperature, sampling_seed=ex.stable_seed("sampling", self.ctx.seed),
                    kv_capacity=int(w.prompt_len.max + w.max_gen_len))
        self._each(lambda r: OpenSession(self.gen.name, "actor", self.alloc, **base), range(len(self.instances)))
        self.opened = True

    def _run_alone(self, run: UnitRun) -> None:
        """A handler with no generation call in flight (a weight movement), the trainer idle."""
        running = RunningUnit(tuple(u.label for u in self.moves), set(), run)
        finished = running.resume(None)
        while not finished:
            finished = running.resume(self.group.collect(running.waiting))

    def _launch(self, event: RolloutEvent) -> None:
        held = self.backend.homes.held("actor", self.alloc)
        if held != self.version:
            raise RuntimeError(f"continuous rollout: the engines hold weights version {held}, the schedule "
                               f"{self.version}")
        by_engine: dict[int, list[int]] = {}
        for gid, r in zip(event.sample_ids, event.engines):
            by_engine.setdefault(r, []).append(gid)
            j = gid // self.n
            if j not in self.drawn:  # iteration j's prompts, as a synchronous iteration draws them
                self.drawn.add(j)
                tokens = ex.prompt_tokens(self.ctx.seed, j, self._batch(j), self.backend.args["actor"].vocab_size,
                                          self.ctx.algorithm.group_size)
                self.prompts.update({j * self.n + q: p for q, p in enumerate(tokens)})
            self.first_version[gid] = self.version
            self.engine_of[gid] = r

        def submit(r: int) -> Submit:
            ids = by_engine[r]
            return Submit(self.gen.name, "actor", self.alloc, sample_ids=tuple(ids),
                          prompts=tuple(self.prompts[g] for g in ids),
                          target_lens=tuple(int(self._batch(g // self.n).output_lens[g % self.n]) for g in ids),
                          generator_seeds=tuple(sample_seed(ex.stable_seed("sampling", self.ctx.seed, g // self.n),
                                                            g % self.n) for g in ids))
        engines = sorted(by_engine)
        for r, results in zip(engines, self._each(submit, engines)):
            report = self._report(r, results)
            self.left[r], self.next_finish[r] = report.left, max(1, report.next_finish)

    def _steps(self, steps: dict[int, int]) -> None:
        """Advance engine ``r`` by ``steps[r]`` decode steps (all at once, the trainer driven meanwhile)."""
        engines = sorted(r for r, n in steps.items() if n > 0 and self.left[r] > 0)
        results = self._each(lambda r: Steps(self.gen.name, "actor", self.alloc, max_steps=steps[r]), engines)
        for r, res in zip(engines, results):
            self.recorder.record(self.gen.name, res)
            report = self._report(r, res)
            self.left[r], self.next_finish[r] = report.left, max(1, report.next_finish)
            self.engine_steps[r] = report.engine_steps
            for sample in report.finished:
                self.responses[sample.sample_id] = (sample.tokens, sample.logprobs)
                self.finish_s[sample.sample_id] = sample.finish_time_s - self.t0
                self.last_version[sample.sample_id] = self.version

    def _advance(self, event: RolloutEvent) -> None:
        """Every engine up to the decode steps the simulator's had run when it took ``event``."""
        self._steps({r: target - self.engine_steps[r] for r, target in enumerate(event.engine_steps)})

    def _until_finished(self, gid: int) -> None:
        """Sample ``gid`` finished: the engines at the event's steps, then, should the engines differ
        from the simulator's, every engine with work stepped in lockstep until it has."""
        while gid not in self.responses:
            active = [r for r in range(len(self.instances)) if self.left[r] > 0]
            if self.engine_of[gid] not in active:
                raise RuntimeError(f"continuous rollout: sample {gid} is not generating on engine "
                                   f"{self.engine_of[gid]}")
            steps = max(1, min(self.next_finish[r] for r in active))
            self._steps({r: steps for r in active})

    def _train(self, event: RolloutEvent) -> None:
        k = event.version
        bound = self.plan.off_policy.max_staleness
        ids = sorted(event.sample_ids)
        stale = max(k - self.first_version[g] for g in ids)
        if not 0 <= stale <= bound:
            raise RuntimeError(f"continuous rollout: iteration {k} would train samples {stale} versions stale; "
                               f"the plan's bound is {bound}")
        batch = Batch(k, np.array([len(self.prompts[g]) for g in ids], dtype=np.int64),
                      np.array([int(self._batch(g // self.n).output_lens[g % self.n]) for g in ids], dtype=np.int64))
        it = Iteration(self.backend, self.plan, k, batch, self.t0)
        it.prompts = [self.prompts[g] for g in ids]
        it.trace.samples = [SampleRecord(j, len(self.prompts[g]), len(self.responses[g][0]), self.finish_s[g],
                                         self.first_version[g], self.last_version[g]) for j, g in enumerate(ids)]
        it.set_rollout({j: self.responses[g] for j, g in enumerate(ids)}, "continuous rollout")
        self.dropped += len(event.dropped)
        it.trace.counters[mk.INTERRUPTED_SAMPLES] = float(self.interrupted)
        it.trace.counters[mk.DROPPED_SAMPLES] = float(self.dropped)
        self.interrupted = self.dropped = 0
        self.iterations[k] = it
        names = tuple(n for u in self.trainer_units for n in u.names)
        self.trainer = (k, RunningUnit(names, set(), self._trainer_run(it)))
        self._resume_trainer(None)

    def _update(self, event: RolloutEvent) -> None:
        self._finish_trainer()
        step = event.version - 1
        exported: dict[int, list[Result]] = {}
        if self.plan.off_policy.weight_update == "interrupt":
            active = [r for r in range(len(self.instances)) if self.left[r] > 0]
            for r, res in zip(active, self._each(lambda r: Export(self.gen.name, "actor", self.alloc,
                                                                     with_kv=False), active)):
                exported[r] = res
        it = self.iterations[step]
        for unit in self.moves:
            self.unit_start_s[tagged(unit.label, event.version)] = time.time() - self.t0
            self._run_alone(it.handlers()[unit.kind](unit))
        self.version = event.version
        if self.backend.homes.held("actor", self.alloc) != self.version:
            raise RuntimeError(f"continuous rollout: weights version {self.version} did not reach the engines")
        moves = []
        for r, res in exported.items():
            samples = self._report(r, res).samples
            self.interrupted += sum(1 for s in samples if s.tokens)
            moves += [KvMove(d, d, sample, {}) for sample in samples for d in self.instances[r]]
        if moves:  # back into the same engines, prefilled again under the new weights
            devices = sorted({m.dst for m in moves})
            self._wait([self.group.start(Migrate(self.gen.name, "actor", self.alloc, moves=tuple(moves),
                                                 with_kv=False), devices)])
            for r in exported:
                self.next_finish[r] = 1

    def _step(self) -> None:
        event = self.events[self.position]
        self.position += 1
        self._advance(event)
        {"launch": self._launch, "finish": lambda e: self._until_finished(e.sample_ids[0]),
         "train": self._train, "update": self._update}[event.kind](event)

    # ---- windows --------------------------------------------------------------------------
    def window(self, k: int) -> StepTrace:
        """Iteration ``k``'s window: the events run until iteration ``k``'s training has finished."""
        if k >= self.num_iterations or k != len(self.train_end):
            raise RuntimeError(f"backend=ray runs a continuous rollout's {self.num_iterations} iterations in order "
                               f"(backend.num_iterations); iteration {k} was asked for")
        calls_before = self.group.num_calls
        if not self.opened:
            self._open()
        while k not in self.train_end:
            if self.position >= len(self.events):
                self._finish_trainer()
                break
            self._step()
        lo, hi = (self.train_end[k - 1] if k else 0.0), self.train_end[k]
        recordings = [self.recorder.trace, *(it.trace for it in self.iterations.values())]
        return recorded_window(k, lo, hi, recordings, self.iterations[k].trace, k, self.unit_start_s, [],
                               self.group.num_calls - calls_before)

    def close(self) -> None:
        """Close the engines' sessions (a run that ends with generation still ahead of training)."""
        if self.opened and self.group is not None and self.group.healthy:
            self._finish_trainer()
            self._each(lambda r: CloseSession(self.gen.name, "actor", self.alloc), range(len(self.instances)))
            self.opened = False
