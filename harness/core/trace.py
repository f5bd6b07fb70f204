"""StepTrace: what a backend reports for one executed PPO iteration (docs/DESIGN.md section 2).

Both backends emit the same structure, so every metric means the same thing simulated and real:

- :class:`Span` on a set of devices (a tensor-parallel group, or every replica of a pipeline stage,
  doing the same work at the same time): which task, what kind of work, start/end in seconds from
  the start of the iteration, and FLOPs/bytes per device where known. Grouping keeps traces of
  256-GPU clusters small; every metric is still computed per device;
- :class:`SampleRecord` per generated sample: prompt and response length, when it finished, and the
  weights versions that generated it (staleness: ``harness.core.metrics``);
- :class:`PipelineRun` per executed training pipeline (one per mini-batch and training stage):
  its makespan, ranks and compute time, from which the bubble fraction is computed;
- ``counters``: named scalars a backend measured (e.g. migrated samples), keyed by metric name;
- ``memory_gb``: peak memory per device;
- ``extra``: anything else a backend reports. ``extra[PARAM_DIGEST]`` (``param_digest``), from a
  backend that holds real weights, is ``{model: digest}`` of each trained model's full weights after
  the iteration (:func:`harness.real.digest.weights_digest`: ``num_params``, ``sum``, ``l2``,
  ``update_l2``, ``sha256``); the runner writes the last iteration's to ``summary.json`` as
  ``final_weights``. ``extra[UNITS]`` (``units``), from every backend, is the scheduler's
  record of the iteration (:meth:`harness.planning.scheduler.UnitQueue.record`), which the runner
  writes to ``units.jsonl``.

``to_chrome_trace`` writes the Chrome trace-event format, which Perfetto opens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Span kinds that occupy the device's compute units (counted as busy).
COMPUTE_SPAN_KINDS = frozenset({"prefill", "decode", "forward", "backward", "optimizer"})
# Span kinds that move bytes (links busy, compute idle unless overlapped).
COMM_SPAN_KINDS = frozenset({"allreduce", "allgather", "reduce_scatter", "p2p", "realloc", "param_sync",
                             "load", "offload", "migrate"})


@dataclass(slots=True)
class Span:
    devices: tuple[int, ...]
    task: str
    kind: str
    start_s: float
    end_s: float
    flops: float = 0.0
    bytes: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(slots=True)
class SampleRecord:
    sample_id: int
    prompt_len: int
    response_len: int
    finish_s: float  # when its last token was produced, from iteration start
    # the weights version (number of policy updates before it) that produced the sample's first and
    # last token; None: the version the iteration trains (an on-policy sample, staleness 0).
    # Off-policy execution sets them (harness.planning.iterations); they differ where generation
    # was interrupted and continued under newer weights
    first_version: int | None = None
    last_version: int | None = None


@dataclass(slots=True)
class PipelineRun:
    task: str  # training task name, or "+"-joined names for a fused stage
    start_s: float
    makespan_s: float
    num_ranks: int
    compute_s: float  # sum over ranks of forward/backward time
    peak_activation_gb: float

PARAM_DIGEST = "param_digest"  # StepTrace.extra key: {model: digest of its full weights after the iteration}
UNITS = "units"  # StepTrace.extra key: the scheduler's record of what ran when (UnitQueue.record)


@dataclass
class StepTrace:
    iteration: int
    num_devices: int
    spans: list[Span] = field(default_factory=list)
    samples: list[SampleRecord] = field(default_factory=list)
    pipelines: list[PipelineRun] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    memory_gb: dict[int, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. RL metrics from a real backend

    @property
    def makespan_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    def task_window(self, task: str) -> tuple[float, float] | None:
        spans = [s for s in self.spans if s.task == task]
        if not spans:
            return None
        return min(s.start_s for s in spans), max(s.end_s for s in spans)

    def tasks(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.spans:
            seen.setdefault(s.task, None)
        return list(seen)

    def to_chrome_trace(self, time_offset_s: float = 0.0, devices: set[int] | None = None) -> list[dict[str, Any]]:
        """Trace events: one process per device, one thread per task; ``ts``/``dur`` in microseconds.
        ``devices`` restricts the events to those devices (None = all)."""
        shown = set(range(self.num_devices)) if devices is None else devices
        events: list[dict[str, Any]] = []
        for dev in sorted(shown):
            events.append({"name": "process_name", "ph": "M", "pid": dev, "args": {"name": f"device {dev}"}})
        tids: dict[str, int] = {}
        for s in self.spans:
            tid = tids.setdefault(s.task, len(tids))
            for dev in s.devices:
                if dev in shown:
                    events.append({
                        "name": f"{s.task}:{s.kind}", "cat": s.kind, "ph": "X", "pid": dev, "tid": tid,
                        "ts": (s.start_s + time_offset_s) * 1e6, "dur": max(s.duration_s, 0.0) * 1e6,
                        "args": {"flops": s.flops, "bytes": s.bytes},
                    })
        for dev in sorted(shown):
            for task, tid in tids.items():
                events.append({"name": "thread_name", "ph": "M", "pid": dev, "tid": tid, "args": {"name": task}})
        return events


MAX_TRACE_DEVICES = 64


def trace_devices(num_devices: int, gpus_per_node: int) -> set[int] | None:
    """Devices shown in trace.json: all of them up to MAX_TRACE_DEVICES; beyond that the first
    node's devices and the first device of every other node (the StepTrace keeps all)."""
    if num_devices <= MAX_TRACE_DEVICES:
        return None
    return set(range(min(gpus_per_node, num_devices))) | set(range(0, num_devices, gpus_per_node))


def write_chrome_trace(traces: list[StepTrace], path: str, devices: set[int] | None = None) -> None:
    """Concatenate iterations on one time axis and write ``{"traceEvents": [...]}``."""
    events: list[dict[str, Any]] = []
    offset = 0.0
    for tr in traces:
        events.extend(tr.to_chrome_trace(offset, devices))
        offset += tr.makespan_s
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
