"""Lower bound on the makespan of any fused pipeline schedule (RLHFuse, NSDI'25, arXiv 2409.13221,
section 5: the paper reports how close its annealed schedules get to a lower bound).

This module owns the bound and the explanation of each term. All terms hold for *every* valid
schedule of the given pipes under ``harness.schedule.simulate``'s timing rules (a rank runs one
action at a time; ``F(s, m)`` after ``F(s-1, m)``; ``B(s, m)`` after ``F(s, m)`` and
``B(s+1, m)``; ``p2p`` added on edges between different ranks). Notation for one pipe with
stages ``0..S-1`` and ``M`` micro-batches: ``F_s``, ``B_s`` per-micro-batch times, ``c_s`` the
number of rank changes among the edges of stages ``0..s`` (times ``p2p``).

- ``head(p, s) = sum_{k<s} F_k + c_s * p2p``: no action of stage ``s`` can start earlier, because
  ``F(s, m)`` needs the forward of ``m`` through every earlier stage, and ``B(s, m)`` needs ``F(s, m)``.
- ``tail(p, s) = sum_{k<s} B_k + c_s * p2p``: after any ``B(s, m)`` ends, the backwards of ``m`` on
  stages ``s-1..0`` must still run one after the other, so the schedule lasts at least that long.

Terms (the bound is their maximum):

(a) ``model``: per pipe and stage, ``head(p, s) + M * (F_s + B_s) + tail(p, s)``: the stage's own
    work fits between its earliest possible start and its latest possible end. For uniform costs
    and ``p2p = 0`` the largest is the last stage's, ``(M + S - 1) * (F + B)``, which is the makespan
    of that model's own 1F1B. (Simulating each model's 1F1B alone would be the same number for
    uniform costs, but for uneven stages 1F1B is not always optimal, so it would not be a bound.)
(b) ``average``: total work / number of ranks: ranks only run one action at a time.
(c) ``rank_work``: the largest per-rank work.
(d) ``rank_window``: per rank, ``min head + work + min tail`` over the (pipe, stage) pairs on that
    rank: the rank's first action cannot start before the smallest head, and its last action is a
    backward of some pair whose tail follows it (a min over the pairs the last action may belong
    to). This is what makes the fused bound exceed (c): a middle rank of a bidirectional pipeline
    waits for the first activations to arrive from both ends and must leave time for the
    gradients to drain to both ends.

**Peak memory** (:func:`peak_lower_bound`): the simulator allocates a micro-batch's activation of
stage ``s`` when ``F(s, m)`` starts and frees it when ``B(s, m)`` ends, so a rank holds it for at
least ``F_s + gap(p, s) + B_s``, with ``gap(p, s) = sum_{k>s} (F_k + B_k) + 2 * hops`` between
them (the forward must reach the last stage and the gradient come back, ``hops`` the rank changes
on the way). A rank's actions never overlap, so its memory at any instant is one of the running
sums whose maximum is its peak; averaged over the part of ``[0, T]`` in which it can hold
anything (after its earliest forward can start, before its last backward's ``tail``), it is at
most the peak: ``peak >= sum_{(p, s) on the rank} M * act_s * (F_s + gap(p, s) + B_s) / window``,
and ``peak >= act_s`` of every stage it runs. The largest over ranks holds for every schedule no
longer than ``T``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from harness.schedule import PipeCosts, PipeSpec


@dataclass(frozen=True)
class LowerBound:
    value: float
    model: float        # (a)
    average: float      # (b)
    rank_work: float    # (c)
    rank_window: float  # (d)
    per_model: dict[str, float]
    per_rank_window: dict[int, float]

    def terms(self) -> dict[str, float]:
        return {"model": self.model, "average": self.average, "rank_work": self.rank_work,
                "rank_window": self.rank_window}


def head_tail(pipe: PipeSpec, cost: PipeCosts) -> tuple[list[float], list[float]]:
    """Per-stage ``head`` and ``tail`` (see the module docstring)."""
    heads, tails = [0.0], [0.0]
    for s in range(1, pipe.num_stages):
        hop = cost.p2p if pipe.stage_to_rank[s] != pipe.stage_to_rank[s - 1] else 0.0
        heads.append(heads[-1] + cost.fwd[s - 1] + hop)
        tails.append(tails[-1] + cost.bwd[s - 1] + hop)
    return heads, tails


def lower_bound_terms(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts]) -> LowerBound:
    """All four terms and their maximum (see the module docstring)."""
    per_model: dict[str, float] = {}
    work: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for name, pipe in pipes.items():
        cost = costs[name]
        heads, tails = head_tail(pipe, cost)
        M = pipe.num_mbs
        for s, rank in enumerate(pipe.stage_to_rank):
            stage_work = M * (cost.fwd[s] + cost.bwd[s])
            window = heads[s] + stage_work + tails[s]
            per_model[pipe.model] = max(per_model.get(pipe.model, 0.0), window)
            work[rank] = work.get(rank, 0.0) + stage_work
            first[rank] = min(first.get(rank, heads[s]), heads[s])
            last[rank] = min(last.get(rank, tails[s]), tails[s])
    if not work:
        return LowerBound(0.0, 0.0, 0.0, 0.0, 0.0, {}, {})
    per_rank_window = {r: first[r] + work[r] + last[r] for r in sorted(work)}
    model = max(per_model.values())
    average = sum(work.values()) / len(work)
    rank_work = max(work.values())
    rank_window = max(per_rank_window.values())
    return LowerBound(max(model, average, rank_work, rank_window), model, average, rank_work,
                      rank_window, per_model, per_rank_window)


def lower_bound(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts]) -> float:
    """A makespan no valid schedule of ``pipes`` under ``costs`` can beat."""
    return lower_bound_terms(pipes, costs).value


def peak_lower_bound(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts], makespan: float) -> float:
    """A peak activation memory below which no valid schedule of ``pipes`` lasting at most
    ``makespan`` can stay (module docstring, "Peak memory")."""
    held: dict[int, float] = {}   # per rank: the least memory x time it must hold
    opens: dict[int, float] = {}  # per rank: the earliest a forward of it can start
    closes: dict[int, float] = {}  # per rank: the least time after its last backward
    single: dict[int, float] = {}
    for name, pipe in pipes.items():
        cost = costs[name]
        heads, tails = head_tail(pipe, cost)
        ranks = pipe.stage_to_rank
        gap = 0.0
        for s in range(pipe.num_stages - 1, -1, -1):
            rank = ranks[s]
            held[rank] = held.get(rank, 0.0) + pipe.num_mbs * cost.activation[s] * (cost.fwd[s] + gap + cost.bwd[s])
            opens[rank] = min(opens.get(rank, math.inf), heads[s])
            closes[rank] = min(closes.get(rank, math.inf), tails[s])
            single[rank] = max(single.get(rank, 0.0), cost.activation[s])
            if s > 0:
                gap += cost.fwd[s] + cost.bwd[s] + (2.0 * cost.p2p if ranks[s] != ranks[s - 1] else 0.0)
    out = 0.0
    for rank, area in held.items():
        window = makespan - opens[rank] - closes[rank]
        out = max(out, single[rank], area / window if window > 0 else 0.0)
    return out
