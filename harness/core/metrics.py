"""Metrics from StepTraces (docs/DESIGN.md section 7). Keys follow verl's where one exists.

Every key is built here and documented once; nothing else in the project spells a metric key.

Per iteration (``iteration_metrics``):

- ``timing_s/step``: iteration makespan (first span start is 0 by construction).
- ``timing_s/<task>``: wall time from a task's first span start to its last span end, for ``gen``,
  ``ref``, ``reward``, ``values``, ``update_actor``, ``update_critic``, ``param_sync``; every
  ``realloc*`` task adds into ``timing_s/realloc``; ``timing_s/train`` spans all train tasks;
  ``timing_s/gen_inference`` spans generation and the three inference tasks together (with
  inter-stage fusion they overlap, so this is the number fusion shortens).
- ``overlap_s/<task>/<other>``: for two of those tasks (``<task>`` the earlier in
  :data:`TIMED_TASKS`) whose windows (first span start to last span end) intersect, the length of
  the intersection: the tasks ran at the same time, so their ``timing_s`` are spans of overlapped
  work and add up to more than the time they took together (RLHFuse's ref, reward and values
  streaming beside generation; tasks on disjoint devices at once). Absent for tasks one after
  another (an intersection within float rounding, 1e-9 of the step, is none).
- ``perf/samples_per_s``: samples in the batch / step time. ``perf/throughput``: tokens (prompt +
  response) / step time / number of devices (verl's tokens/s/GPU). ``perf/total_num_tokens``.
- ``perf/mfu/actor``, ``perf/mfu/critic``: training FLOPs / (train-task wall time x its devices x
  peak FLOP/s). ``perf/max_memory_gb``: largest per-device memory peak the backend reported.
- ``perf/driver_calls`` (``backend=ray``): calls the driver made to its workers in the iteration
  (one call reaches every device of a task; streamed generation makes one per round).
- ``gen/tail_s``: time from when 90% of samples have finished to when the last one finishes.
  ``gen/migrated_samples``, ``gen/tail_instances``, ``gen/migration_threshold_frac`` (R_t as a
  fraction of the batch): reported by backends that execute a migration policy (counters).
  ``gen/verify_tail_s``: with a rule-based reward (``algo.reward=rule``), time from the end of
  generation to the last response scored by the verifier on the driver's CPUs (a counter).
- ``pipeline/bubble_frac/<task>`` = 1 - (sum of forward/backward time over the pipeline's ranks)
  / (ranks x makespan), over all of the task's pipeline runs in the iteration (RLHFuse section 7's
  definition); ``pipeline/makespan_s/<task>`` (sum over mini-batches); ``pipeline/peak_activation_gb/<task>``.
- ``util/gpu_busy_frac/{mean,min}``: per device, time covered by compute spans / step time (on
  ``backend=ray`` a span is a task running on the worker, not kernel occupancy: docs/GPU.md).
- ``response_length/{mean,p50,p99,max}`` in tokens; ``training/global_step``.

Across iterations (``summarize``): warm-up iterations are dropped; ``perf/samples_per_s`` and
``perf/throughput`` are total work / total time of the measured iterations (so a slow iteration
weighs by its duration, as a wall clock would); every other key is the mean.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable

import numpy as np

from harness.core.trace import COMPUTE_SPAN_KINDS, StepTrace

STEP_TIME = "timing_s/step"
TRAIN_TIME = "timing_s/train"
GEN_INFERENCE_TIME = "timing_s/gen_inference"
PLAN_TIME = "timing_s/plan"
REALLOC_TIME = "timing_s/realloc"
SAMPLES_PER_S = "perf/samples_per_s"
THROUGHPUT = "perf/throughput"
TOTAL_NUM_TOKENS = "perf/total_num_tokens"
MAX_MEMORY_GB = "perf/max_memory_gb"
DRIVER_CALLS = "perf/driver_calls"
GEN_TAIL_S = "gen/tail_s"
MIGRATED_SAMPLES = "gen/migrated_samples"
VERIFY_TAIL = "gen/verify_tail_s"
GEN_ROUNDS = "gen/rounds"  # dynamic sampling: generation rounds this iteration
GENERATED_SAMPLES = "gen/generated_samples"  # dynamic sampling: samples generated (trained: fewer)
MIXED_GROUP_FRAC = "gen/mixed_group_frac"  # dynamic sampling: generated groups whose responses scored unalike
TAIL_INSTANCES = "gen/tail_instances"
MIGRATION_THRESHOLD_FRAC = "gen/migration_threshold_frac"
BUSY_MEAN = "util/gpu_busy_frac/mean"
BUSY_MIN = "util/gpu_busy_frac/min"
GLOBAL_STEP = "training/global_step"
TIMED_TASKS = ("gen", "logprobs", "ref", "reward", "values", "update_actor", "update_critic", "param_sync")
TRAIN_TASKS = ("update_actor", "update_critic")

# <section>/<name>[/<sub>]: lowercase words, digits and underscores.
KEY_GRAMMAR = re.compile(
    r"^(timing_s|overlap_s|perf|gen|pipeline|util|response_length|training|rl)/[a-z0-9_]+(/[a-z0-9_+]+)?$")


def timing_key(task: str) -> str:
    return f"timing_s/{task}"


def overlap_key(task: str, other: str) -> str:
    """The key of the overlap of two timed tasks' windows, whichever order they are named in."""
    first, second = sorted((task, other), key=TIMED_TASKS.index)
    return f"overlap_s/{first}/{second}"


