"""Re-timing of per-rank orders under local moves: the evaluation engine of the RLHFuse schedule
annealer (NSDI'25, arXiv 2409.13221, section 5).

This module owns :class:`OrderState`: a schedule in ``SimModel``'s encoded form (per-rank lists of
action ids) with every action's start and end and each rank's running activation memory, as the
arrays the kernels work on, and the annealer's two moves: swap two adjacent actions on a rank
(:meth:`OrderState.try_swap`) and move one to another position on its rank
(:meth:`OrderState.try_move`). Trials run the annealing loop's own kernels (``loop.try_move``,
``loop.commit_move``), so the tests of these methods against ``simulate`` check the search's moves.
Timing is ``simulate``'s list scheduling (tested after long random walks); how a trial re-times
only what it can change, stops early and rules out deadlock before timing, and why:
docs/FUSED_SEARCH.md, "Timing engine". A rank's memory profile depends only on its list order,
so the cap test and the new peak need no timing.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import accumulate
from collections.abc import Sequence

import numpy as np

from harness.schedule import ScheduleError, SimModel
from systems.rlhfuse.intra import kernel, loop

ABORTED = float("inf")  # makespan reported for a trial move cut short by its threshold


@lru_cache(maxsize=32)
def dependants(model: SimModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every action's dependants in compressed rows, ascending (``idx[ptr[v]:ptr[v + 1]]``), and
    each edge's latency: ``(ptr, idx, lat)``, cached per model; callers must not modify them."""
    edges = sorted((d, v, lat) for v in range(model.num_actions)
                   for d, lat in ((model.dep_a[v], model.lat_a[v]), (model.dep_b[v], model.lat_b[v])) if d >= 0)
    ptr = np.zeros(model.num_actions + 1, dtype=np.int64)
    np.add.at(ptr, np.array([d + 1 for d, _, _ in edges], dtype=np.int64), 1)
    return (np.cumsum(ptr), np.array([v for _, v, _ in edges], dtype=np.int64),
            np.array([lat for _, _, lat in edges], dtype=np.float64))


@lru_cache(maxsize=32)
def chain_tails(model: SimModel) -> list[float]:
    """Per action: the longest chain of dependent work that must still follow it (the later
    forwards and backwards of its micro-batch, with latencies): the "bottom level" of classic
    critical-path list scheduling, and a lower bound on how long the schedule lasts after it.
    Cached per model (``sim_model`` caches the models themselves); callers must not modify it."""
    n, (ptr, idx, lat) = model.num_actions, dependants(model)
    ptr, pairs = ptr.tolist(), list(zip(idx.tolist(), lat.tolist()))
    succs = [pairs[ptr[v]:ptr[v + 1]] for v in range(n)]
    tail = [-1.0] * n
    for root in range(n):
        stack = [root]
        while stack:
            v = stack[-1]
            todo = [w for w, _ in succs[v] if tail[w] < 0]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            tail[v] = max((lat + model.dur[w] + tail[w] for w, lat in succs[v]), default=0.0)
    return tail


