"""Fused actor+critic pipeline layouts and the serial baseline (RLHFuse, NSDI'25, arXiv 2409.13221,
section 5, "intra-stage fusion").

This module owns *where* the pipes of a fused training stage live and what one micro-batch costs
on each of their stages; it knows nothing about ordering beyond the serial baseline.

Layout (paper section 5): model 1 has ``N1`` pipeline stages, model 2 has ``N2``. The fused stage
uses ``N = lcm(N1, N2)`` ranks and runs ``K1 = N / N1`` pipes of model 1 and ``K2 = N / N2`` pipes
of model 2, in opposite directions so that the fill/drain bubbles of one model are filled by the
other:

- model-1 pipe ``k`` places stage ``s`` on rank ``k * N1 + s`` (left to right);
- model-2 pipe ``j`` places stage ``s`` on rank ``N - 1 - (j * N2 + s)`` (right to left).

Every rank therefore holds exactly one stage of model 1 and one of model 2. Pipe names are letters
only (the IR prints ``A2F0``): model 1 pipes are ``A`` (one pipe) or ``Aa``, ``Ab``, ... and model 2
pipes ``C`` or ``Ca``, ``Cb``, ... Each pipe has its own micro-batches (``M1`` per model-1 pipe,
``M2`` per model-2 pipe).

:func:`serial_schedule` is the "serial 1F1B" baseline of the paper: on every rank, the 1F1B lists
of the model-1 pipes followed by those of the model-2 pipes (model 1 trains, then model 2).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import lcm

from harness.schedule import PipeCosts, PipeSpec, Schedule, merge_sequential, one_f_one_b

MODEL1_PREFIX = "A"
MODEL2_PREFIX = "C"

Number = float | int
PerStage = Number | Sequence[Number]


def _letters(index: int) -> str:
    """0 -> 'a', 25 -> 'z', 26 -> 'aa', ... (bijective base 26, letters only)."""
    out = ""
    index += 1
    while index > 0:
        index, rem = divmod(index - 1, 26)
        out = chr(ord("a") + rem) + out
    return out


def pipe_names(prefix: str, count: int) -> list[str]:
    """``[prefix]`` for one pipe, else ``prefix + 'a'``, ``prefix + 'b'``, ..."""
    return [prefix] if count == 1 else [prefix + _letters(i) for i in range(count)]


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def fused_pipes(n1: int, n2: int, m1: int, m2: int, model1: str = "actor",
                model2: str = "critic") -> dict[str, PipeSpec]:
    """The fused layout: ``K1`` model-1 pipes left to right and ``K2`` model-2 pipes right to left
    over ``lcm(n1, n2)`` ranks. Model-1 pipes come first in the returned dict."""
    n1, n2 = _positive_int("n1 (model-1 stages)", n1), _positive_int("n2 (model-2 stages)", n2)
    m1 = _positive_int("m1 (model-1 micro-batches)", m1)
    m2 = _positive_int("m2 (model-2 micro-batches)", m2)
    if not model1 or not model2 or model1 == model2:
        raise ValueError(f"the two models need distinct non-empty labels, got {model1!r}, {model2!r}")
    num_ranks = lcm(n1, n2)
    pipes: dict[str, PipeSpec] = {}
    for k, name in enumerate(pipe_names(MODEL1_PREFIX, num_ranks // n1)):
        pipes[name] = PipeSpec(name, n1, m1, tuple(k * n1 + s for s in range(n1)), model1)
    for j, name in enumerate(pipe_names(MODEL2_PREFIX, num_ranks // n2)):
        pipes[name] = PipeSpec(name, n2, m2, tuple(num_ranks - 1 - (j * n2 + s) for s in range(n2)), model2)
    return pipes


def model_labels(pipes: Mapping[str, PipeSpec]) -> list[str]:
    """Model labels in order of first appearance: ``[model1, model2]`` for a fused layout."""
    labels: list[str] = []
    for pipe in pipes.values():
        if pipe.model not in labels:
            labels.append(pipe.model)
    return labels


def model_index(pipes: Mapping[str, PipeSpec]) -> dict[str, int]:
    """Pipe name -> 0 for model 1 (the first label seen), 1 for model 2, and so on."""
    labels = model_labels(pipes)
    return {name: labels.index(p.model) for name, p in pipes.items()}


def _per_stage(name: str, value: PerStage, num_stages: int, allow_zero: bool = False) -> tuple[float, ...]:
    values = [value] * num_stages if isinstance(value, (int, float)) else list(value)
    if len(values) != num_stages:
        raise ValueError(f"{name}: expected one value or {num_stages} per-stage values, got {len(values)}")
    out = tuple(float(v) for v in values)
    if any(v < 0 or (v == 0 and not allow_zero) for v in out):
        raise ValueError(f"{name}: values must be {'>= 0' if allow_zero else '> 0'}, got {out}")
    return out


def fused_costs(pipes: Mapping[str, PipeSpec], fwd1: PerStage, fwd2: PerStage,
                bwd1: PerStage | None = None, bwd2: PerStage | None = None,
                mem1: PerStage = 1.0, mem2: PerStage = 1.0, p2p: float = 0.0) -> dict[str, PipeCosts]:
    """Per-pipe costs: every pipe of a model gets that model's per-stage forward / backward time per
    micro-batch and activation memory per in-flight micro-batch. Each of ``fwd*``, ``bwd*``,
    ``mem*`` is one number (uniform stages) or one value per stage. Backward defaults to twice the
    forward. Model 1 is the model of the first pipe in ``pipes``."""
    if p2p < 0:
        raise ValueError(f"p2p must be >= 0, got {p2p}")
    index = model_index(pipes)
    if len(set(index.values())) > 2:
        raise ValueError("fused_costs expects pipes of at most two models")
    costs: dict[str, PipeCosts] = {}
    for name, pipe in pipes.items():
        model = index[name]
        fwd, bwd, mem = (fwd1, bwd1, mem1) if model == 0 else (fwd2, bwd2, mem2)
        label = f"model {model + 1}"
        f = _per_stage(f"{label} forward time", fwd, pipe.num_stages)
        b = tuple(2.0 * x for x in f) if bwd is None else _per_stage(f"{label} backward time", bwd,
                                                                      pipe.num_stages)
        a = _per_stage(f"{label} activation memory", mem, pipe.num_stages, allow_zero=True)
        costs[name] = PipeCosts(f, b, a, float(p2p))
    return costs


def serial_schedule(pipes: Mapping[str, PipeSpec]) -> Schedule:
    """Serial 1F1B baseline: on each rank, every model-1 pipe's 1F1B list, then every model-2
    pipe's (model order = order of first appearance of the labels)."""
    index = model_index(pipes)
    ordered = sorted(pipes.values(), key=lambda p: index[p.name])  # stable: keeps pipe order
    return Schedule(dict(pipes), merge_sequential(*(one_f_one_b(p) for p in ordered)))
