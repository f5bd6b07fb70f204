"""The Ray driver's core -- iteration dispatch, streamed generation and its inference, training
dispatch, failures -- in-process, without Ray: the real :class:`RayBackend`, :class:`Iteration` and
:class:`WorkerGroup` send their typed requests to a fake group of device workers that answers each
request at once from the request alone, in the worker's own reply types.

The fake's answers are simple closed forms, so every check has an oracle: sample ``i`` generates
``target_lens[i]`` copies of token ``i + 1`` (its last token names it); an inference pass outputs
a function of each row's tokens (the same for a row however it was batched); the device computing a
loss reports :data:`LOSS` per model. A generation session advances every unfinished sample by one
token per engine step, as continuous batching with free slots does.
"""
from __future__ import annotations

import functools
import time
import types

import numpy as np
import pytest

from harness.backends.ray.driver.backend import RayBackend
from harness.backends.ray.driver.calls import WorkerFailedError
from harness.backends.ray.driver.calls import WorkerGroup
from harness.backends.ray.driver.homes import ModelHomes
from harness.backends.ray.driver.iteration import Iteration
from harness.backends.ray.protocol import (CloseSession, Export, ExportedSample, Generate, Infer, Migrate, Move,
                                           OpenSession, Release, Request, Steps, Train)
from harness.backends.ray.replies import (Exported, FinishedSample, Generated, Inferred, ModelTrained, Moved,
                                          PpoStats, Released, Result, SessionProgress, Trained)
from harness.core import metrics as mk
from harness.core.plan import (Allocation, GenerationPolicy, MigrationPolicy, ParallelStrategy, Plan, TaskKind,
                               TrainingStage)
from harness.core.trace import UNITS
from harness.core.units import execution_units
from harness.core.workload import make_batch
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.taskmodels import migration as mg
from harness.planning.workflow import PPO_TASKS
from harness.real.parallel.layout import coords
from harness.schedule import PipeSpec, build
from harness.schedule.ir import Action
from harness.testing import context, run_config

OVERRIDES = ["+system=rlhfuse_base", "model=tiny", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=1",
             "cluster.gpus_per_node=4", "logger=none", "backend.options.digest=false"]
TINY = OVERRIDES + ["workload=tiny"]
# 16 samples with a long tail of output lengths: instances finish at different steps
LONG_TAIL = OVERRIDES + ["workload=tiny", "workload.global_batch_size=16", "workload.output_len.sigma=1.0",
                         "workload.max_gen_len=24", "workload.output_len.max=24", "seed=1"]
LOSS = {"actor": 0.5, "critic": 2.0}
PIDS = [100, 101, 102, 103]


@functools.lru_cache(maxsize=None)
def composed(overrides: tuple[str, ...]):
    """The context and run config of ``overrides`` (composed once per set of overrides)."""
    return context(list(overrides)), run_config(list(overrides))


def alloc(devices, dp=1, tp=1, pp=1) -> Allocation:
    return Allocation(tuple(devices), ParallelStrategy(dp=dp, tp=tp, pp=pp))


ALL = (0, 1, 2, 3)


# ---- the fake device workers -----------------------------------------------------------------------
class _ActorDied(Exception):
    pass


class _TaskFailed(Exception):
    pass


class _Ref:
    """A settled object ref: a worker's answer or the error its call ended with."""

    def __init__(self, value=None, error: Exception | None = None):
        self.value, self.error = value, error


class FakeRay:
    """``put``, ``wait`` and ``get`` over settled refs (every ref is ready)."""

    exceptions = types.SimpleNamespace(RayActorError=_ActorDied, RayTaskError=_TaskFailed)

    def put(self, obj):
        return obj

    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs[:num_returns]), list(refs[num_returns:])

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value


def response(sample_id: int, num_tokens: int) -> list[int]:
    return [sample_id + 1] * num_tokens


def row_output(tokens: np.ndarray, what: str) -> np.ndarray:
    """An inference pass's output for one row of tokens (zero-padded): a score, or one value per action."""
    if what == "score":
        return np.float32(tokens.sum())
    return tokens[1:].astype(np.float32) / (100.0 if what == "logprobs" else 10.0)


class _Method:
    """``worker.<method>.remote(request)``."""

    def __init__(self, worker: "FakeWorker", name: str):
        self.worker, self.name = worker, name

    def remote(self, request: Request) -> _Ref:
        return self.worker.answer(self.name, request)


