"""Driver side of RLHFuse's inter-stage fusion (section 4) on ``backend=ray``.

One generate task and the inference tasks that consume its stream (``Task.stream_from``) run as
one unit, started when the scheduler starts the pair: :meth:`StreamedGeneration.run` is the
generate task's handler (a :data:`~harness.backends.ray.driver.dispatch.UnitRun`), driven by the
driver's one dispatch loop beside the other units. While generation rounds run it waits on the
calls of every active generation instance and every busy inference replica at once, and goes on
with whichever finishes first:

1. every generation instance (a dp replica of the generate task's allocation) opens a session and
   all instances are advanced in lockstep rounds that end at the next step in which any sample
   finishes (each instance reports how many steps away its next finish is; the round is the least
   of them, 1 where an engine cannot tell). The unfinished count changes only when a sample
   finishes, so checking it at round ends sees every change, at the same engine step as checking
   after every token did, with one driver round trip per finish event instead of one per token
   (docs/SIM_VS_REAL.md measures it); each finished sample is queued for inference the round it
   finishes, with its real finish time;
2. an instance whose samples are all finished releases its devices; an inference replica (a dp
   replica of the shared inference allocation) whose devices are all released (or never held by
   generation: disaggregated inference takes samples from the start) takes up to
   ``micro_batch_size`` queued samples and runs ref, reward and critic forward passes on them
   (in that order, on its own devices) while generation goes on elsewhere; which replica takes
   which samples is the simulator's rule (:class:`harness.planning.scheduler.StreamFeed`: the
   replica idle longest, in finish order);
3. with a migration policy, once fewer than R_t samples are unfinished, every unfinished
   sample leaves the non-tail instances for the ``num_tail_instances`` instances holding the most
   (spread round-robin; the decisions are the simulator's own,
   :mod:`harness.planning.taskmodels.migration`), its KV cache sent device to device
   (:func:`harness.backends.ray.worker.streaming.migrate`; tokens only with ``transfer=tokens``); the
   released instances' devices then run inference.

Two differences from the plan's timing, both stated in docs: the critic's weights are moved to the
inference layout once, before generation starts (a worker busy generating cannot serve a
point-to-point send of its training shard mid-generation, so the per-replica fetch at release time
is not reproduced), and finished samples are reported at round ends (the step they finish in, but
after the round's other instances have reached that step too).
"""
from __future__ import annotations

from collections.abc import Generator

import numpy as np

from harness.backends.ray.driver import experience as ex
from harness.backends.ray.driver.calls import Call
from harness.backends.ray.driver.dispatch import UnitRun, outputs
from harness.backends.ray.protocol import CloseSession, Export, KvMove, Migrate, OpenSession, Request, Steps
from harness.backends.ray.replies import Result, SessionProgress
from harness.core import metrics as mk
from harness.core.plan import Task
from harness.core.units import Unit
from harness.planning.scheduler import StreamFeed
from harness.planning.taskmodels import migration as mg
from harness.planning.taskmodels.generation import dispatch_samples


