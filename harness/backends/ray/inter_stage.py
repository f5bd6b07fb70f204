"""Driver side of RLHFuse's inter-stage fusion (section 4) on ``backend=ray``.

One generate task and the inference tasks that consume its stream (``Task.stream_from``) run as
one process, started when the scheduler starts the pair and run on a driver thread of its own
(:class:`harness.backends.ray.calls.BackgroundCall`) beside the driver's other units:

1. every generation instance (a dp replica of the generate task's allocation) opens a session and
   all instances are advanced in lockstep rounds that end at the next step in which any sample
   finishes (each instance reports how many steps away its next finish is; the round is the least
   of them, 1 where an engine cannot tell). The unfinished count changes only when a sample
   finishes, so checking it at round ends sees every change, at the same engine step as checking
   after every token did, with one driver round trip per finish event instead of one per token
   (docs/SIM_VS_REAL.md measures it); each finished sample is queued for inference the round it
   finishes, with its real finish time;
2. an instance whose samples are all finished releases its devices; an inference replica (a dp
   replica of the shared inference allocation) whose devices are all released takes up to
   ``micro_batch_size`` queued samples and runs ref, reward and critic forward passes on them
   (in that order, on its own devices) while generation goes on elsewhere; which replica takes
   which samples is the simulator's rule (:class:`harness.planning.scheduler.StreamFeed`: the
   replica idle longest, in finish order);
3. with a migration policy, once fewer than R_t samples are unfinished, every unfinished
   sample leaves the non-tail instances for the ``num_tail_instances`` instances holding the most
   (spread round-robin; the decisions are the simulator's own,
   :mod:`harness.planning.taskmodels.migration`), its KV cache sent device to device
   (:func:`harness.backends.ray.streaming.migrate`; tokens only with ``transfer=tokens``); the
   released instances' devices then run inference.

Two differences from the plan's timing, both stated in docs: the critic's weights are moved to the
inference layout once, before generation starts (a worker busy generating cannot serve a
point-to-point send of its training shard mid-generation, so the per-replica fetch at release time
is not reproduced), and finished samples are reported at round ends (the step they finish in, but
after the round's other instances have reached that step too).
"""
from __future__ import annotations

import numpy as np

from harness.core import metrics as mk
from harness.backends.ray import experience as ex
from harness.backends.ray.protocol import CloseSession, Export, Infer, Migrate, OpenSession, Steps
from harness.backends.ray.rewards import reward_fields
from harness.core.units import Unit
from harness.planning.scheduler import StreamFeed
from harness.planning.taskmodels import migration as mg
from harness.core.trace import SampleRecord


