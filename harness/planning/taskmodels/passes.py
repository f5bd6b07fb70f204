"""Simulated inference passes, training stages and weight movements (docs/DESIGN.md section 4).

- Inference (``ref``, ``reward``, ``values``): each dp replica runs forward passes over its share
  of samples in micro-batches; with pp stages the passes pipeline, taking (M + pp - 1) stage times.
  Under ZeRO-3 (DeepSpeed-Chat) every forward first gathers the layer weights from all ranks;
  prefetching overlaps that with compute, so a pass takes max(compute, gather).
- Training: for each mini-batch, the plan's pipeline schedule is timed by the same
  :func:`harness.schedule.simulate` the planner uses, with per-stage forward/backward costs from the
  cost model (ZeRO-3 adds weight gathers in forward and backward and a gradient reduce-scatter,
  overlapped with compute); then gradients are synchronised across dp (all-reduce, or
  reduce-scatter + all-gather under ZeRO-1/2) and the optimizer steps.
- Weight movement: :func:`harness.planning.realloc.transfer_arrays` bytes per device over its tier,
  bounded by the senders' links as well.
- Offloaded models (``Plan.offloaded``) copy their weights in from host memory (PCIe) before
  each inference pass; a trained one copies its training states in before its training task and
  back out after it (NeMo-RL's colocated policy, in host memory while vLLM generates).
- Expert parallelism (``ParallelStrategy.ep``, mixture-of-experts models): forward and backward
  passes carry the layout's ep (each device's share of the experts, the all-to-alls; the ep replicas
  of a group are taken to run the same passes at the same time), and the gradients of the routed
  experts are synchronised over the ``dp / ep`` replicas that hold the same experts, the rest over dp.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from harness.costmodel import CostModel
from harness.costmodel.llama import forward_flops
from harness.errors import PlanError
from harness.core.plan import ModelRole, MovementKind, Plan, Task, TrainingStage, WeightMovement
from harness.planning import packing
from harness.planning.memory import state_gb
from harness.planning.realloc import DeviceTransfer, transfer_arrays
from harness.schedule import PipeCosts, simulate_each, simulate_makespans
from harness.core.trace import PipelineRun, SampleRecord, Span

BYTES_PER_PARAM = 2  # bf16 weights and gradients


@dataclass
class PassResult:
    spans: list[Span]
    end_s: float
    pipelines: list[PipelineRun]
    samples: list[SampleRecord] = field(default_factory=list)


def _zero3_gather_s(cm: CostModel, model, task: Task, num_layers: float) -> float:
    s = task.allocation.strategy
    if s.zero_stage != 3 or s.dp == 1:
        return 0.0
    stage_bytes = cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp) * 1e9 * num_layers / model.num_layers
    return cm.allgather_s(stage_bytes, list(task.allocation.mesh))


def _stage_flops(model, num_tokens: float, context_len: float, pp: int, stage: int) -> float:
    """Forward FLOPs of one pipeline stage; the LM/value head runs on the last stage only."""
    return forward_flops(model, num_tokens, context_len, num_layers=model.num_layers / pp,
                         include_head=stage == pp - 1)


def simulate_inference(cm: CostModel, task: Task, model, seq_lens: np.ndarray, micro_batch_size: int,
                       start_s: float, offloaded: bool = False, record_spans: bool = True,
                       micro_batch_tokens: Optional[int] = None) -> PassResult:
    """Forward passes pipelined over pp stages: stage p of micro-batch m starts once stage p-1
    finished it and stage p finished micro-batch m-1, so the pass takes sum(stage) + (M-1) max(stage).
    Micro-batches of ``micro_batch_size`` samples, or with ``micro_batch_tokens`` the pass's samples
    packed into bins of at most that many tokens, dealt over dp
    (:func:`harness.planning.packing.pass_microbatches_per_replica`).
    ``record_spans=False`` (planners' estimates) gives the same end time without the spans."""
    s = task.allocation.strategy
    layers = model.num_layers / s.pp
    gather = _zero3_gather_s(cm, model, task, layers)
    spans: list[Span] = []
    if offloaded:  # weights live in host memory between uses: copy them in over PCIe first
        load_s = cm.host_transfer_s(cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp) * 1e9)
        if record_spans:
            spans.append(Span(task.allocation.mesh, task.name, "load", start_s, start_s + load_s))
        start_s += load_s
    end = start_s
    packed_mbs = (None if micro_batch_tokens is None
                  else packing.pass_microbatches_per_replica(seq_lens, micro_batch_tokens, s.dp))
    for k in range(s.dp):
        mine = seq_lens[k::s.dp]
        if len(mine) == 0:
            continue
        num_mbs = (max(1, int(np.ceil(len(mine) / micro_batch_size))) if packed_mbs is None
                   else min(packed_mbs, len(mine)))
        tokens_per_mb = float(mine.sum()) / num_mbs
        seq = float(mine.mean())
        compute = [cm.forward_s(model, tokens_per_mb, seq, s.tp, layers, include_head=p == s.pp - 1, ep=s.ep,
                                ep_span=task.allocation.ep_span, etp=s.etp) for p in range(s.pp)]
        stage_s = [max(c, gather) for c in compute]
        first = start_s
        for p in range(s.pp if record_spans else 0):
            devices = task.allocation.stage_devices(k, p)
            flops = _stage_flops(model, float(mine.sum()), seq / 2, s.pp, p) / s.tp
            # compute shown as one block of its true length; overlapped gathers as a comm span
            spans.append(Span(devices, task.name, "forward", first, first + num_mbs * compute[p], flops))
            if gather > compute[p]:
                spans.append(Span(devices, task.name, "allgather", first, first + num_mbs * stage_s[p]))
            first += stage_s[p]
        end = max(end, start_s + sum(stage_s) + (num_mbs - 1) * max(stage_s))
    return PassResult(spans, end, [])


