"""Training units of one PPO iteration on ``backend=ray`` (driver side): each device's action list
from the stage's lowered schedule, the loss inputs each training task declares it reads, and what the
workers report back (spans, PPO statistics, one :class:`~harness.core.trace.PipelineRun` per mini-batch).

A stage trains one model's pipeline, or actor and critic fused into one bidirectional schedule
(RLHFuse section 5); every device runs its logical rank's actions
(:mod:`harness.backends.ray.worker.pipeline`). ``it`` is the
:class:`harness.backends.ray.driver.iteration.Iteration` the unit belongs to.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from harness.backends.ray.driver import experience as ex
from harness.backends.ray.driver.dispatch import UnitRun, outputs
from harness.backends.ray.protocol import Dispatch, LossInputs, Train, TrainPart
from harness.backends.ray.replies import ModelTrained, Result
from harness.core.plan import Task
from harness.core.units import Unit
from harness.planning.dataflow import TaskInputs, loss_inputs
from harness.planning.taskmodels.passes import pipe_stage_devices
from harness.planning.workflow import RECOMPUTE_LOGPROBS
from harness.schedule.p2p_order import in_posting_order
from harness.core.trace import PipelineRun


def training_data(it, task: Task) -> dict[str, np.ndarray]:
    """The loss inputs of training task ``task``, computed from exactly the data it declares
    it reads (:class:`TaskInputs`: a declared input not written yet, or an undeclared one read,
    fails at once). Computed once per distinct set of declared inputs; both PPO training tasks
    declare the same, so advantages and returns are computed once per iteration."""
    recomputed = any(t.name in RECOMPUTE_LOGPROBS for t in it.plan.tasks)
    inputs = TaskInputs(task.name, task.reads, ex.sample_data(it.rollout, it.outputs, recomputed))
    key = frozenset(inputs)
    if key not in it.experience:
        it.experience[key], stats = ex.training_data(inputs, it.ctx.algorithm, it.opts.gamma, it.opts.lam,
                                                       it.opts.whiten_advantages, it.ctx.workload.max_gen_len)
        for name, value in stats.items():
            it.trace.counters[f"rl/{name}"] = value
    data = it.experience[key]
    return {k: data[k] for k in loss_inputs(task.model.value, it.ctx.algorithm)}


def train_part(it, stage, task: Task) -> TrainPart:
    """``task``'s part of its stage: its loss inputs, and how its replicas cut a mini-batch (the
    stage's micro-batch size, or under sequence packing its budget and the micro-batch count of
    the task's pipe in the schedule)."""
    pipe = next(p for p in stage.schedule.pipes.values() if p.model == task.model.value)
    return TrainPart(LossInputs(**training_data(it, task)), stage.micro_batch_size, stage.micro_batch_tokens,
                     pipe.num_mbs if stage.micro_batch_tokens is not None else None)


def minibatch_order(it) -> list:
    return ex.minibatch_indices(it.batch.num_samples, it.plan.mini_batch_size, it.ctx.seed, it.iteration)


def train_unit(it, unit: Unit) -> UnitRun:
    """A training stage: every device runs its logical rank's lowered action list from the
    stage's schedule (one model's pipeline, or actor and critic fused, RLHFuse section 5), each
    device its own list (dispatched by device)."""
    stage = unit.stage
    minibatches = minibatch_order(it)
    ordered = in_posting_order(stage.schedule)
    rank_of: dict[int, int] = {}
    held: dict[int, set[tuple[str, int]]] = {}  # device -> the (pipe, stage) pairs it runs
    for (pipe, st), devices in pipe_stage_devices(it.plan, stage).items():
        rank = stage.schedule.pipes[pipe].stage_to_rank[st]
        for d in devices:
            if rank_of.setdefault(d, rank) != rank:
                raise RuntimeError(f"device {d} holds logical ranks {rank_of[d]} and {rank} of {unit.label}")
            held.setdefault(d, set()).add((pipe, st))
    first, algorithm = unit.tasks[0], it.ctx.algorithm
    request = Train(unit.label, first.model.value, first.allocation,
                    parts={t.model.value: train_part(it, stage, t) for t in unit.tasks},
                    allocations={t.model.value: t.allocation for t in unit.tasks},
                    pipe_role={name: pipe.model for name, pipe in stage.schedule.pipes.items()},
                    minibatches=minibatches, temperature=it.opts.temperature, clip_eps=it.opts.clip_eps,
                    clip_eps_high=algorithm.clip_eps_high, value_clip_eps=it.opts.value_clip_eps,
                    kl_loss_coef=algorithm.kl_coef if algorithm.kl_penalty == "loss" else 0.0)
    shares = {d: request.replace(actions=tuple(a.token() for a in ordered.order.get(rank_of[d], [])
                                               if (a.pipe, a.stage) in held[d]))
              for d in rank_of}
    group0 = {devices[0] for devices in pipe_stage_devices(it.plan, stage).values()}
    done = yield [it.group.start(request, mode=Dispatch.BY_DEVICE, shares=shares)]
    for task in unit.tasks:
        role = task.model.value
        per_task = [dataclasses.replace(r, spans=r.out.models[role].spans, out=r.out.models[role])
                    for r in done.results if role in r.out.models]
        record_trained(it, task.name, role, per_task, len(minibatches))
    record_pipelines(it, unit.label, group0, done.results, len(minibatches))


def record_pipelines(it, label: str, ranks: set[int], results: list[Result], num_minibatches: int) -> None:
    """One PipelineRun per mini-batch over the stage's logical ranks of group 0 (tp rank 0)."""
    mine = [r for r in results if r.rank in ranks]
    for j in range(num_minibatches):
        start = min(m.runs[j][0] for r in mine for m in r.out.models.values())
        end = max(m.runs[j][1] for r in mine for m in r.out.models.values())
        compute = sum(min(e, end) - max(st, start) for r in mine for m in r.out.models.values()
                      for kind, st, e, *_ in m.spans if kind in ("forward", "backward") and st < end and e > start)
        it.trace.pipelines.append(PipelineRun(label, start - it.t0, end - start, len(mine), compute, 0.0))


def record_trained(it, name: str, role: str, results: list[Result[ModelTrained]], n: int) -> None:
    """A training task's spans, its model's new version, and its mean loss statistics per
    mini-batch (``n``) from the devices that computed the loss."""
    it.record(name, results)
    it.homes.trained(role)
    stats = [m.stats for m in outputs(results) if m.stats is not None]
    prefix = "policy" if role == "actor" else "value"
    if stats:
        it.trace.counters[f"rl/{prefix}_loss"] = sum(s.loss for s in stats) / n
        it.trace.counters[f"rl/{prefix}_clipfrac"] = sum(s.clipfrac for s in stats) / n
    kls = [s.approx_kl for s in stats if s.approx_kl is not None]
    if kls:
        it.trace.counters["rl/ppo_kl"] = sum(kls) / n