class FakeWorker:
    """One device's worker: answers every request of :mod:`harness.backends.ray.protocol` with its
    typed output (:mod:`harness.backends.ray.replies`), computed from the request alone; it dies
    (``dies_on``: method and task; every later call to it fails too) or raises (``raises_on``) as
    a broken worker would."""

    METHODS = ("generate", "infer", "train", "move", "state", "release", "open_session", "steps", "export",
               "migrate", "close_session")

    def __init__(self, rank: int, dies_on: tuple[str, str] | None = None, raises_on: tuple[str, str] | None = None):
        self.rank, self.dies_on, self.raises_on = rank, dies_on, raises_on
        self.dead = False
        self.received: list[Request] = []
        self.sessions: dict[str, dict[int, list]] = {}  # task -> sample -> [target, produced, prompt]
        for name in self.METHODS:
            setattr(self, name, _Method(self, name))

    def answer(self, method: str, req: Request) -> _Ref:
        self.received.append(req)
        self.dead |= self.dies_on == (method, req.task)
        if self.dead:
            return _Ref(error=_ActorDied("The actor died unexpectedly before finishing this task."))
        if self.raises_on == (method, req.task):
            return _Ref(error=_TaskFailed(f"ValueError: bad input on device {self.rank}"))
        spans, out = getattr(self, f"_{method}")(req)
        return _Ref(Result(self.rank, spans, out))

    def _coord(self, allocation: Allocation) -> tuple[int, int, int]:
        return coords(allocation)[self.rank]

    @staticmethod
    def _span(kind: str) -> tuple[str, float, float, float, float]:
        now = time.time()
        return kind, now, now, 0.0, 0.0

    def _generate(self, req: Generate):
        k, _, t = self._coord(req.allocation)
        ids = [i for i in range(len(req.prompts)) if i % req.allocation.strategy.dp == k]
        samples = [FinishedSample(i, response(i, req.target_lens[i]), [-0.5] * req.target_lens[i], time.time())
                   for i in ids]
        return [self._span("decode")], (Generated(samples) if t == 0 else None)

    def _infer(self, req: Infer):
        k, p, t = self._coord(req.allocation)
        s = req.allocation.strategy
        rows = np.asarray(req.rows if req.rows is not None else range(k, len(req.tokens), s.dp), dtype=np.int64)
        if p != s.pp - 1 or t != 0:
            return [self._span("forward")], None
        values = np.stack([row_output(req.tokens[r], req.what) for r in rows]) if len(rows) else np.zeros(0)
        return [self._span("forward")], Inferred(rows, values)

    def _train(self, req: Train):
        models = {}
        for role, allocation in req.allocations.items():
            if self.rank not in allocation.mesh:
                continue
            _, p, t = self._coord(allocation)
            reports = p == allocation.strategy.pp - 1 and t == 0
            stats = PpoStats(LOSS[role], 0.25, 0.01 if role == "actor" else None) if reports else None
            now = time.time()
            models[role] = ModelTrained([self._span("forward"), self._span("backward")],
                                        [(now, now)] * len(req.minibatches), stats)
        return [], Trained(models)

    def _move(self, req: Move):
        return [self._span("realloc")], Moved(0.0)

    def _release(self, req: Release):
        return [], Released(1000 if self.rank in req.allocation.mesh else 0)

    def _progress(self, task: str, finished: list[FinishedSample], reports: bool) -> SessionProgress:
        session = self.sessions[task]
        left = [target - produced for target, produced, _ in session.values() if produced < target]
        return SessionProgress(finished if reports else [], len(left), min(left, default=1))

    def _open_session(self, req: OpenSession):
        self.sessions[req.task] = {i: [req.target_lens[i], 0, req.prompts[i]] for i in req.sample_ids}
        return [], self._progress(req.task, [], self._coord(req.allocation)[2] == 0)

    def _steps(self, req: Steps):
        session, finished = self.sessions[req.task], []
        for _ in range(req.max_steps):
            for i in sorted(session):
                target, produced, _ = session[i]
                if produced < target:
                    session[i][1] = produced + 1
                    if produced + 1 == target:
                        finished.append(FinishedSample(i, response(i, target), [-0.5] * target, time.time()))
        return [self._span("decode")], self._progress(req.task, finished, self._coord(req.allocation)[2] == 0)

    def _export(self, req: Export):
        session = self.sessions[req.task]
        out = [ExportedSample(i, prompt, response(i, produced), [-0.5] * produced, target, target - produced, None)
               for i, (target, produced, prompt) in sorted(session.items()) if produced < target]
        for sample in out:
            del session[sample.sample_id]
        reports = self._coord(req.allocation)[2] == 0
        return [], Exported(out if reports else None, {s.sample_id: {0: [1, len(s.tokens), 1]} for s in out})

    def _migrate(self, req: Migrate):
        session = self.sessions.get(req.task)
        for move in req.moves:
            if move.dst == self.rank:
                s = move.sample
                session[s.sample_id] = [s.target_len, len(s.tokens), s.prompt]
        return [self._span("migrate")], None

    def _close_session(self, req: CloseSession):
        self.sessions.pop(req.task, None)
        return [], None