class StreamedGeneration:
    def __init__(self, it, gen_unit: Unit, stream_unit: Unit):
        self.it, self.b, self.group = it, it.b, it.group
        (self.gen,) = gen_unit.tasks
        self.consumers = list(stream_unit.tasks)
        self.alloc = self.gen.allocation
        self.inf_alloc = self.consumers[0].allocation
        if any(t.allocation != self.inf_alloc for t in self.consumers):
            raise RuntimeError(f"streamed inference tasks {[t.name for t in self.consumers]} must share one allocation")
        s = self.alloc.strategy
        self.instances = [list(self.alloc.replica_devices(k)) for k in range(s.dp)]
        n = it.batch.num_samples
        self.ids = {k: list(range(k, n, s.dp)) for k in range(s.dp)}
        self.left = {k: len(v) for k, v in self.ids.items()}
        self.responses: dict[int, tuple[list[int], list[float]]] = {}
        self.released: set[int] = set()
        self.replicas = [set(self.inf_alloc.replica_devices(j)) for j in range(self.inf_alloc.strategy.dp)]
        # which replica takes which finished samples: the simulator's rule (planning.scheduler.StreamFeed)
        self.feed = StreamFeed(len(self.replicas), it.ctx.workload.micro_batch_size)
        self.busy_replicas: dict[int, list] = {}  # replica -> its in-flight calls
        self.parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {t.model.value: [] for t in self.consumers}
        self.migrated_samples, self.tail_instances = 0, 0
        self.next_finish: dict[int, int] = {}  # instance -> engine steps until its next sample finishes

    # ---- calls ----------------------------------------------------------------------------
    def _request(self, kind, **fields):
        return kind(self.gen.name, "actor", self.alloc, **fields)

    def _all(self, request_of, instances) -> list:
        """One request per instance (``request_of(k)``) to its devices, every result awaited."""
        calls = [self.group.start(request_of(k), self.instances[k]) for k in instances]
        return [self.group.collect([c]).results for c in calls]

    def run(self) -> None:
        it, policy = self.it, self.it.plan.generation
        it._ensure(self.gen.name, "actor", self.alloc)
        for t in self.consumers:  # ref/reward are resident; the critic is resharded up front (see module doc)
            it._ensure(t.name, t.model.value, t.allocation)
        w = it.ctx.workload
        base = dict(prompts=it.prompts, target_lens=it.batch.output_lens.tolist(),
                    max_batch_size=policy.max_batch_size or it.batch.num_samples, temperature=it.opts.temperature,
                    sampling_seed=ex.stable_seed("sampling", it.ctx.seed, it.iteration),
                    kv_capacity=int(it.batch.prompt_lens.max() + w.max_gen_len))
        opened = self._all(lambda k: self._request(OpenSession, sample_ids=self.ids[k], **base),
                           range(len(self.instances)))
        for k, results in enumerate(opened):
            self.next_finish[k] = self._report(k, results)["next_finish"]
        migration = policy.migration
        threshold = mg.threshold(migration.threshold_frac, it.batch.num_samples) if migration else None
        active = [k for k in range(len(self.instances)) if self.left[k] > 0]
        for k in range(len(self.instances)):
            if self.left[k] == 0:
                self._release(k)
        while active:
            self._round(active)
            for k in [k for k in active if self.left[k] == 0]:
                active.remove(k)
                self._release(k)
            unfinished = sum(self.left[k] for k in active)
            # the simulator's rule (planning/taskmodels/migration.py): once fewer than R_t are unfinished
            if threshold is not None and mg.due(unfinished, threshold) and len(active) > 1:
                active = self._migrate(active, migration)
                threshold = None  # the tail migrates once
        self._all(lambda k: self._request(CloseSession), range(len(self.instances)))
        while not self.feed.drained:
            self._feed()
            if not self.busy_replicas:
                raise RuntimeError(f"streamed inference {[t.name for t in self.consumers]}: samples wait but generation "
                                   f"released the devices of no inference replica {self.replicas}")
            self._collect_one([])
        self._finish(migration)

    # ---- generation rounds ----------------------------------------------------------------
    def _report(self, k: int, results: list) -> dict:
        """What instance ``k``'s tp rank 0 reported."""
        return next(r for r in results if r.rank == self.instances[k][0]).out

    def _round(self, active: list[int]) -> None:
        steps = 1  # backend.options.stream_rounds=one_step
        if self.it.opts.stream_rounds == "to_next_finish":
            steps = min(self.next_finish[k] for k in active)  # up to the next finish of any instance
        calls = {k: self.group.start(self._request(Steps, max_steps=steps), self.instances[k]) for k in active}
        while calls:
            self._feed()
            done = self._collect_one(list(calls.values()))
            if done is None:
                continue
            k = next(k for k, c in calls.items() if c is done)
            del calls[k]
            self.b.spans_from(self.gen.name, done.results, self.it.t0, self.it.trace)
            report = self._report(k, done.results)
            self.left[k] = report["left"]
            self.next_finish[k] = report["next_finish"]
            for sample_id, tokens, logprobs, finish in report["finished"]:
                self.responses[sample_id] = (tokens, logprobs)
                self.feed.finished((sample_id,))
                self.it.trace.samples.append(SampleRecord(int(sample_id), int(self.it.batch.prompt_lens[sample_id]),
                                                          len(tokens), finish - self.it.t0))

    def _release(self, k: int) -> None:
        self.released |= set(self.instances[k])
        for j, devices in enumerate(self.replicas):
            if devices <= self.released:
                self.feed.available(j)

    # ---- inference fed by the stream ------------------------------------------------------
    def _feed(self) -> None:
        """Start every micro-batch the feeding rule gives an idle replica whose devices generation released."""
        mbs = self.it.ctx.workload.micro_batch_size
        for j, rows in self.feed.take():
            devices = self.replicas[j]
            prompts = [self.it.prompts[i] for i in rows]
            sub = ex.build_rollout(prompts, {n: self.responses[i] for n, i in enumerate(rows)})
            calls = []
            for task in self.consumers:
                role = task.model.value
                request = Infer(task.name, role, task.allocation, tokens=sub.tokens, attn=sub.attn,
                                last_index=sub.last_index, what=ex.INFERENCE_OUTPUT[role], micro_batch_size=mbs,
                                temperature=self.it.opts.temperature, rows=list(range(len(rows))),
                                **reward_fields(role, sub.prompt_lens, self.b.reward_spec))
                call = self.group.start(request, devices)
                calls.append((call, task, np.asarray(rows)))
            self.busy_replicas[j] = calls

    def _collect_one(self, gen_calls: list):
        """Wait for the next call to finish; return it if it is one of ``gen_calls``."""
        inference = {id(c): (j, c, task, rows) for j, calls in self.busy_replicas.items() for c, task, rows in calls}
        done = self.group.collect(gen_calls + [c for _, c, _, _ in inference.values()])
        if id(done) not in inference:
            return done
        j, call, task, rows = inference[id(done)]
        self.b.spans_from(task.name, done.results, self.it.t0, self.it.trace)
        for part in self.b.outputs(done.results):
            self.parts[task.model.value].append((rows[part["index"]], part["out"]))
        self.busy_replicas[j] = [x for x in self.busy_replicas[j] if x[0] is not call]
        if not self.busy_replicas[j]:
            del self.busy_replicas[j]
            self.feed.done(j)
        return None

    # ---- long-tail migration --------------------------------------------------------------
    def _migrate(self, active: list[int], policy) -> list[int]:
        tails, sources = mg.tail_instances({k: self.left[k] for k in active}, policy.num_tail_instances)
        with_kv = policy.transfer == "kv"
        exports = {k: self._all(lambda _: self._request(Export, with_kv=with_kv), [k])[0] for k in sources}
        moves = []
        for k in sources:
            by_rank = {r.rank: r.out for r in exports[k]}
            samples = by_rank[self.instances[k][0]]["samples"]
            for j, sample in enumerate(samples):
                dst = mg.destination(tails, k, j)
                for t, (src_dev, dst_dev) in enumerate(zip(self.instances[k], self.instances[dst])):
                    moves.append({"src": src_dev, "dst": dst_dev, "sample": sample,
                                  "shapes": by_rank[src_dev]["kv_shapes"].get(sample["sample_id"], {})})
                self.left[dst] += 1
            self.migrated_samples += len(samples)
            self.left[k] = 0
        devices = sorted({d for k in sources + tails for d in self.instances[k]})
        results = self.group.call(self._request(Migrate, moves=moves, with_kv=with_kv), devices)
        self.b.spans_from(self.gen.name, [r for r in results if r.rank in
                                          {d for k in sources for d in self.instances[k]}], self.it.t0, self.it.trace)
        for k in sources:
            self._release(k)
        for k in tails:  # their batches changed: one step, then they report again
            self.next_finish[k] = 1
        self.tail_instances = len(tails)
        return tails

    # ---- results --------------------------------------------------------------------------
    def _finish(self, migration) -> None:
        it = self.it
        missing = sorted(set(range(it.batch.num_samples)) - set(self.responses))
        if missing:
            raise RuntimeError(f"streamed generation returned no response for samples {missing[:8]}")
        it.trace.samples.sort(key=lambda s: s.sample_id)
        it.rollout = ex.build_rollout(it.prompts, self.responses)
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

