"""Whole-plan simulation: one PPO iteration of a plan over the cost model, as a StepTrace.

The plan's units (:mod:`harness.core.units`) are started by the project's one scheduler
(:mod:`harness.planning.scheduler`, driven here by predicted times) and each is timed by its task model (:mod:`harness.planning.taskmodels`), one handler per task kind:

- ``generate``: token-level generation (continuous or static batching, long-tail migration);
  instances released early by migration free their devices early; with a rule-based reward its
  rewards are ready when the verifier on the driver's CPUs has scored every response
  (:func:`verified_s`);
- ``inference``: pipelined forward passes; a unit consuming a stream starts with its generator and
  takes samples as generation finishes them, on replicas as their devices are released (RLHFuse
  section 4);
- ``train``: the stage's pipeline schedule per mini-batch (fused or not), gradient sync, optimizer;
- ``weight_movement``: reallocation / parameter-sync bytes over the links.

This is what ``backend=sim`` runs, and what planners call to score whole candidate plans; nothing
here depends on which system produced the plan.
"""
from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

from harness.core import metrics as mk
from harness.errors import PlanError
from harness.core.units import Unit
from harness.core.plan import Plan, Task, TaskKind
from harness.planning.memory import MemoryReport
from harness.planning.scheduler import Timeline, Timing, UnitQueue, run_timed, unit_devices
from harness.planning.taskmodels.generation import (GenerationResult, continuous_instance_ends, padded_lengths,
                                                    simulate_generation)
from harness.planning.taskmodels.passes import (PassResult, simulate_inference, simulate_training,
                                                simulate_weight_movement)
from harness.planning.taskmodels.sampling import group_ready_s, kept_stream
from harness.planning.taskmodels.streaming import simulate_streaming_inference
from harness.system import PlanContext
from harness.core.trace import UNITS, StepTrace
from harness.core.workload import Batch, mixed_groups