class RecordingGroup(WorkerGroup):
    """The real worker group over fake workers, which also records every call it starts."""

    def __init__(self, workers: list[FakeWorker]):
        super().__init__(FakeRay(), workers, PIDS[:len(workers)], task_timeout_s=60.0)
        self.started: list[tuple[str, str, tuple[int, ...]]] = []  # (method, task, devices) in start order

    def start(self, request, devices=None, **kwargs):
        call = super().start(request, devices, **kwargs)
        self.started.append((request.method, request.task, tuple(call.devices)))
        return call


def run_iteration(overrides: list[str], plan: Plan, iteration: int = 0, **faults) -> tuple[Iteration, RecordingGroup]:
    """One iteration of ``plan`` by the real driver on fake workers (``faults``: device -> FakeWorker kwargs)."""
    ctx, run = composed(tuple(overrides))
    backend = RayBackend(run.backend, ctx)
    assert backend.unsupported(plan) == []  # a plan the real backend runs
    group = RecordingGroup([FakeWorker(d, **faults.get(f"device{d}", {})) for d in range(ctx.num_devices)])
    backend.group, backend.homes = group, ModelHomes(plan)
    it = Iteration(backend, plan, iteration, make_batch(ctx.workload, ctx.seed, iteration))
    it.run()
    return it, group


def ppo_plan(overrides: list[str], allocations: dict[str, Allocation], **kw) -> Plan:
    ctx, _ = composed(tuple(overrides))
    full = {n: alloc(ALL, dp=2, pp=2) for n in PPO_TASKS}
    full.update(allocations)
    plan = assemble_ppo_plan(ctx, "test", full, kw.pop("generation", GenerationPolicy()), **kw)
    plan.validate(ctx.num_devices)
    return plan


def fused_stage(num_minibatches: int = 2) -> TrainingStage:
    pipes = [PipeSpec("A", 1, 1, (0,), "actor"), PipeSpec("C", 1, 1, (0,), "critic")]
    return TrainingStage(("update_actor", "update_critic"), build("1f1b", pipes), num_minibatches=num_minibatches,
                         micro_batch_size=2)


METHOD = {TaskKind.WEIGHT_MOVEMENT: "move", TaskKind.GENERATE: "generate", TaskKind.INFERENCE: "infer",
          TaskKind.TRAIN: "train"}


# ---- iteration dispatch -----------------------------------------------------------------------------
def test_units_on_shared_devices_run_in_plan_order_and_free_copies_after_their_last_use():
    """Every unit on all four devices: one call per unit, in the plan's unit order, each to its
    task's worker method and devices; each transient copy freed once, after its last user."""
    plan = ppo_plan(TINY, {"gen": alloc(ALL, dp=4), "ref": alloc(ALL, dp=4), "reward": alloc(ALL, dp=4),
                           "values": alloc(ALL, dp=4)})
    it, group = run_iteration(TINY, plan)
    units = execution_units(plan)
    work = [(m, task) for m, task, _ in group.started if m != "release"]
    assert work == [(METHOD[u.kind], u.label) for u in units]
    for method, task, devices in group.started:
        if method != "release":
            expected = {d for n in task.split("+") for d in plan.task(n).allocation.mesh}
            if method == "move":
                expected |= set(plan.movement_of(task).source.mesh)
            assert set(devices) == expected, (task, devices)
    copies = ModelHomes(plan).transient_copies(plan)
    freed = [(task, i) for i, (m, task, _) in enumerate(group.started) if m == "release"]
    assert sorted(task for task, _ in freed) == sorted(f"free_{role}" for role, _ in copies)
    for (role, _), (_, users) in copies.items():
        at = next(i for task, i in freed if task == f"free_{role}")
        last_use = max(i for i, (m, task, _) in enumerate(group.started) if set(task.split("+")) & users)
        assert at > last_use, role
    assert it.trace.extra[UNITS]["started"] == [u.label for u in units]
    assert it.trace.counters[mk.DRIVER_CALLS] == len(group.started)
    assert it.trace.counters["perf/freed_copies"] == len(copies)