def training_pipe_costs(cm: CostModel, model, num_stages: int, tp: int, micro_batch_size: float, seq: float,
                        activation_seq: float, recompute: str, p2p_s: float = 0.0, ep: int = 1,
                        ep_span: Optional[int] = None, etp: Optional[int] = None,
                        activation_samples: Optional[float] = None) -> PipeCosts:
    """The one builder of a training pipe's :class:`PipeCosts` from the cost model (the plan's
    stages here, RLHFuse's fused-layout candidates and its experiments): per stage of
    ``model.num_layers / num_stages`` layers, forward and backward seconds of one micro-batch of
    ``micro_batch_size`` sequences of ``seq`` tokens (the LM or value head on the last stage; a MoE
    model's experts split over ``ep`` ranks, each over ``etp``, with their all-to-alls over ``ep_span``
    devices: :attr:`~harness.core.plan.Allocation.ep_span`), activation GB per in-flight
    micro-batch at ``activation_seq`` tokens a sequence (``activation_samples`` of them, by default
    ``micro_batch_size``: a packed micro-batch's budget at the longest sequence,
    :func:`harness.planning.packing.samples_at_longest`), and ``p2p_s`` per pipeline hop. No ZeRO-3
    gathers (:func:`_pipe_costs` adds them)."""
    tokens = micro_batch_size * seq
    layers = model.num_layers / num_stages
    last = num_stages - 1
    fwd = tuple(cm.forward_s(model, tokens, seq, tp, layers, include_head=st == last, ep=ep, ep_span=ep_span,
                             etp=etp) for st in range(num_stages))
    bwd = tuple(cm.backward_s(model, tokens, seq, tp, layers, include_head=st == last, ep=ep, ep_span=ep_span,
                              etp=etp) for st in range(num_stages))
    act = cm.activation_gb(model, micro_batch_size if activation_samples is None else activation_samples,
                           activation_seq, tp, layers, recompute)
    return PipeCosts(fwd, bwd, (act,) * num_stages, p2p_s)