class PlanSimulator:
    """Simulates one iteration of ``plan`` on ``batch``; ``memory`` is the plan's memory report
    (KV capacity per generate task, per-device peaks). The project's scheduler
    (:func:`harness.planning.scheduler.run_timed`) starts each unit; its handler predicts when the
    unit's tasks end and its devices are released. ``record_spans=False`` (planners scoring whole
    plans) leaves out the training, inference and streaming spans, which the end times do not need:
    read :attr:`timeline`'s ``makespan_s`` then, not the trace's."""

    def __init__(self, ctx: PlanContext, plan: Plan, memory: MemoryReport, iteration: int, batch: Batch,
                 record_spans: bool = True):
        self.ctx, self.cm, self.plan, self.memory, self.batch = ctx, ctx.cost_model, plan, memory, batch
        self.record_spans = record_spans
        self.timeline: Timeline | None = None
        if plan.engines is not None:  # ops as the plan's execution engines run them
            self.cm = ctx.cost_model.with_engines(plan.engines, generation_gather_s(ctx, plan))
        self.prompt_lens = self._generated_prompt_lens(batch.prompt_lens)
        self.trace = StepTrace(iteration=iteration, num_devices=ctx.num_devices)
        gen_dp = max((t.allocation.strategy.dp for t in plan.tasks if t.kind == TaskKind.GENERATE), default=1)
        # what later passes see: own lengths, or padded to the longest of a generation round
        self.seq_lens = padded_lengths(plan.generation, gen_dp, self.prompt_lens, batch.output_lens)
        self.moves = {m.task: m for m in plan.weight_movements}
        self.now_s = 0.0  # the start of the unit being handled
        self.consumer: Unit | None = None  # the stream consumer starting with it, if any

    def handlers(self) -> dict[TaskKind, Callable[[Unit], Timing]]:
        return {TaskKind.GENERATE: self.generate, TaskKind.INFERENCE: self.inference,
                TaskKind.TRAIN: self.train, TaskKind.WEIGHT_MOVEMENT: self.weight_movement}

    def run(self) -> StepTrace:
        table = self.handlers()

        def start(unit: Unit, now_s: float, queue: UnitQueue) -> Timing:
            self.now_s, self.consumer = now_s, queue.consumer_of(unit)
            return table[unit.kind](unit)

        self.timeline = run_timed(self.plan, self.ctx.num_devices, start)
        self.trace.extra[UNITS] = self.timeline.record
        self.trace.memory_gb = dict(self.memory.peak_gb)
        return self.trace

    def _record(self, unit: Unit, result: PassResult) -> Timing:
        self.trace.spans.extend(result.spans)
        self.trace.pipelines.extend(result.pipelines)
        self.trace.samples.extend(result.samples)
        return Timing({n: result.end_s for n in unit.names},
                      {d: result.end_s for d in unit_devices(self.plan, unit)})

    # ---- handlers, one per task kind: predict the unit's Timing from its start ---------------
    def generate(self, unit: Unit) -> Timing:
        if self.batch.rounds is not None:
            return self._generate_rounds(unit)
        (task,) = unit.tasks
        gen = self._generation(task, self.prompt_lens, self.batch.output_lens, self.now_s)
        spans = [s for inst in gen.instances for s in inst.spans]
        timing = self._record(unit, PassResult(spans, gen.end_s, [], gen.samples))
        timing.release_s.update(gen.device_free_s())  # instances released at migration free early
        policy = self.plan.generation.migration
        if policy is not None:
            self.trace.counters[mk.MIGRATED_SAMPLES] = gen.migrated_samples
            self.trace.counters[mk.TAIL_INSTANCES] = gen.tail_instances
            self.trace.counters[mk.MIGRATION_THRESHOLD_FRAC] = policy.threshold_frac
        if self.consumer is not None:
            self._streamed_inference(self.consumer, gen, timing)
        if not self.ctx.algorithm.has_reward_model:  # the rule-based verifier writes gen's rewards
            returned = ([s.finish_s for s in gen.samples] if self.consumer is not None
                        else [gen.end_s] * len(self.prompt_lens))
            end = verified_s(returned, self.ctx.algorithm.rule_reward_s_per_sample,
                             self.ctx.algorithm.num_reward_workers)
            timing.end_s[task.name] = max(timing.end_s[task.name], end)
            self.trace.counters[mk.VERIFY_TAIL] = timing.end_s[task.name] - gen.end_s
        return timing

    def _generated_prompt_lens(self, prompt_lens: np.ndarray) -> np.ndarray:
        """The prompt lengths generation runs on: their own, or every prompt padded to the longest
        allowed where the plan's generation engine pads (``pad_prompts_to_max``)."""
        if self.plan.engines is not None and self.plan.engines.generation.pad_prompts_to_max:
            return np.full_like(prompt_lens, self.ctx.workload.prompt_len.max)
        return prompt_lens

    def _generation(self, task: Task, prompt_lens: np.ndarray, output_lens: np.ndarray, start_s: float) -> GenerationResult:
        """``task``'s generation of these samples from ``start_s``. Scoring a plan
        (``record_spans=False``) without a stream to feed or a migration to replay needs only its
        instances' ends: their step schedules, the same ends bit for bit
        (:func:`~harness.planning.taskmodels.generation.continuous_instance_ends`)."""
        policy, model = self.plan.generation, self.ctx.model(task.model)
        kv_gb, max_gen_len = self.memory.kv_capacity_gb[task.name], self.ctx.workload.max_gen_len
        if (not self.record_spans and self.consumer is None and policy.batching == "continuous"
                and policy.migration is None):
            return continuous_instance_ends(self.cm, task, policy, model, prompt_lens, output_lens, start_s, kv_gb,
                                            max_gen_len)
        return simulate_generation(self.cm, task, policy, model, prompt_lens, output_lens, start_s, kv_gb, max_gen_len)

    def _generate_rounds(self, unit: Unit) -> Timing:
        """Generation under dynamic sampling (:func:`harness.core.workload.make_sampled_batch`):
        each round generates its samples, the verifier scores them, and the next round starts when
        the last is scored (the filter needs every group's outcome). The kept samples are what
        follows: a stream consumer takes each when its group has been scored (its last response
        verified), in the round that generated it."""
        (task,) = unit.tasks
        algo, policy = self.ctx.algorithm, self.plan.generation
        streamed = self.consumer is not None
        ready_s: list[np.ndarray] = []  # per round, when each of its samples' group was scored
        finish_s: list[np.ndarray] = []
        now, gen, migrated = self.now_s, None, 0
        for rb in self.batch.rounds:
            gen = self._generation(task, self._generated_prompt_lens(rb.prompt_lens), rb.output_lens, now)
            self.trace.spans.extend(s for inst in gen.instances for s in inst.spans)
            migrated += gen.migrated_samples
            finished = np.full(rb.num_samples, gen.end_s)  # without the samples' own finishes: the end
            for rec in gen.samples:
                finished[rec.sample_id] = rec.finish_s
            returned = finished if streamed else np.full(rb.num_samples, gen.end_s)
            scored = verified_times(returned.tolist(), algo.rule_reward_s_per_sample, algo.num_reward_workers)
            ready_s.append(group_ready_s(np.asarray(scored), algo.group_size))
            finish_s.append(finished)
            now = max(gen.end_s, float(ready_s[-1].max()))
        own = kept_stream(self.batch, np.concatenate(finish_s))  # each kept sample at its own finish
        self.trace.samples.extend(own)
        timing = Timing({n: now for n in unit.names}, {d: now for d in unit_devices(self.plan, unit)})
        timing.release_s.update(gen.device_free_s())  # the last round's instances released at migration
        self.trace.counters[mk.GEN_ROUNDS] = float(len(self.batch.rounds))
        self.trace.counters[mk.GENERATED_SAMPLES] = float(sum(rb.num_samples for rb in self.batch.rounds))
        outcomes = np.concatenate([rb.group_num_correct for rb in self.batch.rounds])
        self.trace.counters[mk.MIXED_GROUP_FRAC] = float(mixed_groups(outcomes, algo.group_size).mean())
        self.trace.counters[mk.VERIFY_TAIL] = now - gen.end_s
        if policy.migration is not None:  # summed over the rounds; the last round's tail instances
            self.trace.counters[mk.MIGRATED_SAMPLES] = migrated
            self.trace.counters[mk.TAIL_INSTANCES] = gen.tail_instances
            self.trace.counters[mk.MIGRATION_THRESHOLD_FRAC] = policy.migration.threshold_frac
        if streamed:  # the kept samples, each once its group was scored
            self._streamed_inference(self.consumer, GenerationResult(kept_stream(self.batch, np.concatenate(ready_s)),
                                                                     gen.instances), timing)
        return timing

    def _streamed_inference(self, unit: Unit, gen: GenerationResult, timing: Timing) -> None:
        """The inference unit consuming ``gen``'s stream, started with it: it takes samples as
        generation finishes them, on each device once generation has released it."""
        allocations = {t.allocation for t in unit.tasks}
        if len(allocations) != 1:
            raise PlanError(f"{unit.label} stream from {unit.stream_from} and must share one allocation "
                            f"(got {[str(t.allocation.strategy) for t in unit.tasks]})")
        mesh = list(unit.tasks[0].allocation.mesh)
        free = {d: timing.release_s.get(d, self.now_s) for d in mesh}
        models = {t.model: self.ctx.model(t.model) for t in unit.tasks}
        streamed = simulate_streaming_inference(self.cm, list(unit.tasks), models, gen.samples, free,
                                                self.ctx.workload.micro_batch_size, self.moves,
                                                record_spans=self.record_spans)
        end = max(streamed.end_s.values())
        timing.end_s.update(streamed.end_s)
        timing.release_s.update({d: end for d in mesh})
        self.trace.spans.extend(streamed.spans)

    def inference(self, unit: Unit) -> Timing:
        if unit.stream_from is not None:  # the scheduler starts a stream consumer with its generator
            raise PlanError(f"{unit.label} stream from {unit.stream_from}, which must run with them")
        (task,) = unit.tasks
        result = simulate_inference(self.cm, task, self.ctx.model(task.model), self.seq_lens,
                                    self.ctx.workload.micro_batch_size, self.now_s,
                                    offloaded=task.model in self.plan.offloaded, record_spans=self.record_spans,
                                    micro_batch_tokens=self.ctx.workload.micro_batch_tokens)
        return self._record(unit, result)

    def train(self, unit: Unit) -> Timing:
        result = simulate_training(self.cm, self.plan, unit.stage, self.ctx.models, self.seq_lens,
                                   self.ctx.workload.activation_recompute, self.now_s, self.record_spans)
        return self._record(unit, result)

    def weight_movement(self, unit: Unit) -> Timing:
        (task,) = unit.tasks
        if task.name not in self.moves:
            raise PlanError(f"weight-movement task {task.name} has no WeightMovement in the plan")
        result = simulate_weight_movement(self.cm, self.moves[task.name], self.ctx.model(task.model), self.now_s)
        return self._record(unit, result)


