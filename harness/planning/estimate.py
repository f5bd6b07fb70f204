"""Task-time estimates for planners: the simulator's own task models, run on one candidate task.

Systems search layouts with the cost model (RLHFuse-Base's brute force, ReaLHF's annealing). To
score a candidate they need the same numbers the simulator would produce, so this module runs the
task models (:mod:`harness.planning.taskmodels`) on a representative batch drawn from the
workload (a pure function of the seed), or a whole plan through :mod:`harness.planning.simulate`. Generation is estimated on the instances holding the
longest samples only, because the slowest instance decides when generation ends.
"""
from __future__ import annotations

import numpy as np

from harness.core.plan import GenerationPolicy, Plan, Task, TrainingStage
from harness.planning.memory import check_plan_memory
from harness.planning.offpolicy import steady_step_s
from harness.planning.simulate import PlanSimulator, simulate_iteration
from harness.planning.taskmodels.generation import (StepSchedule, kv_capacity_tokens, simulate_generation, step_schedule,
                                                     timed_end_s)
from harness.planning.taskmodels.passes import simulate_inference, simulate_training, training_work_bound_s
from harness.planning.taskmodels.streaming import simulate_streaming_inference
from harness.system import PlanContext
from harness.core.trace import StepTrace
from harness.core.workload import Batch, draw_batch

NUM_GEN_INSTANCES_ESTIMATED = 4


def representative_batch(ctx: PlanContext) -> Batch:
    """The batch planners estimate on: iteration 0's (:func:`~harness.core.workload.draw_batch`)."""
    return draw_batch(ctx.workload, ctx.seed, 0, ctx.algorithm)