def _pipe_costs(cm: CostModel, plan: Plan, stage: TrainingStage, models, seq: float,
                recompute: str) -> tuple[dict, dict]:
    """Per-pipe PipeCosts for the schedule (ZeRO-3 gathers overlapped: max(compute, comm)) and the
    pure compute seconds of forward and backward, which the spans report as busy time."""
    costs, compute_only = {}, {}
    for pipe in stage.schedule.pipes.values():
        task = _task_of_pipe(plan, stage, pipe.model)
        s = task.allocation.strategy
        model = getattr(models, pipe.model)
        samples = samples_per_microbatch(plan, stage, pipe.num_mbs, s.dp)
        p2p = 0.0
        if pipe.num_stages > 1:
            a, b = task.allocation.device(0, 0, 0), task.allocation.device(0, 1, 0)
            p2p = cm.p2p_s(samples * seq * model.hidden_size * BYTES_PER_PARAM / s.tp, a, b)
        pure = training_pipe_costs(cm, model, pipe.num_stages, s.tp, samples, seq, seq, recompute, p2p,
                                   s.ep, task.allocation.ep_span, s.etp)
        layers = model.num_layers / pipe.num_stages
        gather = _zero3_gather_s(cm, model, task, layers)
        if gather:
            stage_bytes = cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp) * 1e9 * layers / model.num_layers
            scatter = cm.reduce_scatter_s(stage_bytes, list(task.allocation.mesh))
            costs[pipe.name] = replace(pure, fwd=tuple(max(f, gather) for f in pure.fwd),
                                       bwd=tuple(max(b, gather + scatter) for b in pure.bwd))
        else:
            costs[pipe.name] = pure
        compute_only[pipe.name] = (pure.fwd, pure.bwd)
    return costs, compute_only


def samples_per_microbatch(plan: Plan, stage: TrainingStage, num_mbs: int, dp: int) -> float:
    """Samples in one micro-batch of a pipe of ``num_mbs`` micro-batches per replica over ``dp``
    replicas: the stage's ``micro_batch_size``, or under sequence packing the replica's share of the
    mini-batch over its micro-batches (:func:`harness.planning.packing.samples_per_microbatch`; the
    mean sequence length times it is the micro-batch's tokens)."""
    if stage.micro_batch_tokens is None:
        return stage.micro_batch_size
    return packing.samples_per_microbatch(plan.mini_batch_size, dp, num_mbs)


def _task_of_pipe(plan: Plan, stage: TrainingStage, model_role: str) -> Task:
    for name in stage.tasks:
        if plan.task(name).model == model_role:
            return plan.task(name)
    raise PlanError(f"training stage {stage.tasks} has a pipe for {model_role} but no task training it")


def pipe_stage_devices(plan: Plan, stage: TrainingStage) -> dict[tuple[str, int], tuple[int, ...]]:
    """Devices that run (pipe, stage) across all data-parallel groups.

    A stage may hold K pipes of one model per group of ranks (RLHFuse's fused schedules put K1
    actor pipes beside K2 critic pipes). Pipe k of a model (k-th of that model's pipes, in the
    schedule's order) in group g is data-parallel replica ``g*K + k`` of the model's task."""
    out: dict[tuple[str, int], tuple[int, ...]] = {}
    by_model: dict[str, list[str]] = {}
    for name, pipe in stage.schedule.pipes.items():
        by_model.setdefault(pipe.model, []).append(name)
    for model, names in by_model.items():
        task = _task_of_pipe(plan, stage, model)
        alloc, num_pipes = task.allocation, len(names)
        if alloc.strategy.dp % num_pipes:
            raise PlanError(f"training stage {stage.tasks}: {num_pipes} {model} pipes per group do not divide "
                            f"dp={alloc.strategy.dp}")
        groups = alloc.strategy.dp // num_pipes
        for k, name in enumerate(names):
            for st in range(stage.schedule.pipes[name].num_stages):
                out[(name, st)] = tuple(d for g in range(groups) for d in alloc.stage_devices(g * num_pipes + k, st))
    return out