def test_inference_rows_are_dealt_round_robin_by_dp_replica_and_scattered_back():
    """An inference pass sends each dp replica's devices the rows ``k::dp``; the outputs the
    reporting devices return are put back at their samples."""
    plan = ppo_plan(TINY, {"gen": alloc(ALL, dp=4), "ref": alloc(ALL, dp=2, tp=2), "reward": alloc(ALL, dp=4),
                           "values": alloc(ALL, dp=2, pp=2)})
    it, group = run_iteration(TINY, plan)
    r = it.rollout
    n = len(r.prompt_lens)
    for task, dp in (("ref", 2), ("values", 2), ("reward", 4)):
        allocation = plan.task(task).allocation
        for worker in group.workers:
            (req,) = [q for q in worker.received if q.task == task and isinstance(q, Infer)]
            k = coords(allocation)[worker.rank][0]
            assert req.rows == list(range(k, n, dp)), (task, worker.rank)
    tokens = r.tokens
    np.testing.assert_array_equal(it.outputs["reward"], [row_output(tokens[i], "score") for i in range(n)])
    np.testing.assert_array_equal(it.outputs["ref"], np.stack([row_output(tokens[i], "logprobs") for i in range(n)]))
    np.testing.assert_array_equal(it.outputs["critic"], np.stack([row_output(tokens[i], "values") for i in range(n)]))
    # every sample's response as generated: target_lens[i] tokens of i + 1
    for i in range(n):
        assert list(tokens[i, r.prompt_lens[i]:r.prompt_lens[i] + r.response_lens[i]]) == response(i, it.batch.output_lens[i])


def test_units_on_disjoint_devices_run_at_the_same_time():
    """ref on devices 0-1 and reward on 2-3 both wait only for generation: both start before either
    is collected; values, on all four, waits for both."""
    plan = ppo_plan(TINY, {"gen": alloc(ALL, dp=4), "ref": alloc((0, 1), dp=2), "reward": alloc((2, 3), dp=2),
                           "values": alloc(ALL, dp=4)})
    it, group = run_iteration(TINY, plan)
    order = [task for m, task, _ in group.started if m == "infer"]
    assert order == ["ref", "reward", "values"]
    assert ["ref", "reward"] in it.trace.extra[UNITS]["concurrent"]
    assert not any("values" in pair and ("ref" in pair or "reward" in pair)
                   for pair in it.trace.extra[UNITS]["concurrent"])


# ---- training dispatch --------------------------------------------------------------------------------
def test_training_stage_sends_each_device_its_ranks_actions_and_averages_the_reported_losses():
    """A stage with pp=2 and dp=2: one call, each device its logical rank's lowered actions (its own
    stage's forwards and the sends to its neighbour); the losses of the dp replicas' last stages
    summed, per mini-batch."""
    plan = ppo_plan(TINY, {"gen": alloc(ALL, dp=4), "update_actor": alloc(ALL, dp=2, pp=2),
                           "update_critic": alloc(ALL, dp=2, pp=2)})
    it, group = run_iteration(TINY, plan)
    stage = plan.stage_of("update_actor")
    (pipe,) = stage.schedule.pipes.values()
    for worker in group.workers:
        (req,) = [q for q in worker.received if isinstance(q, Train) and q.task == "update_actor"]
        _, p, _ = coords(plan.task("update_actor").allocation)[worker.rank]
        actions = [Action.parse(a) for a in req.actions]
        assert {a.stage for a in actions} == {p}, (worker.rank, req.actions)
        assert sum(a.kind == "F" for a in actions) == sum(a.kind == "B" for a in actions) == pipe.num_mbs
        assert any(a.kind == "SF" for a in actions) == (p == 0) and any(a.kind == "RF" for a in actions) == (p == 1)
        assert set(req.parts) == {"actor"} and req.parts["actor"].inputs.advantages.shape == it.rollout.action_mask.shape
    num_minibatches = stage.num_minibatches
    reporting = 2  # dp replicas, each reporting from its last stage
    assert it.trace.counters["rl/policy_loss"] == pytest.approx(reporting * LOSS["actor"] / num_minibatches)
    assert it.trace.counters["rl/value_loss"] == pytest.approx(reporting * LOSS["critic"] / num_minibatches)
    assert it.trace.counters["rl/ppo_kl"] == pytest.approx(reporting * 0.01 / num_minibatches)
    assert [(p.task, p.num_ranks) for p in it.trace.pipelines] == ([("update_actor", 2)] * num_minibatches
                                                                  + [("update_critic", 2)] * num_minibatches)
    assert it.homes.version == {"actor": 1, "critic": 1, "ref": 0, "reward": 0}