def mfu_key(model: str) -> str:
    return f"perf/mfu/{model}"


def bubble_key(task: str) -> str:
    return f"pipeline/bubble_frac/{task}"


def pipeline_makespan_key(task: str) -> str:
    return f"pipeline/makespan_s/{task}"


def peak_activation_key(task: str) -> str:
    return f"pipeline/peak_activation_gb/{task}"


def response_length_key(stat: str) -> str:
    return f"response_length/{stat}"


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _union_length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in _merge(intervals))


def _timing(trace: StepTrace) -> dict[str, float]:
    out: dict[str, float] = {STEP_TIME: trace.makespan_s}
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    for s in trace.spans:
        starts[s.task] = min(starts.get(s.task, s.start_s), s.start_s)
        ends[s.task] = max(ends.get(s.task, s.end_s), s.end_s)
    realloc = 0.0
    for task in starts:
        if task in TIMED_TASKS:
            out[timing_key(task)] = ends[task] - starts[task]
        elif task.startswith("realloc"):
            realloc += ends[task] - starts[task]
    if any(t.startswith("realloc") for t in starts):
        out[REALLOC_TIME] = realloc
    gen_inf = [t for t in ("gen", "logprobs", "ref", "reward", "values") if t in starts]
    if "gen" in starts:
        out[GEN_INFERENCE_TIME] = max(ends[t] for t in gen_inf) - min(starts[t] for t in gen_inf)
    train = [t for t in TRAIN_TASKS if t in starts]
    if train:
        out[TRAIN_TIME] = max(ends[t] for t in train) - min(starts[t] for t in train)
    timed = [t for t in TIMED_TASKS if t in starts]
    rounding_s = 1e-9 * trace.makespan_s  # one task starting where another ends, up to float rounding
    for i, task in enumerate(timed):
        for other in timed[i + 1:]:
            overlap = min(ends[task], ends[other]) - max(starts[task], starts[other])
            if overlap > rounding_s:
                out[overlap_key(task, other)] = overlap
    return out


def _utilisation(trace: StepTrace) -> dict[str, float]:
    by_group: dict[tuple[int, ...], list[tuple[float, float]]] = defaultdict(list)
    for s in trace.spans:
        if s.kind in COMPUTE_SPAN_KINDS:
            by_group[s.devices].append((s.start_s, s.end_s))
    per_device: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for devices, intervals in by_group.items():  # merge per group first: groups repeat thousands of times
        merged = _merge(intervals)
        for d in devices:
            per_device[d].extend(merged)
    step = trace.makespan_s
    if step <= 0:
        return {}
    busy = np.array([_union_length(per_device.get(d, [])) / step for d in range(trace.num_devices)])
    return {BUSY_MEAN: float(busy.mean()), BUSY_MIN: float(busy.min())}