class StreamedGeneration:
    """The stream of generate unit ``gen_unit`` into the inference unit ``stream_unit`` in iteration
    ``it`` (:class:`harness.backends.ray.driver.iteration.Iteration`), which it writes the samples,
    the rollout and the inference outputs of."""

    def __init__(self, it, gen_unit: Unit, stream_unit: Unit):
        self.it, self.group = it, it.group
        (self.gen,) = gen_unit.tasks
        self.consumers: list[Task] = list(stream_unit.tasks)
        self.alloc = self.gen.allocation
        self.inf_alloc = self.consumers[0].allocation
        if any(t.allocation != self.inf_alloc for t in self.consumers):
            raise RuntimeError(f"streamed inference tasks {[t.name for t in self.consumers]} must share one allocation")
        s = self.alloc.strategy
        self.instances = [list(self.alloc.replica_devices(k)) for k in range(s.dp)]
        # round-robin, or under a length dispatch the instances it names (the simulator's rule)
        self.ids = {k: ids.tolist() for k, ids in enumerate(dispatch_samples(it.plan.generation, s.dp,
                                                                            it.batch.output_lens))}
        self.left = {k: len(v) for k, v in self.ids.items()}
        self.responses: dict[int, tuple[list[int], list[float]]] = {}
        # devices generation does not use are free from the start (a replica there takes samples at once)
        self.released: set[int] = set(range(it.ctx.num_devices)) - set(self.alloc.mesh)
        self.replicas = [set(self.inf_alloc.replica_devices(j)) for j in range(self.inf_alloc.strategy.dp)]
        # which replica takes which finished samples: the simulator's rule (planning.scheduler.StreamFeed)
        self.feed = StreamFeed(len(self.replicas), it.ctx.workload.micro_batch_size)
        self.busy_replicas: dict[int, list[tuple[Call, Task, np.ndarray]]] = {}  # replica -> its in-flight calls
        self.parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {t.model.value: [] for t in self.consumers}
        self.migrated_samples, self.tail_instances = 0, 0
        self.next_finish: dict[int, int] = {}  # instance -> engine steps until its next sample finishes

    # ---- calls ----------------------------------------------------------------------------
    def _request(self, kind: type[Request], **fields) -> Request:
        return kind(self.gen.name, "actor", self.alloc, **fields)

    def _each(self, request_of, instances) -> Generator[list[Call], Call, list[list[Result]]]:
        """One request per instance (``request_of(k)``) to its devices, all started, then every
        result awaited in instance order; returns the results per instance."""
        calls = [self.group.start(request_of(k), self.instances[k]) for k in instances]
        out = []
        for call in calls:
            done = yield [call]
            out.append(done.results)
        return out

    def run(self) -> UnitRun:
        it, policy = self.it, self.it.plan.generation
        yield from it.ensure_current(self.gen.name, "actor", self.alloc)
        for t in self.consumers:  # ref/reward are resident; the critic is resharded up front (see module doc)
            yield from it.ensure_current(t.name, t.model.value, t.allocation)
        w = it.ctx.workload
        base = dict(prompts=it.prompts, target_lens=it.batch.output_lens.tolist(),
                    max_batch_size=policy.max_batch_size or it.batch.num_samples, temperature=it.opts.temperature,
                    sampling_seed=ex.stable_seed("sampling", it.ctx.seed, it.iteration),
                    kv_capacity=int(it.batch.prompt_lens.max() + w.max_gen_len))
        opened = yield from self._each(lambda k: self._request(OpenSession, sample_ids=self.ids[k], **base),
                                       range(len(self.instances)))
        for k, results in enumerate(opened):
            self.next_finish[k] = self._report(k, results).next_finish
        migration = policy.migration
        threshold = mg.threshold(migration.threshold_frac, it.batch.num_samples) if migration else None
        active = [k for k in range(len(self.instances)) if self.left[k] > 0]
        for j, devices in enumerate(self.replicas):  # replicas beside generation, not on its devices
            if devices <= self.released:
                self.feed.available(j)
        for k in range(len(self.instances)):
            if self.left[k] == 0:
                self._release(k)
        while active:
            yield from self._round(active)
            for k in [k for k in active if self.left[k] == 0]:
                active.remove(k)
                self._release(k)
            unfinished = sum(self.left[k] for k in active)
            # the simulator's rule (planning/taskmodels/migration.py): once fewer than R_t are unfinished
            if threshold is not None and mg.due(unfinished, threshold) and len(active) > 1:
                active = yield from self._migrate(active, migration)
                threshold = None  # the tail migrates once
        yield from self._each(lambda k: self._request(CloseSession), range(len(self.instances)))
        while not self.feed.drained:
            self._feed()
            if not self.busy_replicas:
                raise RuntimeError(f"streamed inference {[t.name for t in self.consumers]}: samples wait but generation "
                                   f"released the devices of no inference replica {self.replicas}")
            yield from self._collect_one([])
        self._finish(migration)

    # ---- generation rounds ----------------------------------------------------------------
    def _report(self, k: int, results: list[Result[SessionProgress]]) -> SessionProgress:
        """What instance ``k``'s tp rank 0 reported."""
        return next(r for r in results if r.rank == self.instances[k][0]).out

    def _round(self, active: list[int]) -> UnitRun:
        steps = 1  # backend.options.stream_rounds=one_step
        if self.it.opts.stream_rounds == "to_next_finish":
            steps = min(self.next_finish[k] for k in active)  # up to the next finish of any instance
        calls = {k: self.group.start(self._request(Steps, max_steps=steps), self.instances[k]) for k in active}
        while calls:
            self._feed()
            done = yield from self._collect_one(list(calls.values()))
            if done is None:
                continue
            k = next(k for k, c in calls.items() if c is done)
            del calls[k]
            self.it.record(self.gen.name, done.results)
            report = self._report(k, done.results)
            self.left[k] = report.left
            self.next_finish[k] = report.next_finish
            for sample in report.finished:
                self.responses[sample.sample_id] = (sample.tokens, sample.logprobs)
                self.feed.finished((sample.sample_id,))
                self.it.record_sample(sample)

    def _release(self, k: int) -> None:
        self.released |= set(self.instances[k])
        for j, devices in enumerate(self.replicas):
            if devices <= self.released:
                self.feed.available(j)

    # ---- inference fed by the stream ------------------------------------------------------
    def _feed(self) -> None:
        """Start every micro-batch the feeding rule gives an idle replica whose devices generation released."""
        for j, rows in self.feed.take():
            devices = self.replicas[j]
            prompts = [self.it.prompts[i] for i in rows]
            sub = ex.build_rollout(prompts, {n: self.responses[i] for n, i in enumerate(rows)})
            calls = []
            for task in self.consumers:
                call = self.group.start(self.it.infer_request(task, sub, rows=list(range(len(rows)))), devices)
                calls.append((call, task, np.asarray(rows)))
            self.busy_replicas[j] = calls

    def _collect_one(self, gen_calls: list[Call]) -> Generator[list[Call], Call, Call | None]:
        """Wait for the next of ``gen_calls`` and the inference calls to finish; returns it if it is
        one of ``gen_calls`` (None for an inference call, whose output is kept)."""
        inference = {id(c): (j, c, task, rows) for j, calls in self.busy_replicas.items() for c, task, rows in calls}
        done = yield gen_calls + [c for _, c, _, _ in inference.values()]
        if id(done) not in inference:
            return done
        j, call, task, rows = inference[id(done)]
        self.it.record(task.name, done.results)
        for part in outputs(done.results):
            self.parts[task.model.value].append((rows[part.rows], part.values))
        self.busy_replicas[j] = [x for x in self.busy_replicas[j] if x[0] is not call]
        if not self.busy_replicas[j]:
            del self.busy_replicas[j]
            self.feed.done(j)
        return None

    # ---- long-tail migration --------------------------------------------------------------
    def _migrate(self, active: list[int], policy) -> Generator[list[Call], Call, list[int]]:
        tails, sources = mg.tail_instances({k: self.left[k] for k in active}, policy.num_tail_instances)
        with_kv = policy.transfer == "kv"
        exports = {}
        for k in sources:
            (exports[k],) = yield from self._each(lambda _: self._request(Export, with_kv=with_kv), [k])
        moves = []
        for k in sources:
            by_rank = {r.rank: r.out for r in exports[k]}
            samples = by_rank[self.instances[k][0]].samples
            for j, sample in enumerate(samples):
                dst = mg.destination(tails, k, j)
                for src_dev, dst_dev in zip(self.instances[k], self.instances[dst]):
                    moves.append(KvMove(src_dev, dst_dev, sample, by_rank[src_dev].kv_shapes.get(sample.sample_id, {})))
                self.left[dst] += 1
            self.migrated_samples += len(samples)
            self.left[k] = 0
        devices = sorted({d for k in sources + tails for d in self.instances[k]})
        done = yield [self.group.start(self._request(Migrate, moves=tuple(moves), with_kv=with_kv), devices)]
        senders = {d for k in sources for d in self.instances[k]}
        self.it.record(self.gen.name, [r for r in done.results if r.rank in senders])
        for k in sources:
            self._release(k)
        for k in tails:  # their batches changed: one step, then they report again
            self.next_finish[k] = 1
        self.tail_instances = len(tails)
        return tails

    # ---- results --------------------------------------------------------------------------
    def _finish(self, migration) -> None:
        it = self.it
        it.set_rollout(self.responses, "streamed generation")
        r = it.rollout
        for task in self.consumers:
            role = task.model.value
            what = ex.INFERENCE_OUTPUT[role]
            full = np.zeros((len(r.prompt_lens),) if what == "score" else r.action_mask.shape, dtype=np.float32)
            for rows, out in self.parts[role]:
                if what == "score":
                    full[rows] = out
                else:
                    full[rows, :out.shape[1]] = out
            it.outputs[role] = full
        if migration is not None:
            it.trace.counters[mk.MIGRATED_SAMPLES] = self.migrated_samples
            it.trace.counters[mk.TAIL_INSTANCES] = self.tail_instances
            it.trace.counters[mk.MIGRATION_THRESHOLD_FRAC] = migration.threshold_frac
