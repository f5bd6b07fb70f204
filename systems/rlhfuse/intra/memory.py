"""Memory phase of the fused-schedule search (RLHFuse, NSDI'25, arXiv 2409.13221, section 5: "we
first minimise the latency, then, with the latency fixed, minimise the peak memory").

This module owns :class:`MemorySearch`: given a target makespan ``T`` (the makespan phase's best),
orders whose makespan is at most ``T`` and whose largest per-rank peak of in-flight activation
memory is as low as possible. It drives the annealing loop (:mod:`systems.rlhfuse.intra.loop`,
objective MEMORY) under a **memory cap of increasing tightness**: the energy is
``makespan_weight`` per mean action time over ``T`` plus the area above the cap (both soft); every
order reached at makespan <= ``T`` with a peak below the best is recorded and the cap drops
``cap_step`` smallest activations below it; moves lower positions over the cap, shorten a critical
path while above ``T``, or are uniform (micro-batches stay first-in first-out). Why each of these:
docs/FUSED_SEARCH.md (phase 2, "The cap step", "The makespan's weight").
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harness.schedule import SimModel
from systems.rlhfuse.intra import config, kernel, loop
from systems.rlhfuse.intra.incremental import OrderState

_EPS = 1e-9
MAX_DRAWS = 256  # proposals drawn per step before the step is counted as an empty one


@dataclass
class MemoryParams:
    t0: float = 2.0         # start temperature (energy units: one activation above the cap)
    t1: float = 0.02        # final temperature
    q_memory: float = 0.5   # share of memory-targeted proposals while some rank is over the cap
    q_critical: float = 0.25  # share of critical-path swaps while the makespan is above target
    q_move: float = 0.8     # share of moves (vs adjacent swaps) among memory-targeted and uniform
    max_shift: int = config.DEFAULT_MEMORY_MOVE_REACH  # longest distance a move carries an action
    cap_step: float = config.DEFAULT_MEMORY_CAP_STEPS[0]  # the cap = best peak - cap_step * smallest activation
    rung_steps: int = 10_000  # cooling from t0 to t1 restarts at every new level (and after this)
    makespan_weight: float = config.DEFAULT_MEMORY_MAKESPAN_WEIGHTS[0]  # energy per mean action time over the target


@dataclass
class MemoryOutcome:
    seqs: list[list[int]] | None  # best order found with makespan <= target (None: none)
    peak: float                   # its peak (inf when none)
    makespan: float
    steps: int
    levels: int                   # how many times the cap was lowered


class MemorySearch:
    """The memory phase (module docstring). One instance per (model, target); :meth:`run` may be
    called several times from different starting orders, sharing the best peak found.
    ``compiled``: run the loop compiled (default: whenever numba is available) or
    interpreted (the same steps; for tests and machines without numba)."""

    def __init__(self, model: SimModel, tails: list[float], target: float, mem_cap: float | None,
                 rng: random.Random, params: MemoryParams | None = None, compiled: bool | None = None):
        self.model, self.tails, self.target, self.mem_cap, self.rng = model, tails, target, mem_cap, rng
        self.p = params or MemoryParams()
        self.compiled = kernel.AVAILABLE if compiled is None else bool(compiled and kernel.AVAILABLE)
        self.unit = min((d for d in model.mem_delta if d > 0), default=1.0)
        self.cls = loop.action_classes(model)
        self.best_peak = self.best_makespan = math.inf
        self.best_seqs: list[list[int]] | None = None
        self.floor = max(max(model.mem_delta, default=0.0), 0.0)
        self.mean_dur = sum(model.dur) / max(model.num_actions, 1) or 1.0
        self.levels_total = 0  # times the best peak was lowered, over all runs
        self.trace: np.ndarray = np.zeros((0, 3))  # give it rows to record (makespan, area, peak) per step

    def run(self, seqs: Sequence[Sequence[int]], steps: int | None, seconds: float | None = None) -> MemoryOutcome:
        """Anneal from ``seqs`` for ``steps`` trial moves and/or ``seconds`` (whichever runs out
        first; at least one must be given), or until the trivial bound is reached."""
        if steps is None and seconds is None:
            raise ValueError("the memory phase needs a step or time budget")
        p, model = self.p, self.model
        rs = np.array([self.rng.randrange(1, m) for m in loop.L_ECUYER], dtype=np.int64)
        params = loop.LoopParams(loop.MEMORY, p.t0, p.t1, max(1, int(p.rung_steps)), MAX_DRAWS, q_memory=p.q_memory,
                                 q_critical=p.q_critical, q_move=p.q_move, max_shift=int(p.max_shift),
                                 cap_step=p.cap_step, accept_tol=_EPS, target=self.target,
                                 time_unit=self.mean_dur / p.makespan_weight, mem_unit=self.unit,
                                 tol=self.target + _EPS * max(1.0, abs(self.target)), floor=self.floor)
        run = loop.Loop(OrderState(model, seqs, self.mem_cap, self.tails), self.cls, params, rs,
                        best_makespan=self.best_makespan, best_peak=self.best_peak, compiled=self.compiled)
        run.run(steps, seconds, self.trace)
        best = run.best_seqs()
        if best is not None:
            self.best_seqs = best
            self.best_peak, self.best_makespan = float(run.state.best_peak), float(run.state.best_makespan)
        levels = int(run.state.levels)
        self.levels_total += levels
        return MemoryOutcome(None if self.best_seqs is None else [list(s) for s in self.best_seqs],
                             self.best_peak, self.best_makespan, run.step, levels)
