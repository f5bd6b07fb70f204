"""Re-timing of per-rank orders under local moves: the evaluation engine of the RLHFuse schedule
annealer (NSDI'25, arXiv 2409.13221, section 5).

This module owns :class:`OrderState`: a schedule in ``SimModel``'s encoded form (per-rank lists of
action ids) with every action's start and end and each rank's running activation memory, as the
arrays the kernels work on, and the annealer's two moves: swap two adjacent actions on a rank
(:meth:`OrderState.try_swap`) and move one to another position on its rank
(:meth:`OrderState.try_move`). Trials run the annealing loop's own kernels (``loop._try``,
``loop._commit``), so the tests of these methods against ``simulate`` check the search's moves.
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

_EPS = 1e-9
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
    supports trial moves. The annealing loop (``loop.Loop``) works on the same arrays in place,
    so a state is current after a run."""

    def __init__(self, model: SimModel, seqs: Sequence[Sequence[int]], mem_cap: float | None = None,
                 tails: list[float] | None = None, compiled: bool | None = None):
        """``compiled``: run the kernels compiled (default: whenever numba is available) or
        interpreted (same results, for tests and machines without numba). Raises ScheduleError
        if the orders deadlock."""
        self.model, self.mem_cap, self.delta = model, mem_cap, model.mem_delta
        self.tail = chain_tails(model) if tails is None else tails
        self.compiled = kernel.AVAILABLE if compiled is None else bool(compiled and kernel.AVAILABLE)
        seqs = [list(s) for s in seqs]
        end, start, _, _, done = model.run(seqs, want_start=True)
        if any(p < len(s) for p, s in zip(done, seqs)):
            raise ScheduleError("order deadlocks")
        n, R, dur = model.num_actions, len(seqs), model.dur
        L = max(max((len(s) for s in seqs), default=0), 1)
        self._a_seq, self._a_cum, self._pm = np.full((R, L), -1, dtype=np.int64), np.zeros((R, L)), np.zeros((R, L))
        self._a_rank_of, self._a_pos = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        for q, seq in enumerate(seqs):
            self._a_seq[q, :len(seq)] = seq
            self._a_cum[q, :len(seq)] = list(accumulate(dur[v] for v in seq))
            self._pm[q, :len(seq)] = list(accumulate(self.delta[v] for v in seq))
            ids = np.asarray(seq, dtype=np.int64)
            self._a_rank_of[ids], self._a_pos[ids] = q, np.arange(len(seq))
        self._a_len = np.array([len(s) for s in seqs], dtype=np.int64)
        self._peak = np.array([max(self._pm[q, :len(s)], default=0.0) for q, s in enumerate(seqs)])
        self._a_total = np.array([sum(dur[v] for v in seq) for seq in seqs], dtype=np.float64)
        self._a_static = tuple(np.array(x, dtype=t) for x, t in (
            (model.dep_a, np.int64), (model.dep_b, np.int64), (model.lat_a, np.float64),
            (model.lat_b, np.float64), (dur, np.float64), (self.tail, np.float64)))
        self._a_start, self._a_end = np.array(start, dtype=np.float64), np.array(end, dtype=np.float64)
        # dependants of every action, compressed rows (the deadlock DFS), and its visit stamps
        self._a_succ_ptr, self._a_succ_idx, _ = dependants(model)
        self._a_mark, self._a_stack = np.full(max(n, 1), -1, dtype=np.int64), np.zeros(max(n, 1), dtype=np.int64)
        self._a_out = np.zeros((2 * n + 2, 2), dtype=np.int64)  # critical-path swaps
        self.order = (self._a_seq, self._a_len, self._a_rank_of, self._a_pos, self._a_start, self._a_end)
        # (the trial kernels read no action classes: only the loop's proposals do)
        self.graph = (*self._a_static, np.zeros(0, dtype=np.int64), np.asarray(self.delta, dtype=np.float64))
        self.work = (self._a_total, self._a_cum, self._a_succ_ptr, self._a_succ_idx)
        self.scratch = (np.empty(n), np.empty(n), self._a_mark, self._a_stack, np.full(n, -1, dtype=np.int64),
                        np.full(R, -1, dtype=np.int64), np.zeros(max(n, 1), dtype=np.int64),
                        np.zeros(R, dtype=np.int64), np.zeros(R), np.zeros(R), np.zeros(max(R, 1), dtype=np.int64))
        # the trial kernels' scalars: energy = makespan (target 0, unit 1), no area term, the hard cap
        self.fs, self.st = np.zeros(loop.NUM_F), np.zeros(loop.NUM_S, dtype=np.int64)
        self.fs[[loop.F_UNIT, loop.F_TIME_UNIT, loop.F_CAP, loop.F_CAPMAX]] = [
            1.0, 1.0, np.inf, np.inf if mem_cap is None else mem_cap]
        self._over_at, self._over_rk = np.full((R, L), -1, dtype=np.int64), np.zeros((1, 2), dtype=np.int64)
        self._nv = np.zeros(L + 1)
        self._pending = False

    # ---- whole-schedule quantities (lists made from the arrays) ------------------------------
    def _rows(self, a: np.ndarray) -> list[list]:
        return [row[:n].tolist() for row, n in zip(a, self._a_len)]

    seqs = property(lambda self: self._rows(self._a_seq), doc="Per rank, the order (action ids).")
    prefix = property(lambda self: self._rows(self._pm), doc="Per rank, the memory held after each position.")
    cum = property(lambda self: self._rows(self._a_cum), doc="Per rank, the work done up to each position.")
    start = property(lambda self: self._a_start.tolist(), doc="Start time of every action.")
    end = property(lambda self: self._a_end.tolist(), doc="End time of every action.")
    pos = property(lambda self: self._a_pos.tolist(), doc="Position of every action on its rank.")
    peak = property(lambda self: self._peak.tolist(), doc="Per rank, the peak activation memory.")

    def makespan(self) -> float:
        return max((float(self._a_end[row[n - 1]]) for row, n in zip(self._a_seq, self._a_len) if n), default=0.0)

    def max_peak(self) -> float:
        return float(self._peak.max(initial=0.0))

    def snapshot(self) -> list[list[int]]:
        return self.seqs

    # ---- trial moves (the loop's kernels) ------------------------------------------------------
    def _fn(self, fn):
        return fn if self.compiled else kernel.interpreted(fn)

    def _closes_cycle(self, r: int, i: int, j: int) -> bool:
        """Would moving position ``i`` of rank ``r`` to ``j`` deadlock? (module docstring)"""
        self.st[loop.S_EPOCH] += 1
        return bool(self._fn(kernel.move_closes_cycle)(
            self._a_seq, self._a_len, self._a_rank_of, self._a_pos, self._a_start, self._a_succ_ptr,
            self._a_succ_idx, r, i, j, self._a_mark, self.st[loop.S_EPOCH], self._a_stack))

    def _trial(self, kind: int, r: int, i: int, j: int, threshold: float) -> tuple[float, float] | None:
        self.fs[loop.F_LIMIT] = threshold
        if not self._fn(loop._try)(kind, r, i, j, self.order, self.graph, self.work, self._pm, self._peak, self._nv,
                                   self.scratch, self.fs, self.st):
            return None
        self._pending = True
        others = np.delete(self._peak, r)
        return float(self.fs[loop.F_TRIAL_MAKESPAN]), max(float(self.fs[loop.F_RANK_PEAK]), others.max(initial=0.0))

    def try_swap(self, r: int, i: int, threshold: float = ABORTED) -> tuple[float, float] | None:
        """Tentatively swap positions ``i, i+1`` of rank ``r``. Returns None (nothing changed) if
        the swap would deadlock or break the memory cap; otherwise ``(makespan, max peak)`` of
        the new order, where the makespan is :data:`ABORTED` as soon as re-timing proves it would
        exceed ``threshold``. Follow with :meth:`commit` (not after an abort) or :meth:`revert`."""
        return self._trial(loop.SWAP, r, i, i + 1, threshold)

    def try_move(self, r: int, i: int, j: int, threshold: float = ABORTED) -> tuple[float, float] | None:
        """Tentatively move the action at position ``i`` of rank ``r`` to position ``j`` (the
        others keep their relative order). Same contract as :meth:`try_swap`."""
        return None if i == j else self._trial(loop.MOVE, r, i, j, threshold)

    def commit(self) -> None:
        if not self._pending:
            raise RuntimeError("no trial move to commit")
        if self.fs[loop.F_TRIAL_MAKESPAN] == ABORTED:
            raise RuntimeError("cannot commit a trial move that was cut short")
        self._fn(loop._commit)(self.order, self.graph, self.work, self.scratch, self._pm, self._peak, self._over_at,
                               self._over_rk, self._nv, self.fs, self.st)
        self._pending = False

    def revert(self) -> None:
        if not self._pending:
            raise RuntimeError("no trial move to revert")
        loop._shift(self._a_seq, self.st[loop.S_R], self.st[loop.S_J], self.st[loop.S_I])
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
        dep_a, dep_b, lat_a, lat_b, _, _ = self._a_static
        count = self._fn(kernel.critical_swaps)(seed, self._a_seq, self._a_len, self._a_rank_of, self._a_pos,
                                                self._a_start, self._a_end, dep_a, dep_b, lat_a, lat_b, self._a_out)
        return [(r, p) for r, p in self._a_out[:count].tolist()]