def test_fused_stage_is_one_call_that_trains_both_models_on_every_device():
    plan = ppo_plan(TINY, {"gen": alloc(ALL, dp=4), "update_actor": alloc(ALL, dp=2, tp=2),
                           "update_critic": alloc(ALL, dp=2, tp=2)}, training=[fused_stage()])
    it, group = run_iteration(TINY, plan)
    trains = [(task, devices) for m, task, devices in group.started if m == "train"]
    assert trains == [("update_actor+update_critic", ALL)]
    for worker in group.workers:
        (req,) = [q for q in worker.received if isinstance(q, Train)]
        assert set(req.parts) == {"actor", "critic"} and req.pipe_role == {"A": "actor", "C": "critic"}
    assert it.trace.counters["rl/policy_loss"] == pytest.approx(2 * LOSS["actor"] / 2)
    assert {s.task for s in it.trace.spans if s.kind == "forward" and s.task.startswith("update")} == \
        {"update_actor", "update_critic"}


# ---- streamed generation (RLHFuse section 4) -----------------------------------------------------------
def stream_plan(migration: MigrationPolicy | None = None) -> Plan:
    return ppo_plan(LONG_TAIL, {"gen": alloc(ALL, dp=4), "ref": alloc(ALL, dp=2, tp=2),
                                "reward": alloc(ALL, dp=2, tp=2), "values": alloc(ALL, dp=2, tp=2),
                                "update_actor": alloc(ALL, dp=2, tp=2), "update_critic": alloc(ALL, dp=2, tp=2)},
                    training=[fused_stage()], stream_inference=True,
                    generation=GenerationPolicy(migration=migration))


def test_stream_hands_every_finished_sample_to_inference_once_while_generation_goes_on():
    plan = stream_plan()
    it, group = run_iteration(LONG_TAIL, plan)
    n, lens = it.batch.num_samples, it.batch.output_lens
    inf = plan.task("ref").allocation
    infer_calls = [(i, task, devices) for i, (m, task, devices) in enumerate(group.started) if m == "infer"]
    steps_calls = [i for i, (m, _, _) in enumerate(group.started) if m == "steps"]
    assert infer_calls and infer_calls[0][0] < steps_calls[-1]  # inference starts before generation ends
    # each inference call runs on one replica of the shared allocation, once generation released it
    replicas = [set(inf.replica_devices(j)) for j in range(inf.strategy.dp)]
    for _, _, devices in infer_calls:
        assert set(devices) in replicas
    # every sample inferred by each consumer exactly once, on the rows the driver sent
    inferred: dict[str, list[int]] = {"ref": [], "reward": [], "values": []}
    for worker in group.workers:
        for req in worker.received:
            if isinstance(req, Infer) and coords(inf)[worker.rank][2] == 0:
                sub_last = req.last_index[req.rows]
                inferred[req.task] += [int(req.tokens[r, last]) - 1 for r, last in zip(req.rows, sub_last)]
    for task, ids in inferred.items():
        assert sorted(ids) == list(range(n)), task
    # a micro-batch holds at most micro_batch_size samples, all finished when it was sent
    mbs = it.ctx.workload.micro_batch_size
    assert all(len(req.rows) <= mbs for w in group.workers for req in w.received if isinstance(req, Infer))
    # the outputs are each sample's own, as a whole-batch pass computes them
    r = it.rollout
    np.testing.assert_array_equal(it.outputs["reward"], [row_output(r.tokens[i], "score") for i in range(n)])
    np.testing.assert_array_equal(it.outputs["ref"], np.stack([row_output(r.tokens[i], "logprobs") for i in range(n)]))
    # samples are recorded with their generation order and all responses are complete
    assert sorted(s.sample_id for s in it.trace.samples) == list(range(n))
    assert [int(x) for x in r.response_lens] == [int(x) for x in lens]


