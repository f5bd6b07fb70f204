"""Sample-level streaming of generation output into inference (RLHFuse section 4, inter-stage fusion).

With ``GenerationPolicy.stream_to_inference`` the inference tasks (``ref``, ``reward``, ``values``)
do not wait for the whole batch: they consume samples as generation finishes them, on every
inference replica whose devices generation has released (instances freed by the long-tail
migration release theirs early; the rest at the end of generation).

Model (all three inference tasks share one allocation in a fused plan):

- a replica becomes available when all its devices are free, then first loads what it needs:
  the critic's weights resharded from the training layout (``realloc`` bytes over the links);
  ref and reward weights are resident (their memory is counted by the memory check);
- it then repeatedly takes up to ``micro_batch_size`` finished samples (waiting for the next
  finish when none is ready) and runs ref, reward and critic forward passes on them; with pp
  stages a micro-batch costs the sum of its stage times when the pipeline is empty and the
  slowest stage's time when it follows another micro-batch (steady-state pipelining);
- samples are taken in finish order by whichever replica is free first (work-conserving).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from harness.costmodel import CostModel
from harness.plan import Task, WeightMovement
from harness.realloc import reallocation_transfers
from harness.trace import SampleRecord, Span


@dataclass
class StreamingResult:
    spans: list[Span]
    end_s: dict[str, float]  # per inference task


def _load_s(cm: CostModel, move: WeightMovement | None, model, devices: tuple[int, ...]) -> float:
    """Time for a replica to fetch its share of moved weights (slowest of its devices)."""
    if move is None:
        return 0.0
    layer_bytes = cm.weights_gb(model, 1, 1) * 1e9 / model.num_layers
    transfers = reallocation_transfers(move.source, move.target, model.num_layers, layer_bytes, cm.gpus_per_node)
    wanted = set(devices)
    worst = 0.0
    for tr in transfers:
        if tr.device in wanted and tr.bytes > 0:
            link = cm.intra_node if tr.intra_node else cm.inter_node
            worst = max(worst, link.latency_us * 1e-6 + tr.bytes / (link.bandwidth_gbps * 1e9 * link.efficiency_frac))
    return worst


def simulate_streaming_inference(cm: CostModel, tasks: list[Task], models: dict[str, object],
                                 samples: list[SampleRecord], device_free_s: dict[int, float],
                                 micro_batch_size: int, moves: dict[str, WeightMovement]) -> StreamingResult:
    alloc = tasks[0].allocation
    s = alloc.strategy
    order = sorted(samples, key=lambda r: (r.finish_s, r.sample_id))
    ready_s = [r.finish_s for r in order]
    lengths = np.array([r.prompt_len + r.response_len for r in order], dtype=float)
    spans: list[Span] = []
    heap: list[tuple[float, int]] = []
    pipeline_free = {}
    for k in range(s.dp):
        devices = alloc.replica_devices(k)
        start = max(device_free_s.get(d, 0.0) for d in devices)
        load = sum(_load_s(cm, moves.get(t.name), models[t.model], devices) for t in tasks)
        if load > 0:
            spans.append(Span(devices, "values", "realloc", start, start + load))
        heapq.heappush(heap, (start + load, k))
        pipeline_free[k] = -1.0
    end = {t.name: 0.0 for t in tasks}
    next_sample = 0
    while next_sample < len(order):
        free_at, k = heapq.heappop(heap)
        t0 = max(free_at, ready_s[next_sample])
        take = next_sample
        while take < len(order) and take - next_sample < micro_batch_size and ready_s[take] <= t0:
            take += 1
        tokens = float(lengths[next_sample:take].sum())
        seq = tokens / (take - next_sample)
        next_sample = take
        now = t0
        for task in tasks:
            model = models[task.model]
            stage = [cm.forward_s(model, tokens, seq, s.tp, model.num_layers / s.pp, include_head=p == s.pp - 1)
                     for p in range(s.pp)]
            busy = max(stage) if pipeline_free[k] >= now else sum(stage)
            for p in range(s.pp):
                spans.append(Span(alloc.stage_devices(k, p), task.name, "forward", now, now + stage[p]))
            now += busy
            end[task.name] = max(end[task.name], now)
        pipeline_free[k] = now
        heapq.heappush(heap, (now, k))
    return StreamingResult(spans, end)
