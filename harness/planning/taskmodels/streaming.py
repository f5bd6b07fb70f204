"""Sample-level streaming of generation output into inference (RLHFuse section 4, inter-stage fusion).

Inference tasks with a stream edge (``Task.stream_from``: ``ref``, ``reward`` and ``values`` in
RLHFuse's plans) do not wait for the whole batch: they consume samples as generation finishes them, on every
inference replica whose devices generation has released (instances freed by the long-tail
migration release theirs early; the rest at the end of generation).

Model (all three inference tasks share one allocation in a fused plan):

- a replica becomes available when all its devices are free, then first loads what it needs:
  the critic's weights resharded from the training layout (``realloc`` bytes over the links);
  ref and reward weights are resident (their memory is counted by the memory check);
- it then repeatedly takes up to ``micro_batch_size`` finished samples (waiting for the next
  finish when none is ready) and runs ref, reward and critic forward passes on them, stage by
  stage (each pipeline stage runs the three models in turn); the replica's first stage takes
  the next micro-batch after the slowest stage's time (steady-state pipelining), and a
  micro-batch completes no earlier than the previous one plus that time;
- samples are taken in finish order by whichever replica is free first (work-conserving):
  :class:`harness.planning.scheduler.StreamFeed`, the rule ``backend=ray`` follows too.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import numpy as np

from harness.costmodel import CostModel
from harness.core.plan import Task, WeightMovement
from harness.planning.scheduler import StreamFeed
from harness.planning.realloc import reallocation_transfers
from harness.core.trace import SampleRecord, Span


@dataclass
class StreamingResult:
    spans: list[Span]
    end_s: dict[str, float]  # per inference task


def _load_times(cm: CostModel, move: WeightMovement | None, model) -> dict[int, float]:
    """Per device: time to fetch its share of the moved weights."""
    if move is None:
        return {}
    layer_bytes = cm.weights_gb(model, 1, 1) * 1e9 / model.num_layers
    out = {}
    for tr in reallocation_transfers(move.source, move.target, model.num_layers, layer_bytes, cm.gpus_per_node):
        if tr.bytes > 0:
            link = cm.intra_node if tr.intra_node else cm.inter_node
            out[tr.device] = link.latency_us * 1e-6 + tr.bytes / (link.bandwidth_gbps * 1e9 * link.efficiency_frac)
    return out


def _stage_times(cm: CostModel, tasks: list[Task], models: dict, tokens: float, seq: float, tp: int,
                 pp: int, ep: int = 1, ep_span: Optional[int] = None,
                 etp: Optional[int] = None) -> dict[str, list[float]]:
    """Forward time of each pipeline stage for each task (stages are equal but for the head on the last;
    a MoE model's at the layout's expert parallelism, its ep replicas taken to pass together)."""
    out = {}
    for t in tasks:
        model = models[t.model]
        layers = model.num_layers / pp
        body = (cm.forward_s(model, tokens, seq, tp, layers, include_head=False, ep=ep, ep_span=ep_span, etp=etp)
                if pp > 1 else 0.0)
        out[t.name] = [body] * (pp - 1) + [cm.forward_s(model, tokens, seq, tp, layers, include_head=True,
                                                        ep=ep, ep_span=ep_span, etp=etp)]
    return out


def simulate_streaming_inference(cm: CostModel, tasks: list[Task], models: dict[str, object],
                                 samples: list[SampleRecord], device_free_s: dict[int, float],
                                 micro_batch_size: int, moves: dict[str, WeightMovement],
                                 record_spans: bool = True) -> StreamingResult:
    """``record_spans=False`` (planners' estimates) gives the same end times without the spans."""
    alloc = tasks[0].allocation
    s = alloc.strategy
    order = sorted(samples, key=lambda r: (r.finish_s, r.sample_id))
    ready_s = [r.finish_s for r in order]
    lengths = [r.prompt_len + r.response_len for r in order]  # whole tokens: sums are exact in any order
    spans: list[Span] = []
    feed = StreamFeed(s.dp, micro_batch_size)  # the feeding rule Ray's streamed generation uses too
    # replica events in time order (ties: lower replica first): (when, k, kind), kind 1 = available
    # (devices free, weights fetched), 2 = idle again; samples finish in ``order``
    events: list[tuple[float, int, int]] = []
    last_done: dict[int, float] = {}
    loads = [_load_times(cm, moves.get(t.name), models[t.model]) for t in tasks]
    loading = "+".join(t.name for t in tasks if t.name in moves)  # tasks whose weights are fetched per replica
    for k in range(s.dp):
        devices = alloc.replica_devices(k)
        start = max(device_free_s.get(d, 0.0) for d in devices)
        load = sum(max((times.get(d, 0.0) for d in devices), default=0.0) for times in loads)
        if load > 0:
            spans.append(Span(devices, loading, "realloc", start, start + load))
        events.append((start + load, k, 1))
        last_done[k] = start + load
    heapq.heapify(events)
    end = {t.name: 0.0 for t in tasks}
    # a micro-batch's stage times depend on its token count and size only: computed once per shape
    shapes: dict[tuple[int, int], tuple[dict[str, list[float]], list[float]]] = {}
    num_samples, num_finished, num_taken = len(order), 0, 0
    while num_taken < num_samples:
        # the next moment something happens; every sample finished by then is queued before any is taken.
        # A sample's finish is such a moment only while a replica is idle to take it: with every
        # replica busy or not yet available, the finishes up to the next replica event only queue
        # (in finish order, as they would one by one)
        next_event = events[0][0] if events else np.inf
        if feed.idle:
            now = min(ready_s[num_finished] if num_finished < num_samples else np.inf, next_event)
        else:
            now = next_event
        first = num_finished
        while num_finished < num_samples and ready_s[num_finished] <= now:
            num_finished += 1
        feed.finished(range(first, num_finished))
        while events and events[0][0] == now:
            _, k, kind = heapq.heappop(events)
            if kind == 1:
                feed.available(k)
            else:
                feed.done(k)
        for k, taken in feed.take():
            num_taken += len(taken)
            shape = (sum(lengths[i] for i in taken), len(taken))
            if shape not in shapes:
                tokens = float(shape[0])
                # stage p runs ref, reward and critic in turn on this micro-batch: one pipeline whose
                # stage time is the sum over the three models
                per_task = _stage_times(cm, tasks, models, tokens, tokens / shape[1], s.tp, s.pp, s.ep,
                                         alloc.ep_span, s.etp)
                # the stages are equal but the last (the head): two sums, not one per stage
                body = sum(per_task[t.name][0] for t in tasks) if s.pp > 1 else 0.0
                shapes[shape] = per_task, [body] * (s.pp - 1) + [sum(per_task[t.name][-1] for t in tasks)]
            per_task, stage = shapes[shape]
            clock = now
            for p in range(s.pp):
                if record_spans:
                    offset = clock
                    for t in tasks:
                        dt = per_task[t.name][p]
                        spans.append(Span(alloc.stage_devices(k, p), t.name, "forward", offset, offset + dt))
                        offset += dt
                clock += stage[p]
            done = max(clock, last_done[k] + max(stage))  # behind the previous micro-batch in the pipeline
            last_done[k] = done
            for t in tasks:
                end[t.name] = max(end[t.name], done)
            heapq.heappush(events, (now + max(stage), k, 2))
    return StreamingResult(spans, end)