def test_streamed_and_whole_batch_inference_give_the_same_data():
    """Streaming changes when inference runs, not what it computes: the same rollout and the same
    per-sample outputs as the same layouts without the stream."""
    streamed, _ = run_iteration(LONG_TAIL, stream_plan())
    plain = ppo_plan(LONG_TAIL, {"gen": alloc(ALL, dp=4), "ref": alloc(ALL, dp=2, tp=2),
                                 "reward": alloc(ALL, dp=2, tp=2), "values": alloc(ALL, dp=2, tp=2),
                                 "update_actor": alloc(ALL, dp=2, tp=2), "update_critic": alloc(ALL, dp=2, tp=2)},
                     training=[fused_stage()])
    whole, _ = run_iteration(LONG_TAIL, plain)
    np.testing.assert_array_equal(streamed.rollout.tokens, whole.rollout.tokens)
    for role in ("ref", "reward", "critic"):
        np.testing.assert_array_equal(streamed.outputs[role], whole.outputs[role], err_msg=role)
    assert streamed.trace.counters["rl/advantage_mean"] == whole.trace.counters["rl/advantage_mean"]


def test_migration_moves_the_tail_once_to_the_tail_instances_and_every_sample_still_finishes():
    policy = MigrationPolicy(threshold_frac=0.25, num_tail_instances=1)
    plan = stream_plan(policy)
    it, group = run_iteration(LONG_TAIL, plan)
    n = it.batch.num_samples
    migrates = [(task, devices) for m, task, devices in group.started if m == "migrate"]
    exports = [devices for m, _, devices in group.started if m == "export"]
    migrated = int(it.trace.counters[mk.MIGRATED_SAMPLES])
    assert len(migrates) == 1 and migrated >= 1 and it.trace.counters[mk.TAIL_INSTANCES] == 1
    req = next(q for w in group.workers for q in w.received if isinstance(q, Migrate))
    assert len(req.moves) == migrated  # tp=1: one KV shard per sample
    sources = {move.src for move in req.moves}
    (tail,) = {move.dst for move in req.moves}
    assert tail not in sources and len(exports) == len(sources)
    # at the migration, fewer than R_t samples were unfinished, and all of them moved
    assert migrated < mg.threshold(policy.threshold_frac, n) + 1
    assert sorted(s.sample_id for s in it.trace.samples) == list(range(n))
    assert [int(x) for x in it.rollout.response_lens] == [int(x) for x in it.batch.output_lens]
    # the sources' devices run no generation step after the migration
    at = next(i for i, (m, _, _) in enumerate(group.started) if m == "migrate")
    later_steps = {d for m, _, devices in group.started[at:] if m == "steps" for d in devices}
    assert later_steps == {tail}


# ---- failures ----------------------------------------------------------------------------------------
def test_a_dead_worker_is_named_with_its_task_and_process():
    plan = ppo_plan(TINY, {"gen": alloc(ALL, dp=4)})
    with pytest.raises(WorkerFailedError, match=r"task update_actor: the worker of device 1 \(pid 101\) died"):
        run_iteration(TINY, plan, device1={"dies_on": ("train", "update_actor")})


def test_a_worker_dying_mid_stream_is_named_by_the_inference_it_ran():
    with pytest.raises(WorkerFailedError, match=r"task ref: the worker of device 2 \(pid 102\) died"):
        run_iteration(LONG_TAIL, stream_plan(), device2={"dies_on": ("infer", "ref")})


def test_a_worker_that_raises_is_named_with_its_error():
    plan = ppo_plan(TINY, {"gen": alloc(ALL, dp=4)})
    with pytest.raises(WorkerFailedError, match=r"task gen: failed on device 3: ValueError: bad input on device 3"):
        run_iteration(TINY, plan, device3={"raises_on": ("generate", "gen")})