class GenerationEstimates:
    """:func:`generation_s` of one batch for many candidate layouts, memoised: a search scores
    hundreds of candidates (ReaLHF's annealing moves tasks between meshes; RLHFuse-Base tries every
    layout), and many of them simulate the same instance.

    An instance's simulated end depends on its tensor/pipeline widths, the data-parallel width and its
    rank (which samples it holds), the expert parallelism, the policy, the model and its KV capacity,
    never on which devices it runs on (the generation task model prices prefill and decode by widths
    only). The KV capacity only matters while it binds: an instance never reserves more than its
    ``m`` largest samples' ``prompt + max_gen_len`` tokens (``m`` the most it runs at once;
    allocating on demand, their ``prompt + output + 1``), so every capacity above that sum gives the
    same run. The memo keys instances by these inputs with the capacity clamped to that
    sum, so the estimates are those of :func:`generation_s` computed afresh, bit for bit."""

    def __init__(self, ctx: PlanContext, batch: Batch):
        self.ctx, self.batch = ctx, batch
        # dynamic sampling: the rounds run one after the other, each estimated as a batch of its own
        self._rounds = [GenerationEstimates(ctx, rb) for rb in batch.rounds] if batch.rounds is not None else None
        # a stable sort: many samples tie at max_gen_len, and numpy's default sort breaks ties by
        # the SIMD kernel the CPU dispatches to (AVX-512 or not), which made estimates machine-dependent
        self._longest_first = np.argsort(-batch.output_lens, kind="stable")
        self._ids = np.arange(batch.num_samples)
        self._end_s: dict[tuple, float] = {}
        self._slowest: dict[int, list[int]] = {}
        self._schedules: dict[tuple, StepSchedule] = {}
        self._prefill_s: dict[tuple, dict[int, float]] = {}  # per (model, tp, pp, ep): seconds by prefill tokens

    @property
    def num_simulated(self) -> int:
        """Instance runs simulated so far (every other estimate came from the memo)."""
        return len(self._end_s) + sum(r.num_simulated for r in self._rounds or ())

    def slowest_instances(self, dp: int) -> list[int]:
        """The (at most NUM_GEN_INSTANCES_ESTIMATED) instances holding the longest samples, longest first."""
        if dp not in self._slowest:
            instance_of = self._ids % dp
            self._slowest[dp] = [int(k) for k in dict.fromkeys(instance_of[self._longest_first])][
                :NUM_GEN_INSTANCES_ESTIMATED]
        return self._slowest[dp]

    def _schedule(self, dp: int, k: int, mine: np.ndarray, policy: GenerationPolicy, kv_tokens: int) -> StepSchedule:
        """Instance ``k`` of ``dp``'s continuous batching in steps (:func:`step_schedule`), kept per
        (its samples, batch limit, KV capacity): the layouts and models that share them share it."""
        max_batch = policy.max_batch_size or len(mine)
        on_demand = policy.kv_allocation == "on_demand"
        key = (dp, k, max_batch, kv_tokens, on_demand)
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._schedules[key] = step_schedule(self.batch.prompt_lens[mine], self.batch.output_lens[mine],
                                                            max_batch, kv_tokens, self.ctx.workload.max_gen_len,
                                                            on_demand)
        return schedule

    def _kv_key(self, mine: np.ndarray, policy: GenerationPolicy, kv_tokens: int) -> int:
        """``kv_tokens``, or the most the instance can ever reserve when that is less (class docstring).
        Allocating on demand, a sample never holds more than its prompt + output (and the next
        token of each running sample is asked for too: one more each)."""
        if policy.kv_allocation == "on_demand":
            need = np.sort(self.batch.prompt_lens[mine] + self.batch.output_lens[mine] + 1)[::-1]
        else:
            need = np.sort(self.batch.prompt_lens[mine] + self.ctx.workload.max_gen_len)[::-1]
        at_once = min(policy.max_batch_size or len(mine), len(mine))
        return min(kv_tokens, int(need[:at_once].sum()))

    def __call__(self, task: Task, policy: GenerationPolicy, kv_capacity_gb: float, stop_above: float = np.inf) -> float:
        """Estimated generation time: simulate only the instances that hold the longest samples.
        Returns as soon as one instance ends after ``stop_above`` (a search's best so far: the
        candidate has lost), with a time above it. Under dynamic sampling, the sum of the rounds'
        estimates (the verifier's scoring between rounds left out, as it is after the last)."""
        if self._rounds is not None:
            total = 0.0
            for estimates in self._rounds:
                total += estimates(task, policy, kv_capacity_gb, stop_above - total)
                if total > stop_above:
                    break
            return total
        ctx, batch, strategy = self.ctx, self.batch, task.allocation.strategy
        model = ctx.model(task.model)
        kv_tokens = kv_capacity_tokens(ctx.cost_model, model, strategy.tp, strategy.pp, kv_capacity_gb)
        worst = 0.0
        for k in self.slowest_instances(strategy.dp):
            mine = self._ids[self._ids % strategy.dp == k]
            key = (task.model, strategy.dp, strategy.tp, strategy.pp, strategy.ep, k, policy,
                   self._kv_key(mine, policy, kv_tokens))
            end_s = self._end_s.get(key)
            if end_s is None and policy.batching == "continuous":
                schedule = self._schedule(strategy.dp, k, mine, policy, key[-1])
                prefill_memo = self._prefill_s.setdefault((task.model, strategy.tp, strategy.pp, strategy.ep), {})
                end_s = self._end_s[key] = timed_end_s(schedule, ctx.cost_model, model, strategy.tp, strategy.pp,
                                                       strategy.ep, 0.0, prefill_memo)
            elif end_s is None:
                sub = Task(task.name, task.kind, task.model,
                           type(task.allocation)(task.allocation.replica_devices(k),
                                                 type(strategy)(1, strategy.tp, strategy.pp)))
                end_s = simulate_generation(ctx.cost_model, sub, policy, model, batch.prompt_lens[mine],
                                            batch.output_lens[mine], 0.0, kv_capacity_gb, ctx.workload.max_gen_len,
                                            ep=strategy.ep).end_s
                self._end_s[key] = end_s
            worst = max(worst, end_s)
            if worst > stop_above:
                break
        return worst


