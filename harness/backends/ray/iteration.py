"""One PPO iteration of a plan on the device workers (driver side).

The plan's units (:func:`harness.core.units.execution_units`) are dispatched by one handler per
task kind, *concurrently*, when the project's one scheduler says so
(:class:`harness.planning.scheduler.UnitQueue`, which the simulator drives with predicted times and
this driver with completions). Each handler sends its requests to the workers and returns a
completion step, run when every device has answered; spans carry the workers' own clocks, so the
trace shows the real overlap. The driver routes per-sample data (prompts, responses, log-probs,
values, scores, advantages) between tasks. Before a task
computes with a model it checks that the model's weights in the task's layout are current: the
home layout always is; a copy is current after a weight-movement task refreshed it since the last
training step. A plan that omits a needed movement still runs correctly: the move is done inside
the consuming task and shows as a ``realloc`` span of that task. A plan whose weight movement
would send a stale copy (the model trained since the copy was filled) is refused before Ray starts
(:func:`harness.backends.ray.homes.stale_movement_sources`): a movement sends from the source
layout's devices, which the scheduler gives it.

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
from typing import Any, Callable

import numpy as np
import torch

from harness.core import metrics as mk
from harness.backends.ray import experience as ex
from harness.backends.ray.calls import BackgroundCall
from harness.backends.ray.inter_stage import StreamedGeneration
from harness.real.parallel.layout import assemble
from harness.backends.ray.protocol import Dispatch, Generate, Infer, Move, Release, State
from harness.backends.ray.rewards import reward_fields
from harness.backends.ray.training import start_training
from harness.core.units import PlanInterpreter, Unit, execution_units
from harness.core.plan import Allocation, Plan, TaskKind
from harness.planning.scheduler import UnitQueue
from harness.real.digest import weights_digest
from harness.core.trace import PARAM_DIGEST, UNITS, SampleRecord, StepTrace
from harness.core.workload import Batch


class Iteration(PlanInterpreter):
    def __init__(self, backend, plan: Plan, iteration: int, batch: Batch):
        self.b, self.plan, self.iteration, self.batch = backend, plan, iteration, batch
        self.opts, self.group, self.homes, self.ctx = backend.opts, backend.group, backend.homes, backend.ctx
        self.trace = StepTrace(iteration=iteration, num_devices=backend.ctx.num_devices)
        self.rollout: ex.Rollout | None = None
        self.outputs: dict[str, np.ndarray] = {}  # model role -> its inference output
        self.experience: dict[frozenset[str], dict[str, np.ndarray]] = {}  # by the inputs it was computed from
        self.t0 = time.time()
        self.copies = self.homes.transient_copies(plan)

    def handlers(self):
        return {TaskKind.WEIGHT_MOVEMENT: self._movement_unit, TaskKind.GENERATE: self._generate_unit,
                TaskKind.INFERENCE: self._inference_unit,
                TaskKind.TRAIN: lambda unit: start_training(self, unit)}

    def run(self) -> StepTrace:
        self.prompts = ex.prompt_tokens(self.ctx.seed, self.iteration, self.batch, self.b.args["actor"].vocab_size)
        calls_before = self.group.num_calls
        self._dispatch(execution_units(self.plan))
        self.trace.counters[mk.DRIVER_CALLS] = float(self.group.num_calls - calls_before)
        if self.opts.digest:
            self._digest()
        return self.trace

    # ---- concurrent dispatch ----------------------------------------------------------------
    def _dispatch(self, units: list[Unit]) -> None:
        """Start every unit as soon as the planning library's readiness rule allows
        (:class:`harness.planning.scheduler.UnitQueue`), run its completion when it finishes."""
        table = self.handlers()
        queue = UnitQueue(self.plan, units)
        running: dict[int, tuple[tuple[str, ...], Any, Callable, set[int]]] = {}  # by call: its tasks, ...

        def settle_one() -> None:  # wait for the next running unit to finish and record it
            done = self.group.collect([c for _, c, _, _ in running.values()])
            names, _, finish, devices = running.pop(id(done))
            finish(done.results)
            queue.finish(names, devices)
            if not running:  # freeing is a call on the copy's devices: only when none is busy
                self._release_finished(queue.finished)

        while queue.waiting or running:
            unit = queue.next_startable()
            while unit is not None:
                devices = queue.start(unit)
                consumer = queue.consumer_of(unit)
                if consumer is not None:  # the stream and its inference, beside the other units (a thread)
                    stream = StreamedGeneration(self, unit, consumer)
                    call, finish = BackgroundCall(f"task {unit.label}", sorted(devices), stream.run), lambda _: None
                else:
                    call, finish = table[unit.kind](unit)
                running[id(call)] = (queue.names_of(unit), call, finish, devices)
                unit = queue.next_startable()
            if not running:
                if queue.waiting:
                    raise queue.stuck()
                break
            settle_one()
        self.trace.extra[UNITS] = queue.record()

    # ---- freeing copies whose phase has ended ------------------------------------------------
    def _release_finished(self, finished: set[str]) -> None:
        """Free every transient copy whose tasks have all finished in this iteration."""
        for (role, key), (alloc, users) in list(self.copies.items()):
            if users <= finished:
                del self.copies[(role, key)]
                results = self.group.call(Release(f"free_{role}", role, alloc))
                self.homes.freed(role, alloc)
                freed = sum(r.out["freed_bytes"] for r in results if r.out)
                self.trace.extra.setdefault("freed", []).append({"model": role, "layout": key, "bytes": freed})
                self.trace.counters["perf/freed_copies"] = self.trace.counters.get("perf/freed_copies", 0.0) + 1
                self.trace.counters["perf/freed_copy_gb"] = self.trace.counters.get("perf/freed_copy_gb", 0.0) + freed / 1e9

    # ---- handlers, one per task kind: start the work, return (call, completion) ----------------
    def _movement_unit(self, unit: Unit):
        (task,) = unit.tasks
        m = self.plan.movement_of(task.name)
        # the source copy is current: plans with stale sources are refused (homes.stale_movement_sources)
        return self._start_move(task.name, m.model.value, m.source, m.target)

    def _generate_unit(self, unit: Unit):
        (task,) = unit.tasks
        return self._generate(task.name, task.allocation)

    def _inference_unit(self, unit: Unit):
        (task,) = unit.tasks  # a streamed inference unit starts with its generator (inter_stage.py)
        return self._infer(task.name, task.model.value, task.allocation)

    # ---- weights ----------------------------------------------------------------------------
    def _start_move(self, task: str, role: str, source: Allocation, target: Allocation):
        call = self.group.start(Move(task, role, target, source=source), set(source.mesh) | set(target.mesh))

        def finish(results: list) -> None:
            self.b.spans_from(task, results, self.t0, self.trace)
            self.homes.refreshed(role, target)
        return call, finish

    def _ensure(self, task: str, role: str, alloc: Allocation) -> None:
        """The plan has no movement for ``alloc``: move inside the task (synchronously; Ray keeps
        each worker's calls in submission order, so this cannot reorder collectives)."""
        if not self.homes.current(role, alloc):
            call, finish = self._start_move(task, role, self.homes.home[role], alloc)
            finish(self.group.collect([call]).results)

    # ---- tasks ------------------------------------------------------------------------------
    def _generate(self, name: str, alloc: Allocation):
        self._ensure(name, "actor", alloc)
        policy, w = self.plan.generation, self.ctx.workload
        request = Generate(name, "actor", alloc, prompts=self.prompts, target_lens=self.batch.output_lens.tolist(),
                           batching=policy.batching, max_batch_size=policy.max_batch_size,
                           temperature=self.opts.temperature,
                           sampling_seed=ex.stable_seed("sampling", self.ctx.seed, self.iteration),
                           kv_capacity=int(self.batch.prompt_lens.max() + w.max_gen_len))
        return self.group.start(request), lambda results: self._generated(name, results)

    def _generated(self, name: str, results: list) -> None:
        self.b.spans_from(name, results, self.t0, self.trace)
        responses = {}
        for part in self.b.outputs(results):
            for sample_id, tokens, logprobs, finish in part:
                responses[sample_id] = (tokens, logprobs)
                self.trace.samples.append(SampleRecord(int(sample_id), int(self.batch.prompt_lens[sample_id]),
                                                       len(tokens), finish - self.t0))
        missing = sorted(set(range(self.batch.num_samples)) - set(responses))
        if missing:
            raise RuntimeError(f"generation returned no response for samples {missing[:8]}")
        self.trace.samples.sort(key=lambda s: s.sample_id)
        self.rollout = ex.build_rollout(self.prompts, responses)

    def _infer(self, name: str, role: str, alloc: Allocation):
        """Samples dealt to the dp replicas round-robin (as the simulator deals them), each
        replica's rows sent to its devices (split by dp rank)."""
        self._ensure(name, role, alloc)
        r = self.rollout
        what = ex.INFERENCE_OUTPUT[role]
        request = Infer(name, role, alloc, tokens=r.tokens, attn=r.attn, last_index=r.last_index, what=what,
                        micro_batch_size=self.ctx.workload.micro_batch_size, temperature=self.opts.temperature,
                        **reward_fields(role, r.prompt_lens, self.b.reward_spec))
        dp, n = alloc.strategy.dp, len(r.prompt_lens)
        shares = [request.replace(rows=list(range(k, n, dp))) for k in range(dp)]
        shape = (n,) if what == "score" else r.action_mask.shape

        def finish(results: list) -> None:
            self.b.spans_from(name, results, self.t0, self.trace)
            self.outputs[role] = ex.scatter_rows(self.b.outputs(results), shape)
        return self.group.start(request, mode=Dispatch.BY_DP_RANK, shares=shares), finish

    # ---- digest -----------------------------------------------------------------------------
    def _digest(self) -> None:
        digests = {}
        for role in ("actor", "critic"):
            alloc = self.homes.home[role]
            results = self.group.call(State(f"digest_{role}", role, alloc))
            pieces = {tuple(p["coord"]): {n: torch.tensor(v) for n, v in p["state"].items()}
                      for p in self.b.outputs(results)}
            s = alloc.strategy
            pp, tp = (1, 1) if s.zero_stage == 3 else (s.pp, s.tp)
            state = assemble(pieces, self.b.args[role], pp, tp)
            d = weights_digest(state, self.b.init_states.get(role))
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
            np.savez(Path(self.opts.dump_weights_dir) / "experience.npz", scores=self.outputs["reward"],
                     ref_logprobs=self.outputs["ref"], values=self.outputs["critic"],
                     old_logprobs=self.rollout.old_logprobs, action_mask=self.rollout.action_mask)