def verified_s(returned_s: list[float], cost_s: float, num_workers: int) -> float:
    """When a rule-based verifier of ``num_workers`` processes has scored every response, each
    taking ``cost_s`` from the moment it is returned (``returned_s``), first come first served: a
    queue with ``num_workers`` servers. Responses return when generation ends, or one by one as
    they finish when the plan streams them (the verifier runs on the driver's CPUs, beside the
    GPUs: ``harness.core.algorithm``). The generate task, which writes the rewards, ends then: as
    verl's trainer computes a rule-based reward right after generation, before the log-prob passes."""
    return max(verified_times(returned_s, cost_s, num_workers), default=0.0)


def verified_times(returned_s: list[float], cost_s: float, num_workers: int) -> list[float]:
    """When each response has been scored, under :func:`verified_s`'s queue (first come first served
    on ``num_workers`` processes; ties in the order given)."""
    free = [0.0] * num_workers
    heapq.heapify(free)
    done = [0.0] * len(returned_s)
    for i in sorted(range(len(returned_s)), key=returned_s.__getitem__):
        start = max(returned_s[i], heapq.heappop(free))
        heapq.heappush(free, start + cost_s)
        done[i] = max(returned_s[i], start + cost_s)
    return done


def generation_gather_s(ctx: PlanContext, plan: Plan) -> float:
    """Seconds to all-gather the actor's weights once, paid at every generation step when the
    generation engine runs the training engine's module in place (``weights: training_layout``) on
    ZeRO-3 shards: DeepSpeed's parameter hooks gather every layer for every forward (0 otherwise)."""
    if plan.engines is None or plan.engines.generation.weights != "training_layout":
        return 0.0
    gen = next((t for t in plan.tasks if t.kind == TaskKind.GENERATE), None)
    if gen is None:
        return 0.0
    s = gen.allocation.strategy
    if s.zero_stage != 3 or s.dp <= 1:
        return 0.0
    weights_bytes = ctx.cost_model.weights_gb(ctx.model(gen.model), s.tp, s.pp, ep=s.ep, etp=s.etp) * 1e9
    return ctx.cost_model.allgather_s(weights_bytes, list(gen.allocation.mesh))


def simulate_iteration(ctx: PlanContext, plan: Plan, memory: MemoryReport, iteration: int, batch: Batch) -> StepTrace:
    return PlanSimulator(ctx, plan, memory, iteration, batch).run()