def generation_s(ctx: PlanContext, task: Task, policy: GenerationPolicy, batch: Batch, kv_capacity_gb: float,
                 stop_above: float = np.inf) -> float:
    """Estimated generation time of ``task`` on ``batch`` (:class:`GenerationEstimates`, unmemoised:
    a search scoring many candidates keeps one :class:`GenerationEstimates`)."""
    return GenerationEstimates(ctx, batch)(task, policy, kv_capacity_gb, stop_above)


def inference_s(ctx: PlanContext, task: Task, batch: Batch) -> float:
    seq = batch.prompt_lens + batch.output_lens
    return simulate_inference(ctx.cost_model, task, ctx.model(task.model), seq,
                              ctx.workload.micro_batch_size, 0.0, record_spans=False,
                              micro_batch_tokens=ctx.workload.micro_batch_tokens).end_s


def _one_task_plan(task: Task, stage: TrainingStage, mini_batch_size: int, batch: Batch) -> Plan:
    return Plan(system="estimate", tasks=[task], training=[stage], mini_batch_size=mini_batch_size,
                global_batch_size=batch.num_samples)


def training_s(ctx: PlanContext, task: Task, stage: TrainingStage, mini_batch_size: int, batch: Batch) -> float:
    plan = _one_task_plan(task, stage, mini_batch_size, batch)
    return simulate_training(ctx.cost_model, plan, stage, ctx.models, batch.prompt_lens + batch.output_lens,
                             ctx.workload.activation_recompute, 0.0, record_spans=False).end_s


def training_bound_s(ctx: PlanContext, task: Task, stage: TrainingStage, mini_batch_size: int, batch: Batch) -> float:
    """A lower bound of :func:`training_s` (``passes.training_work_bound_s``): cheap, no schedule timed."""
    plan = _one_task_plan(task, stage, mini_batch_size, batch)
    return training_work_bound_s(ctx.cost_model, plan, stage, ctx.models, batch.prompt_lens + batch.output_lens,
                                 ctx.workload.activation_recompute)


def streaming_inference_end_s(ctx: PlanContext, gen_result, inference: list[Task], moves: dict) -> float:
    """When the last streaming inference pass ends behind a simulated generation (its samples'
    finish times and device releases). Used to choose RLHFuse's migration threshold and layout."""
    free = {d: 0.0 for t in inference for d in t.allocation.mesh}
    free.update(gen_result.device_free_s())
    models = {t.model: ctx.model(t.model) for t in inference}
    streamed = simulate_streaming_inference(ctx.cost_model, inference, models, gen_result.samples, free,
                                            ctx.workload.micro_batch_size, moves, record_spans=False)
    return max(streamed.end_s.values())


def simulated_makespan_s(ctx: PlanContext, plan: Plan, batch: Batch | None = None) -> float:
    """The iteration time of :func:`simulate_plan` without building its trace: every task's end,
    as the full simulator predicts it (the trace's makespan is the last span's end, which can differ
    from it in the last bit); for an off-policy plan, the steady-state interval between training
    steps (:func:`harness.planning.iterations.steady_step_s`). Checks memory first. Planners score
    whole plans with it."""
    memory = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    if plan.off_policy is not None:  # the interval between training steps in steady state
        return steady_step_s(ctx, plan, memory, batch if batch is not None else representative_batch(ctx))
    simulator = PlanSimulator(ctx, plan, memory, 0, batch if batch is not None else representative_batch(ctx),
                              record_spans=False)
    simulator.run()
    return simulator.timeline.makespan_s


def simulate_plan(ctx: PlanContext, plan: Plan, batch: Batch | None = None, iteration: int = 0) -> StepTrace:
    """One iteration of a whole plan under the full simulator (representative batch by default):
    the StepTrace ``backend=sim`` would report. Checks memory first (raises PlanMemoryError).
    Planners use it to verify or score whole plans."""
    memory = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    return simulate_iteration(ctx, plan, memory, iteration, batch if batch is not None else representative_batch(ctx))