def _pipelines(trace: StepTrace) -> dict[str, float]:
    runs_by_task: dict[str, list] = defaultdict(list)
    for run in trace.pipelines:
        runs_by_task[run.task].append(run)
    out: dict[str, float] = {}
    for task, runs in runs_by_task.items():
        capacity = sum(r.num_ranks * r.makespan_s for r in runs)
        out[bubble_key(task)] = 1.0 - sum(r.compute_s for r in runs) / capacity if capacity > 0 else 0.0
        out[pipeline_makespan_key(task)] = sum(r.makespan_s for r in runs)
        out[peak_activation_key(task)] = max(r.peak_activation_gb for r in runs)
    return out


def _samples(trace: StepTrace, total_num_tokens: int) -> dict[str, float]:
    out: dict[str, float] = {}
    step = trace.makespan_s
    if trace.samples:
        lengths = np.array([s.response_len for s in trace.samples])
        finish = np.sort(np.array([s.finish_s for s in trace.samples]))
        out[response_length_key("mean")] = float(lengths.mean())
        out[response_length_key("p50")] = float(np.percentile(lengths, 50))
        out[response_length_key("p99")] = float(np.percentile(lengths, 99))
        out[response_length_key("max")] = float(lengths.max())
        p90_index = int(np.ceil(0.9 * len(finish))) - 1
        out[GEN_TAIL_S] = float(finish[-1] - finish[p90_index])
    if step > 0:
        out[SAMPLES_PER_S] = len(trace.samples) / step
        out[THROUGHPUT] = total_num_tokens / step / trace.num_devices
    out[TOTAL_NUM_TOKENS] = float(total_num_tokens)
    return out


def _mfu(trace: StepTrace, task_models: dict[str, str], peak_flops_per_device: float) -> dict[str, float]:
    flops: dict[str, float] = defaultdict(float)
    devices: dict[str, set[int]] = defaultdict(set)
    for s in trace.spans:
        if s.task in TRAIN_TASKS:
            flops[s.task] += s.flops * len(s.devices)
            devices[s.task].update(s.devices)
    out: dict[str, float] = {}
    for task, total in flops.items():
        window = trace.task_window(task)
        wall = window[1] - window[0]
        if wall > 0 and total > 0:
            out[mfu_key(task_models.get(task, task))] = total / (wall * len(devices[task]) * peak_flops_per_device)
    return out


def iteration_metrics(trace: StepTrace, total_num_tokens: int, task_models: dict[str, str],
                      peak_flops_per_device: float) -> dict[str, float]:
    """All per-iteration metrics of one StepTrace."""
    metrics: dict[str, float] = {}
    metrics.update(_timing(trace))
    metrics.update(_samples(trace, total_num_tokens))
    metrics.update(_utilisation(trace))
    metrics.update(_pipelines(trace))
    metrics.update(_mfu(trace, task_models, peak_flops_per_device))
    if trace.memory_gb:
        metrics[MAX_MEMORY_GB] = max(trace.memory_gb.values())
    for key, value in trace.counters.items():
        metrics[key] = float(value)
    metrics[GLOBAL_STEP] = float(trace.iteration + 1)
    bad = [k for k in metrics if not KEY_GRAMMAR.match(k)]
    if bad:
        raise ValueError(f"metric keys {bad} do not follow the key grammar {KEY_GRAMMAR.pattern}")
    return metrics


def summarize(per_iteration: Iterable[dict[str, float]], num_warmup: int) -> dict[str, float]:
    rows = list(per_iteration)
    measured = rows[num_warmup:] if len(rows) > num_warmup else rows[-1:]
    keys = sorted({k for r in measured for k in r})
    summary = {k: float(np.mean([r[k] for r in measured if k in r])) for k in keys}
    total_time = sum(r[STEP_TIME] for r in measured)
    if total_time > 0:
        num_samples = sum(r[SAMPLES_PER_S] * r[STEP_TIME] for r in measured)
        summary[SAMPLES_PER_S] = num_samples / total_time
        tokens = sum(r[THROUGHPUT] * r[STEP_TIME] for r in measured)
        summary[THROUGHPUT] = tokens / total_time
    summary[GLOBAL_STEP] = float(len(rows))
    return summary