def grad_sync_s(cm: CostModel, task: Task, model) -> tuple[float, float]:
    """(communication, optimizer) seconds after each mini-batch's pipeline. Under expert parallelism
    the routed experts' gradients are synchronised over the replicas holding the same experts (one
    rank of each expert-parallel domain: ``dp / ep`` of them, ``dp * tp / (ep * etp)`` with expert
    tensor parallelism), after the rest's over dp."""
    s = task.allocation.strategy
    if s.ep > 1 and s.zero_stage != 3:
        expert_bytes = cm.expert_weights_gb(model, s.tp, s.pp, s.ep, etp=s.etp) * 1e9
        dense_bytes = cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp) * 1e9 - expert_bytes
        group = [task.allocation.device(k, 0, 0) for k in range(s.dp)]
        domain = s.ep * s.expert_tp  # ranks of one stage, tp fastest (Allocation.ep_span)
        expert_group = [task.allocation.device(r // s.tp, 0, r % s.tp) for r in range(0, s.dp * s.tp, domain)]
        comm = _sync_s(cm, dense_bytes, group, s.zero_stage) + _sync_s(cm, expert_bytes, expert_group, s.zero_stage)
        return comm, cm.optimizer_step_s(model, s.dp, s.tp, s.pp, s.zero_stage, s.ep, etp=s.etp)
    stage_bytes = cm.weights_gb(model, s.tp, s.pp) * 1e9
    group = [task.allocation.device(k, 0, 0) for k in range(s.dp)]
    if s.dp == 1 or s.zero_stage == 3:  # ZeRO-3 reduce-scatters inside backward (costed there)
        comm = 0.0
    elif s.zero_stage in (1, 2):
        comm = cm.reduce_scatter_s(stage_bytes, group) + cm.allgather_s(stage_bytes, group)
    else:
        comm = cm.allreduce_s(stage_bytes, group)
    return comm, cm.optimizer_step_s(model, s.dp, s.tp, s.pp, s.zero_stage, s.ep)


def _sync_s(cm: CostModel, num_bytes: float, group: list[int], zero_stage: int) -> float:
    """Gradient synchronisation of ``num_bytes`` per device over ``group`` (ZeRO-1/2: reduce-scatter
    then all-gather of the updated weights; else all-reduce)."""
    if len(group) == 1:
        return 0.0
    if zero_stage in (1, 2):
        return cm.reduce_scatter_s(num_bytes, group) + cm.allgather_s(num_bytes, group)
    return cm.allreduce_s(num_bytes, group)


def simulate_training(cm: CostModel, plan: Plan, stage: TrainingStage, models, seq_lens: np.ndarray,
                      recompute: str, start_s: float, record_spans: bool = True) -> PassResult:
    """Every mini-batch of ``stage``: its pipeline schedule timed under the mini-batch's mean
    sequence length, then each task's gradient sync and optimizer step. ``record_spans=False``
    (planners' estimates) returns the same end time without spans or pipeline runs."""
    tasks = [plan.task(n) for n in stage.tasks]
    spans: list[Span] = []
    runs: list[PipelineRun] = []
    now = start_s
    # an offloaded model's training states come in from host memory first and go back after
    copies_s = [_offloaded_states_copy_s(cm, plan, task, getattr(models, task.model)) for task in tasks]
    for task, copy_s in zip(tasks, copies_s):
        if copy_s and record_spans:
            spans.append(Span(task.allocation.mesh, task.name, "load", now, now + copy_s))
        now += copy_s
    label = "+".join(stage.tasks)
    stage_devices = pipe_stage_devices(plan, stage) if record_spans else {}
    minibatch_costs = []
    for mb_index in range(stage.num_minibatches):
        lo = mb_index * plan.mini_batch_size
        seq = float(seq_lens[lo:lo + plan.mini_batch_size].mean())
        minibatch_costs.append((seq, *_pipe_costs(cm, plan, stage, models, seq, recompute)))
    if not record_spans:
        for makespan in simulate_makespans(stage.schedule, [costs for _, costs, _ in minibatch_costs]):
            now += makespan
            for task in tasks:
                comm, optim = grad_sync_s(cm, task, getattr(models, task.model))
                now += comm + optim
        for copy_s in copies_s:
            now += copy_s
        return PassResult(spans, now, runs)
    results = simulate_each(stage.schedule, [costs for _, costs, _ in minibatch_costs])
    for (seq, costs, compute_only), result in zip(minibatch_costs, results):
        pipeline_busy = sum(result.busy.values())
        per_pipe = {}
        for name, pipe in stage.schedule.pipes.items():
            task = _task_of_pipe(plan, stage, pipe.model)
            model = getattr(models, pipe.model)
            tp = task.allocation.strategy.tp
            samples = samples_per_microbatch(plan, stage, pipe.num_mbs, task.allocation.strategy.dp)
            fwd_flops = [_stage_flops(model, samples * seq, seq / 2, pipe.num_stages, st) / tp
                         for st in range(pipe.num_stages)]
            per_pipe[name] = (task.name, fwd_flops, compute_only[name])
        for action, a_start in result.start.items():
            if not action.is_compute:
                continue
            task_name, fwd_flops, (fwd_busy, bwd_busy) = per_pipe[action.pipe]
            is_fwd = action.kind == "F"
            t0, t1 = now + a_start, now + result.end[action]
            devices = stage_devices[(action.pipe, action.stage)]
            busy = (fwd_busy if is_fwd else bwd_busy)[action.stage]
            flops = fwd_flops[action.stage] * (1.0 if is_fwd else 2.0)
            spans.append(Span(devices, task_name, "forward" if is_fwd else "backward", t0, min(t1, t0 + busy), flops))
            if t1 - t0 > busy * (1 + 1e-9):  # communication-bound (ZeRO-3 gathers)
                spans.append(Span(devices, task_name, "allgather", t0, t1))
        runs.append(PipelineRun(label if len(tasks) > 1 else tasks[0].name, now, result.makespan,
                                len(result.busy), pipeline_busy, max(result.peak_memory.values())))
        now += result.makespan
        for task in tasks:  # tasks of one stage share devices: their syncs and steps run in turn
            model = getattr(models, task.model)
            comm, optim = grad_sync_s(cm, task, model)
            mesh = task.allocation.mesh
            if comm > 0:
                spans.append(Span(mesh, task.name, "allreduce", now, now + comm))
            spans.append(Span(mesh, task.name, "optimizer", now + comm, now + comm + optim))
            now += comm + optim
    for task, copy_s in zip(tasks, copies_s):
        if copy_s:
            spans.append(Span(task.allocation.mesh, task.name, "offload", now, now + copy_s))
        now += copy_s
    return PassResult(spans, now, runs)


def _offloaded_states_copy_s(cm: CostModel, plan: Plan, task, model) -> float:
    """One copy of a training task's states (weights, gradients, optimizer states: what its
    devices hold of them) between host and device memory when the plan keeps its model in host
    memory between uses (``Plan.offloaded``; NeMo-RL's colocated policy, moved out before
    generation and back for the log-prob pass and training), else 0."""
    if task.model not in plan.offloaded:
        return 0.0
    optimizer_offload = plan.engines is not None and plan.engines.training.optimizer_offload
    return cm.host_transfer_s(state_gb(cm, model, task.allocation.strategy, "train", optimizer_offload) * 1e9)


def training_work_bound_s(cm: CostModel, plan: Plan, stage: TrainingStage, models, seq_lens: np.ndarray,
                          recompute: str) -> float:
    """A lower bound of :func:`simulate_training`'s duration without timing any schedule. Per
    mini-batch, a pipeline lasts at least (a) the forwards and backwards of the busiest rank run
    back to back (a rank runs one action at a time), and (b) for every stage ``s``: the forwards of
    stages before ``s`` (its first input), all of its own ``M`` forwards and backwards, and the
    backwards of the stages before it (its last gradient's way back): exactly 1F1B's
    ``(M + S - 1)(f + b)`` on uniform stages. Then the exact gradient syncs and optimizer steps.
    Planners use it to skip candidates that cannot beat the best found."""
    tasks = [plan.task(n) for n in stage.tasks]
    total = sum(2 * _offloaded_states_copy_s(cm, plan, task, getattr(models, task.model)) for task in tasks)
    for mb_index in range(stage.num_minibatches):
        lo = mb_index * plan.mini_batch_size
        seq = float(seq_lens[lo:lo + plan.mini_batch_size].mean())
        costs, _ = _pipe_costs(cm, plan, stage, models, seq, recompute)
        work: dict[int, float] = {}
        chain = 0.0
        for name, pipe in stage.schedule.pipes.items():
            c = costs[name]
            before = 0.0  # forwards + backwards of the stages before this one
            for st in range(pipe.num_stages):
                own = pipe.num_mbs * (c.fwd[st] + c.bwd[st])
                rank = pipe.stage_to_rank[st]
                work[rank] = work.get(rank, 0.0) + own
                chain = max(chain, before + own)
                before += c.fwd[st] + c.bwd[st]
        total += max(chain, *work.values())
        for task in tasks:
            comm, optim = grad_sync_s(cm, task, getattr(models, task.model))
            total += comm + optim
    return total


def weight_movement_s(cm: CostModel, move: WeightMovement, model) -> tuple[float, list]:
    """Duration of a weight movement and its per-device transfers.

    Receivers: each device receives its bytes over its tier. Senders: the moved bytes leave the
    source devices, spread evenly over them; when few devices feed many (a small training pool
    syncing many generation replicas) the senders' links are the bottleneck. The actor's refit into
    a reloading generation engine (:func:`is_engine_refit`) adds the engine's reload time
    (:meth:`harness.costmodel.engines.EngineCosts.refit_reload_s`), and then every target device
    takes part, bytes or none."""
    reload_s = (cm.engine_costs.refit_reload_s(model)
                if cm.engine_costs is not None and is_engine_refit(move) else 0.0)
    layer_bytes = cm.weights_gb(model, 1, 1) * 1e9 / model.num_layers
    devices, received, intra = transfer_arrays(move.source, move.target, model.num_layers, layer_bytes,
                                               cm.gpus_per_node)
    is_moved = np.full(len(devices), True) if reload_s > 0 else received > 0  # devices: the target's
    if not is_moved.any():
        return 0.0, []
    moved = [DeviceTransfer(d, b, i) for d, b, i in zip(devices[is_moved].tolist(), received[is_moved].tolist(),
                                                        intra[is_moved].tolist())]
    if not any(t.bytes > 0 for t in moved):
        return reload_s, moved
    receive = max(cm.transfer_s(b, i) for b, i in {(t.bytes, t.intra_node) for t in moved})
    send = cm.transfer_s(sum(t.bytes for t in moved) / len(move.source.mesh), all(t.intra_node for t in moved))
    return max(receive, send) + reload_s, moved


def is_engine_refit(move: WeightMovement) -> bool:
    """Whether ``move`` is the actor's weights reaching generation on the devices it shares with
    training (a ``REALLOC`` into the ``gen`` task's layout): the refit a reloading engine does."""
    return move.kind == MovementKind.REALLOC and move.model == ModelRole.ACTOR and move.task == "realloc_actor_gen"


def simulate_weight_movement(cm: CostModel, move: WeightMovement, model, start_s: float) -> PassResult:
    duration, moved = weight_movement_s(cm, move, model)
    kind = move.kind.value  # realloc | param_sync: the span kind the metrics read
    spans = [Span((t.device,), move.task, kind, start_s, start_s + duration, 0.0, t.bytes) for t in moved]
    return PassResult(spans, start_s + duration, [])