class OrderState:
    """Per-rank orders (encoded ids) with their timing and memory profiles, as the kernels' arrays;
    supports trial moves. Its arrays are public: ``orders`` (:class:`~systems.rlhfuse.intra.kernel.Orders`,
    changed in place by a committed move), ``graph`` (:class:`~systems.rlhfuse.intra.kernel.Graph`)
    and ``scratch`` (:class:`~systems.rlhfuse.intra.kernel.Scratch`). The annealing loop
    (``loop.Loop``) works on the same arrays in place, so a state is current after a run."""

    def __init__(self, model: SimModel, seqs: Sequence[Sequence[int]], mem_cap: float | None = None,
                 tails: list[float] | None = None, compiled: bool | None = None):
        """``compiled``: run the kernels compiled (default: whenever numba is available) or
        interpreted (same results, for tests and machines without numba). Raises ScheduleError
        if the orders deadlock."""
        self.model, self.mem_cap = model, mem_cap
        tail = chain_tails(model) if tails is None else tails
        self.compiled = kernel.AVAILABLE if compiled is None else bool(compiled and kernel.AVAILABLE)
        seqs = [list(s) for s in seqs]
        end, start, _, _, done = model.run(seqs, want_start=True)
        if any(p < len(s) for p, s in zip(done, seqs)):
            raise ScheduleError("order deadlocks")
        n, num_ranks, dur, delta = model.num_actions, len(seqs), model.dur, model.mem_delta
        longest = max(max((len(s) for s in seqs), default=0), 1)
        seq = np.full((num_ranks, longest), -1, dtype=np.int64)
        work_done, held = np.zeros((num_ranks, longest)), np.zeros((num_ranks, longest))
        rank_of, pos = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        for q, s in enumerate(seqs):
            seq[q, :len(s)] = s
            work_done[q, :len(s)] = list(accumulate(dur[v] for v in s))
            held[q, :len(s)] = list(accumulate(delta[v] for v in s))
            ids = np.asarray(s, dtype=np.int64)
            rank_of[ids], pos[ids] = q, np.arange(len(s))
        self.orders = kernel.Orders(
            seq=seq, lens=np.array([len(s) for s in seqs], dtype=np.int64), rank_of=rank_of, pos=pos,
            start=np.array(start, dtype=np.float64), end=np.array(end, dtype=np.float64), work_done=work_done,
            work_total=np.array([sum(dur[v] for v in s) for s in seqs], dtype=np.float64), held=held,
            peak=np.array([max(held[q, :len(s)], default=0.0) for q, s in enumerate(seqs)]))
        succ_ptr, succ_idx, _ = dependants(model)
        self.graph = kernel.Graph(
            dep_a=np.array(model.dep_a, dtype=np.int64), dep_b=np.array(model.dep_b, dtype=np.int64),
            lat_a=np.array(model.lat_a, dtype=np.float64), lat_b=np.array(model.lat_b, dtype=np.float64),
            dur=np.array(dur, dtype=np.float64), tail=np.array(tail, dtype=np.float64),
            delta=np.asarray(delta, dtype=np.float64), succ_ptr=succ_ptr, succ_idx=succ_idx)
        self.scratch = kernel.new_scratch(num_ranks, longest, n)
        # trial moves run the loop's kernels with energy = makespan (target 0, units 1), no area
        # term (an infinite soft cap, so no position is ever over it) and the hard cap
        self._params = loop.LoopParams(loop.MAKESPAN, 0.0, 0.0, 1, 1,
                                       cap_max=np.inf if mem_cap is None else mem_cap).typed()
        self._trial = loop.new_state(cap=np.inf)
        self._over = loop.OverCap(np.full((num_ranks, longest), -1, dtype=np.int64), np.zeros((1, 2), dtype=np.int64))
        self._critical = np.zeros((2 * n + 2, 2), dtype=np.int64)  # critical-path swaps
        self._pending = False

    # ---- whole-schedule quantities (lists made from the arrays) ------------------------------
    def _rows(self, a: np.ndarray) -> list[list]:
        return [row[:n].tolist() for row, n in zip(a, self.orders.lens)]

    seqs = property(lambda self: self._rows(self.orders.seq), doc="Per rank, the order (action ids).")
    prefix = property(lambda self: self._rows(self.orders.held), doc="Per rank, the memory held after each position.")
    cum = property(lambda self: self._rows(self.orders.work_done), doc="Per rank, the work done up to each position.")
    start = property(lambda self: self.orders.start.tolist(), doc="Start time of every action.")
    end = property(lambda self: self.orders.end.tolist(), doc="End time of every action.")
    pos = property(lambda self: self.orders.pos.tolist(), doc="Position of every action on its rank.")
    peak = property(lambda self: self.orders.peak.tolist(), doc="Per rank, the peak activation memory.")

    def makespan(self) -> float:
        return max((float(self.orders.end[row[n - 1]]) for row, n in zip(self.orders.seq, self.orders.lens) if n),
                   default=0.0)

    def max_peak(self) -> float:
        return float(self.orders.peak.max(initial=0.0))

    def snapshot(self) -> list[list[int]]:
        return self.seqs

    # ---- trial moves (the loop's kernels) ------------------------------------------------------
    def _fn(self, fn):
        return fn if self.compiled else kernel.interpreted(fn)

    def move_closes_cycle(self, r: int, i: int, j: int) -> bool:
        """Would moving position ``i`` of rank ``r`` to ``j`` deadlock? (the test every trial
        move passes before any timing; module docstring)"""
        return bool(self._fn(kernel.move_closes_cycle)(self.orders, self.graph, self.scratch, r, i, j))

    def _try(self, kind: int, r: int, i: int, j: int, threshold: float) -> tuple[float, float] | None:
        self._trial.limit = threshold
        if not self._fn(loop.try_move)(kind, r, i, j, self.orders, self.graph, self.scratch, self._params,
                                       self._trial):
            return None
        self._pending = True
        others = np.delete(self.orders.peak, r)
        return float(self._trial.trial_makespan), max(float(self._trial.trial_peak), others.max(initial=0.0))

    def try_swap(self, r: int, i: int, threshold: float = ABORTED) -> tuple[float, float] | None:
        """Tentatively swap positions ``i, i+1`` of rank ``r``. Returns None (nothing changed) if
        the swap would deadlock or break the memory cap; otherwise ``(makespan, max peak)`` of
        the new order, where the makespan is :data:`ABORTED` as soon as re-timing proves it would
        exceed ``threshold``. Follow with :meth:`commit` (not after an abort) or :meth:`revert`."""
        return self._try(loop.SWAP, r, i, i + 1, threshold)

    def try_move(self, r: int, i: int, j: int, threshold: float = ABORTED) -> tuple[float, float] | None:
        """Tentatively move the action at position ``i`` of rank ``r`` to position ``j`` (the
        others keep their relative order). Same contract as :meth:`try_swap`."""
        return None if i == j else self._try(loop.MOVE, r, i, j, threshold)

    def commit(self) -> None:
        if not self._pending:
            raise RuntimeError("no trial move to commit")
        if self._trial.trial_makespan == ABORTED:
            raise RuntimeError("cannot commit a trial move that was cut short")
        self._fn(loop.commit_move)(self.orders, self.graph, self.scratch, self._over, self._trial)
        self._pending = False

    def revert(self) -> None:
        if not self._pending:
            raise RuntimeError("no trial move to revert")
        loop.shift(self.orders.seq, self._trial.trial_rank, self._trial.trial_j, self._trial.trial_i)
        self._pending = False

    # ---- critical path ---------------------------------------------------------------------
    def critical_swaps(self, rng) -> list[tuple[int, int]]:
        """Trace one critical path back from a last-finishing action (ties broken by a generator
        seeded from ``rng``) and return the adjacent swaps at the two ends of each of its rank
        blocks (runs of consecutive actions on one rank, each starting as the previous ends). As
        in job-shop scheduling (the N5 neighbourhood of Nowicki and Smutnicki), reordering inside
        a block keeps the path as long as it was, so only swaps at block ends can lower the
        makespan."""
        seed = rng.randrange(1, kernel.LEHMER_MODULUS)
        count = self._fn(kernel.critical_swaps)(seed, self.orders, self.graph, self._critical)
        return [(r, p) for r, p in self._critical[:count].tolist()]
