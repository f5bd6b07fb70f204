"""One PPO iteration of a plan on the device workers (driver side).

The plan's units (:func:`harness.core.units.execution_units`) run *concurrently*, started when the
project's one scheduler says so (:class:`harness.planning.scheduler.UnitQueue`, which the simulator
drives with predicted times and this driver with completions). Each unit is run by the handler of
its task kind (:meth:`Iteration.handlers`), a :data:`~.dispatch.UnitRun` driven by the one loop of
:func:`~.dispatch.drive`: a weight movement, a generation or inference pass, a training stage
(:mod:`.training`), or a streamed generation with the inference that consumes it
(:mod:`.inter_stage`). Spans carry the workers' own clocks, so the trace shows the real overlap.
The driver routes per-sample data (prompts, responses, log-probs, values, scores, advantages)
between tasks.

Before a task computes with a model it checks that the model's weights in the task's layout are
current: the home layout always is; a copy is current after a weight-movement task refreshed it
since the last training step. A plan that omits a needed movement still runs correctly: the move
is done inside the consuming task (:meth:`Iteration.ensure_current`) and shows as a ``realloc``
span of that task. A plan whose weight movement would send a stale copy (the model trained since
the copy was filled) is refused before Ray starts
(:func:`harness.backends.ray.driver.homes.stale_movement_sources`): a movement sends from the
source layout's devices, which the scheduler gives it.

Memory: a model's copy in another task's layout (e.g. the actor in the generation layout) that the
plan does not list as resident (``Plan.resident``) is freed on its devices as soon as the last task
of the iteration that computes with it has finished; the next weight movement rebuilds it. Models
the plan offloads keep their weights in host memory between uses
(``harness.real.parallel.replica.Replica.compute``).

RL metrics go to ``StepTrace.counters`` under ``rl/``; weight digests (sum, L2, distance from the
initial weights) to ``rl/<model>_param_{sum,l2}`` and ``rl/<model>_update_l2`` and, with the
parameter count and the SHA-256 of the full weights (:func:`harness.real.digest.weights_digest`), to
``StepTrace.extra["param_digest"]``, which the runner writes to ``summary.json``'s ``final_weights``
for the last iteration.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from harness.backends.ray.driver import experience as ex
from harness.backends.ray.driver.dispatch import UnitRun, drive, outputs
from harness.backends.ray.driver.inter_stage import StreamedGeneration
from harness.backends.ray.driver.training import train_unit
from harness.backends.ray.protocol import Dispatch, Generate, Infer, Move, Release, State
from harness.backends.ray.replies import FinishedSample, Result
from harness.backends.ray.rewards import task_reward
from harness.core import metrics as mk
from harness.core.plan import Allocation, Plan, Task, TaskKind
from harness.core.trace import PARAM_DIGEST, UNITS, SampleRecord, Span, StepTrace
from harness.core.units import Unit, execution_units
from harness.core.algorithm import samples_per_round
from harness.core.workload import Batch, draw_round
from harness.planning.scheduler import UnitQueue
from harness.real.digest import weights_digest
from harness.real.parallel.layout import assemble


def check_assignment(task: Task, assignment: tuple, results: list[Result]) -> None:
    """Each generation instance returned exactly the samples the length dispatch gave it."""
    alloc = task.allocation
    instance_of = {d: k for k in range(alloc.strategy.dp) for d in alloc.replica_devices(k)}
    for r in results:
        if r.out is not None:
            k = instance_of[r.rank]
            got = sorted(int(s.sample_id) for s in r.out.samples)
            if got != sorted(int(i) for i in assignment[k]):
                raise RuntimeError(f"{task.name}: generation instance {k} (device {r.rank}) generated samples "
                                   f"{got[:8]}, the length dispatch gave it {sorted(assignment[k])[:8]}")


class Iteration:
    """One PPO iteration of ``plan`` on ``batch`` with ``backend``'s workers
    (:class:`~.backend.RayBackend`: its options, worker group, model homes and context): the data
    the iteration produces (rollout, inference outputs, experience) and its trace."""

    def __init__(self, backend, plan: Plan, iteration: int, batch: Batch, t0: float | None = None):
        self.plan, self.iteration, self.batch = plan, iteration, batch
        self.opts, self.group, self.homes, self.ctx = backend.opts, backend.group, backend.homes, backend.ctx
        self.model_args, self.init_states = backend.args, backend.init_states
        self.trace = StepTrace(iteration=iteration, num_devices=backend.ctx.num_devices)
        self.rollout: ex.Rollout | None = None
        self.outputs: dict[str, np.ndarray] = {}  # model role -> its inference output
        self.experience: dict[frozenset[str], dict[str, np.ndarray]] = {}  # by the inputs it was computed from
        self.t0 = time.time() if t0 is None else t0  # the trace's clock (an off-policy run's: its start)
        self.gen_version: int | None = None  # the actor's weights version generation ran with (off-policy plans)
        self.copies = self.homes.transient_copies(plan)
        self.prompts: list[list[int]] = []
        self.queue: UnitQueue | None = None  # the scheduler's queue while the units run

    def handlers(self) -> dict[TaskKind, Callable[[Unit], UnitRun]]:
        """The handler of each task kind (a training stage: :func:`~.training.train_unit`)."""
        return {TaskKind.WEIGHT_MOVEMENT: self._movement_unit, TaskKind.GENERATE: self._generate_unit,
                TaskKind.INFERENCE: self._inference_unit, TaskKind.TRAIN: lambda unit: train_unit(self, unit)}

    def prepare(self) -> None:
        """The batch's prompts, before any unit of the iteration runs."""
        self.prompts = ex.prompt_tokens(self.ctx.seed, self.iteration, self.batch,
                                        self.model_args["actor"].vocab_size, self.ctx.algorithm.group_size)

    def run(self) -> StepTrace:
        self.prepare()
        calls_before = self.group.num_calls
        self.dispatch(execution_units(self.plan))
        self.trace.counters[mk.DRIVER_CALLS] = float(self.group.num_calls - calls_before)
        if self.opts.digest:
            self.digest()
        return self.trace

    # ---- concurrent dispatch ----------------------------------------------------------------
    def dispatch(self, units: list[Unit]) -> None:
        """Run ``units`` through the planning library's readiness rule
        (:class:`harness.planning.scheduler.UnitQueue`), each by the handler of its kind."""
        table = self.handlers()
        self.queue = queue = UnitQueue(self.plan, units)
        drive(self.group, queue, lambda unit: table[unit.kind](unit), lambda: self._release_finished(queue.finished))
        self.trace.extra[UNITS] = queue.record()
        self.queue = None

    # ---- what handlers record ------------------------------------------------------------------
    def record(self, task: str, results: list[Result]) -> None:
        """Workers' spans (on their own clocks) and memory peaks into the trace."""
        trace = self.trace
        for r in results:
            for kind, start, end, flops, nbytes in r.spans:
                trace.spans.append(Span((r.rank,), task, kind, start - self.t0, end - self.t0, flops, nbytes))
            trace.memory_gb[r.rank] = max(trace.memory_gb.get(r.rank, 0.0), r.memory_gb)
            for key, value in r.memory.named():
                name = f"perf/{key}/dev{r.rank}"
                trace.counters[name] = max(trace.counters.get(name, 0.0), float(value))
                trace.extra.setdefault("memory", {}).setdefault(r.rank, {})[key] = trace.counters[name]

    def record_sample(self, sample: FinishedSample) -> None:
        """A finished sample; under an off-policy plan, with the weights version it was generated by."""
        v = self.gen_version
        self.trace.samples.append(SampleRecord(int(sample.sample_id), int(self.batch.prompt_lens[sample.sample_id]),
                                               len(sample.tokens), sample.finish_time_s - self.t0, v, v))

    def set_rollout(self, responses: dict[int, tuple[list, list]], what: str) -> None:
        """The rollout of every sample's response (``what`` generated them: for the error). Under a
        rule-based reward (``algo.reward=rule``) the driver verifies every response at once, as
        verl's trainer calls its reward function on the generated batch: the scores are
        ``backend.options.reward``'s task, the seconds it took ``gen/verify_tail_s``."""
        missing = sorted(set(range(self.batch.num_samples)) - set(responses))
        if missing:
            raise RuntimeError(f"{what} returned no response for samples {missing[:8]}")
        self.trace.samples.sort(key=lambda s: s.sample_id)
        self.rollout = ex.build_rollout(self.prompts, responses)
        if not self.ctx.algorithm.has_reward_model:
            start = time.perf_counter()
            self.outputs["reward"] = ex.rule_scores(self.rollout, task_reward("reward", self.opts.reward))
            self.trace.counters[mk.VERIFY_TAIL] = time.perf_counter() - start

    # ---- freeing copies whose phase has ended ------------------------------------------------
    def _release_finished(self, finished: set[str]) -> None:
        """Free every transient copy whose tasks have all finished in this iteration."""
        for (role, key), (alloc, users) in list(self.copies.items()):
            if users <= finished:
                del self.copies[(role, key)]
                results = self.group.call(Release(f"free_{role}", role, alloc))
                self.homes.freed(role, alloc)
                freed = sum(r.out.freed_bytes for r in results if r.out)
                self.trace.extra.setdefault("freed", []).append({"model": role, "layout": key, "bytes": freed})
                self.trace.counters["perf/freed_copies"] = self.trace.counters.get("perf/freed_copies", 0.0) + 1
                self.trace.counters["perf/freed_copy_gb"] = (self.trace.counters.get("perf/freed_copy_gb", 0.0)
                                                             + freed / 1e9)

    # ---- weights ----------------------------------------------------------------------------
    def _movement_unit(self, unit: Unit) -> UnitRun:
        (task,) = unit.tasks
        m = self.plan.movement_of(task.name)
        # the source copy is current: plans with stale sources are refused (homes.stale_movement_sources)
        yield from self._move(task.name, m.model.value, m.source, m.target)

    def _move(self, task: str, role: str, source: Allocation, target: Allocation) -> UnitRun:
        done = yield [self.group.start(Move(task, role, target, source=source), set(source.mesh) | set(target.mesh))]
        self.record(task, done.results)
        self.homes.refreshed(role, target)

    def ensure_current(self, task: str, role: str, alloc: Allocation) -> UnitRun:
        """Make ``role``'s weights in ``alloc`` current before ``task`` computes with them: when the
        plan has no movement for it, move from the home layout inside the task (Ray keeps each
        worker's calls in submission order, so this cannot reorder collectives)."""
        if not self.homes.current(role, alloc):
            yield from self._move(task, role, self.homes.home[role], alloc)

    # ---- generation and inference -----------------------------------------------------------
    def _generate_unit(self, unit: Unit) -> UnitRun:
        """A generate task; with a stream consumer (the scheduler starts them together), the streamed
        generation and its inference (:class:`~.inter_stage.StreamedGeneration`)."""
        # an off-policy run's iterations have no queue of their own (and stream nothing: refused)
        consumer = self.queue.consumer_of(unit) if self.queue is not None else None
        if consumer is not None:
            yield from StreamedGeneration(self, unit, consumer).run()
            return
        (task,) = unit.tasks
        if self.plan.off_policy is None:
            yield from self.ensure_current(task.name, "actor", task.allocation)
        else:
            self.gen_version = self.stale_weights(task)
        if self.ctx.algorithm.dynamic_sampling:
            yield from self._generate_rounds(task)
            return
        request = self._generate_request(task, self.prompts, self.batch,
                                         ex.stable_seed("sampling", self.ctx.seed, self.iteration))
        done = yield [self.group.start(request)]
        self.record(task.name, done.results)
        if request.assignment is not None:
            check_assignment(task, request.assignment, done.results)
        responses = {}
        for generated in outputs(done.results):
            for sample in generated.samples:
                responses[sample.sample_id] = (sample.tokens, sample.logprobs)
                self.record_sample(sample)
        self.set_rollout(responses, "generation")

    def stale_weights(self, task: Task) -> int:
        """The version of the actor's weights ``task`` generates with under an off-policy plan: the
        copy the plan's last weight movement into its layout filled, never refreshed here (the plan
        lets generation run on older weights). Its staleness, the iteration minus that version, must
        be within the plan's bound (``Plan.off_policy.max_staleness``): a hard rule, raised on."""
        version = self.homes.held("actor", task.allocation)
        bound = self.plan.off_policy.max_staleness
        if version is None:
            raise RuntimeError(f"{task.name} of iteration {self.iteration}: no weight movement has filled the "
                               f"actor's copy in its layout")
        if not 0 <= self.iteration - version <= bound:
            raise RuntimeError(f"{task.name} of iteration {self.iteration} would generate with weights version "
                               f"{version}, {self.iteration - version} versions stale; the plan's bound is {bound}")
        return version

    def _generate_request(self, task: Task, prompts: list[list[int]], batch: Batch, sampling_seed: int) -> Generate:
        """``task``'s generation of ``prompts`` up to ``batch``'s target lengths under the plan's policy."""
        policy = self.plan.generation
        return Generate(task.name, "actor", task.allocation, prompts=prompts, target_lens=batch.output_lens.tolist(),
                        batching=policy.batching, max_batch_size=policy.max_batch_size,
                        assignment=ex.instance_assignment(policy, task, batch.output_lens),
                        temperature=self.opts.temperature, sampling_seed=sampling_seed,
                        kv_capacity=int(batch.prompt_lens.max() + self.ctx.workload.max_gen_len))

    def _generate_rounds(self, task: Task) -> UnitRun:
        """DAPO's dynamic sampling, for real (:mod:`harness.core.algorithm`): generation round ``r``
        generates the prompts and target lengths of :func:`~harness.core.workload.draw_round` (the
        simulator's rounds; prompts from a stream of their own), the driver verifies every response,
        and the groups whose scores are not all equal are kept, rounds running until the batch's
        prompts are kept; the first of them are the iteration's batch, as the simulator's kept
        groups are its (which groups those are is the verifier's verdict here, a draw there)."""
        algo, w, opts, seed = self.ctx.algorithm, self.ctx.workload, self.opts, self.ctx.seed
        g = algo.group_size
        needed = self.batch.num_samples  # samples: the batch's prompts x g
        per_round = samples_per_round(w, algo) // g
        reward = task_reward("reward", opts.reward)
        kept: list[tuple[list[int], FinishedSample, int]] = []  # prompt, generated sample, target length
        generated = mixed = 0
        verify_s = 0.0
        for r in range(algo.max_gen_rounds):
            rb = draw_round(w, seed, self.iteration, r, per_round, g)
            prompts = ex.prompt_tokens(seed, self.iteration, rb, self.model_args["actor"].vocab_size, g, round_index=r)
            request = self._generate_request(task, prompts, rb,
                                             ex.stable_seed("sampling", seed, self.iteration, f"round{r}"))
            done = yield [self.group.start(request)]
            self.record(task.name, done.results)
            samples = {s.sample_id: s for generated_part in outputs(done.results) for s in generated_part.samples}
            missing = sorted(set(range(rb.num_samples)) - set(samples))
            if missing:
                raise RuntimeError(f"generation round {r} returned no response for samples {missing[:8]}")
            start = time.perf_counter()
            rollout = ex.build_rollout(prompts, {i: (s.tokens, s.logprobs) for i, s in samples.items()})
            scores = ex.rule_scores(rollout, reward).reshape(-1, g)
            verify_s += time.perf_counter() - start
            generated += rb.num_samples
            for group in np.flatnonzero(scores.max(axis=1) > scores.min(axis=1)).tolist():
                mixed += 1
                kept += [(prompts[i], samples[i], int(rb.output_lens[i])) for i in range(group * g, (group + 1) * g)]
            if len(kept) >= needed:
                break
        else:
            raise RuntimeError(f"dynamic sampling kept {len(kept) // g} of the {needed // g} prompts it needs after "
                               f"algo.max_gen_rounds={algo.max_gen_rounds} rounds of {per_round} prompts: the "
                               f"verifier scored the other groups' responses all alike; raise algo.max_gen_rounds "
                               f"or algo.oversample_factor")
        kept = kept[:needed]
        self.prompts = [p for p, _, _ in kept]
        self.batch = Batch(self.iteration, np.array([len(p) for p in self.prompts], dtype=np.int64),
                           np.array([t for _, _, t in kept], dtype=np.int64))
        for i, (_, sample, _) in enumerate(kept):
            self.trace.samples.append(SampleRecord(i, len(self.prompts[i]), len(sample.tokens),
                                                   sample.finish_time_s - self.t0))
        self.set_rollout({i: (s.tokens, s.logprobs) for i, (_, s, _) in enumerate(kept)}, "generation")
        self.trace.counters[mk.VERIFY_TAIL] += verify_s  # the rounds' verdicts, then the batch's scores
        self.trace.counters[mk.GEN_ROUNDS] = float(r + 1)
        self.trace.counters[mk.GENERATED_SAMPLES] = float(generated)
        self.trace.counters[mk.MIXED_GROUP_FRAC] = mixed / (generated // g)

    def infer_request(self, task: Task, rollout: ex.Rollout, rows: list[int] | None = None) -> Infer:
        """The forward passes of ``task`` over ``rollout`` (``rows``: those of one replica, streamed
        from generation, which are not packed, as the simulator times them; a whole pass is packed
        under ``workload.micro_batch_tokens``)."""
        role = task.model.value
        reward = task_reward(role, self.opts.reward)
        return Infer(task.name, role, task.allocation, tokens=rollout.tokens, attn=rollout.attn,
                     last_index=rollout.last_index, what=ex.INFERENCE_OUTPUT[role],
                     micro_batch_size=self.ctx.workload.micro_batch_size, temperature=self.opts.temperature,
                     rows=rows, task_reward=reward,
                     micro_batch_tokens=self.ctx.workload.micro_batch_tokens if rows is None else None,
                     prompt_lens=None if reward is None else np.asarray(rollout.prompt_lens).tolist())

    def _inference_unit(self, unit: Unit) -> UnitRun:
        """Samples dealt to the dp replicas round-robin (as the simulator deals them), each
        replica's rows sent to its devices (split by dp rank). A unit consuming a stream starts
        with its generator (:meth:`_generate_unit`), never alone."""
        (task,) = unit.tasks
        role, alloc = task.model.value, task.allocation
        yield from self.ensure_current(task.name, role, alloc)
        r = self.rollout
        request = self.infer_request(task, r)
        dp, n = alloc.strategy.dp, len(r.prompt_lens)
        shares = [request.replace(rows=list(range(k, n, dp))) for k in range(dp)]
        done = yield [self.group.start(request, mode=Dispatch.BY_DP_RANK, shares=shares)]
        self.record(task.name, done.results)
        shape = (n,) if request.what == "score" else r.action_mask.shape
        self.outputs[role] = ex.scatter_rows(outputs(done.results), shape)

    # ---- digest -----------------------------------------------------------------------------
    def digest(self) -> None:
        """The trained models' weights digest (``rl/<model>_param_*``, ``extra["param_digest"]``)."""
        digests = {}
        for role in [r for r in ("actor", "critic") if r in self.homes.home]:
            alloc = self.homes.home[role]
            results = self.group.call(State(f"digest_{role}", role, alloc))
            pieces = {tuple(p.coord): {n: torch.tensor(v) for n, v in p.state.items()} for p in outputs(results)}
            s = alloc.strategy
            pp, tp = (1, 1) if s.zero_stage == 3 else (s.pp, s.tp)
            state = assemble(pieces, self.model_args[role], pp, tp)
            d = weights_digest(state, self.init_states.get(role))
            digests[role] = d
            for key, counter in (("sum", "param_sum"), ("l2", "param_l2"), ("update_l2", "update_l2")):
                if key in d:
                    self.trace.counters[f"rl/{role}_{counter}"] = d[key]
            if self.opts.dump_weights_dir:
                folder = Path(self.opts.dump_weights_dir)
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(state, folder / f"{role}.pt")
        self.trace.extra[PARAM_DIGEST] = digests
        if self.opts.dump_weights_dir and self.rollout is not None:  # what the models said of each sample
            np.savez(Path(self.opts.dump_weights_dir) / "experience.npz",
                     **{name: self.outputs[role] for role, name in (("reward", "scores"), ("ref", "ref_logprobs"),
                                                                    ("critic", "values")) if role in self.outputs},
                     old_logprobs=self.rollout.old_logprobs, action_mask=self.rollout.action_mask)
