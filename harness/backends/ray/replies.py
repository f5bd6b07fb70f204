"""What the device workers of ``backend=ray`` answer: one :class:`Result` per device per request
(:mod:`harness.backends.ray.protocol`), carrying the worker's spans, its memory peaks and the
method's output, a frozen dataclass of its own per worker method:

=================  ==========================================================================
request            output (on the device that reports for its replica; None on the others)
=================  ==========================================================================
``Generate``       :class:`Generated`: the finished samples of the dp replica
``Infer``          :class:`Inferred`: the rows this replica computed and their outputs
``Train``          :class:`Trained` on every device: per model role, spans, pipeline runs, and
                   PPO statistics (:class:`PpoStats`) on the device that computes the loss
``Move``           :class:`Moved` on every device: bytes it received
``State``          :class:`StatePiece`: the device's piece of the weights (dp replica 0)
``Release``        :class:`Released` on every device: bytes freed
``OpenSession``,   :class:`SessionProgress` on every device (its ``finished`` only on tp rank 0)
``Steps``
``Export``         :class:`Exported` on every device (its ``samples`` only on tp rank 0)
``Migrate``,       None
``CloseSession``
=================  ==========================================================================

Times are the worker's ``time.time()``: the driver subtracts its iteration's start.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Optional, TypeVar

import numpy as np

from harness.backends.ray.protocol import ExportedSample

SpanT = tuple[str, float, float, float, float]  # (kind, start, end, flops, bytes) on the worker's clock
OutT = TypeVar("OutT")


@dataclass(frozen=True)
class MemoryPeaks:
    """A worker's memory peaks since it started, in GB: the device's (the CUDA allocator's peak, or
    the process's peak resident set on CPU, which includes the Python/torch runtime) and the largest
    model state it held at once, counted from its tensors (parameters materialised on the device,
    float32 master weights and Adam states; native ZeRO-3's gathered parameters included)."""
    peak_gb: float = 0.0
    model_state_gb: float = 0.0
    on_cuda: bool = False

    def named(self) -> tuple[tuple[str, float], ...]:
        """The peaks under the names the trace counts them by (``perf/<name>/dev<rank>``)."""
        return (("peak_allocated_gb" if self.on_cuda else "peak_rss_gb", self.peak_gb),
                ("model_state_gb", self.model_state_gb))


@dataclass(frozen=True)
class Result(Generic[OutT]):
    """A worker's answer to one request: its rank, its spans, the method's output, its memory peaks."""
    rank: int
    spans: list
    out: Optional[OutT]
    memory: MemoryPeaks = field(default_factory=MemoryPeaks)

    @property
    def memory_gb(self) -> float:
        return self.memory.peak_gb


@dataclass(frozen=True)
class FinishedSample:
    """A generated sample: its response tokens and their log-probs, and when it finished."""
    sample_id: int
    tokens: list
    logprobs: list
    finish_time_s: float


@dataclass(frozen=True)
class Generated:
    samples: list[FinishedSample]


@dataclass(frozen=True)
class Inferred:
    """``values[i]`` is the output for sample ``rows[i]`` of the request's rows: a score, or one
    value per action position (log-probs, values)."""
    rows: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class PpoStats:
    """One model's loss statistics summed over the micro-batches of every mini-batch, each
    micro-batch's already divided by its mini-batch's token count (``approx_kl``: the actor only)."""
    loss: float
    clipfrac: float
    approx_kl: Optional[float] = None


@dataclass(frozen=True)
class ModelTrained:
    """One model's share of a training stage on one device: its spans, ``runs`` (the start and end of
    its part of each mini-batch's pipeline schedule) and its loss statistics where it computes the
    loss (None elsewhere)."""
    spans: list
    runs: list[tuple[float, float]]
    stats: Optional[PpoStats] = None


@dataclass(frozen=True)
class Trained:
    models: dict[str, ModelTrained]  # by model role: the models this device trains in the stage


@dataclass(frozen=True)
class Moved:
    received_bytes: float


@dataclass(frozen=True)
class StatePiece:
    """One device's piece of a model's weights: its (dp, pp, tp) coordinate and its tensors by name."""
    coord: tuple[int, int, int]
    state: dict[str, np.ndarray]


@dataclass(frozen=True)
class Released:
    freed_bytes: int


@dataclass(frozen=True)
class SessionProgress:
    """A generation session after opening or advancing: the samples that finished, how many are
    left, how many engine steps until the next one finishes (1 when not known in advance), and the
    engine steps run so far (steps with samples to generate)."""
    finished: list[FinishedSample]
    left: int
    next_finish: int
    engine_steps: int = 0


@dataclass(frozen=True)
class Exported:
    """The unfinished samples taken out of a session (``samples``: on tp rank 0 only) and this
    device's KV shard shapes per sample, per layer."""
    samples: Optional[list[ExportedSample]]
    kv_shapes: dict[int, dict[int, list]]
