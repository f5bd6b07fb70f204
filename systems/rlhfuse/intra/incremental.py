"""Re-timing of per-rank orders under local moves: the evaluation engine of the RLHFuse schedule
annealer (NSDI'25, arXiv 2409.13221, section 5).

This module owns :class:`OrderState`: a schedule in the encoded form of
``harness.schedule.simulate.SimModel`` (per-rank lists of action ids) together with every
action's start/end time and each rank's running activation memory, and the two moves the
annealer makes: swap two adjacent actions on one rank (:meth:`OrderState.try_swap`), and move one
action to another position on its rank (:meth:`OrderState.try_move`).

Timing is ``simulate``'s list-scheduling rule, so a state always agrees with
``harness.schedule.simulate`` (the tests check this after long random walks). View the schedule as
a DAG whose edges are the dependency edges plus "next on the same rank"; an action's start is the
max over its in-edges of (predecessor end + latency).

- **Times**: a move on rank ``r`` that touches positions ``i..j`` only changes the in-edges of
  actions at ``i-1..j+1``, so every action whose time can change is a descendant (old graph) of
  the action that was at position ``i``, and starts no earlier than it did. Everything that
  started strictly before that time ``t0`` keeps its times: each rank's actions before ``t0`` form
  a prefix of its list (found by bisection), and the list scheduler (the same worklist over ranks
  as ``SimModel.run``, blocked ranks woken by the action they wait on) resumes from those
  prefixes (cheaper on packed schedules than propagating change by change: docs/FUSED_SEARCH.md).
- **Early abort**: a trial is given a ``threshold``; re-timing stops as soon as some action's new
  end plus the work still to come after it (the rest of its rank's list, or its chain of dependent
  work, whichever is longer) exceeds it, and the trial reports :data:`ABORTED`.
- **Deadlock**: the old graph is acyclic, so a move deadlocks iff the one ordering it adds closes a
  cycle. Moving ``v`` from ``i`` later to ``j`` (a swap is ``j = i + 1``): iff ``v`` reaches one of
  ``seq[i+1..j]`` through its dependants; moving it earlier to ``j``: iff one of ``seq[j..i-1]``
  reaches ``v`` other than along the rank (that path runs through the edge ``seq[i-1] -> v`` the
  move removes). A DFS bounded by start times answers it before any timing
  (``kernel.move_closes_cycle``). It is the deadlock ``simulate`` would report as ScheduleError,
  and the trial returns None without re-timing anything.
- **Kernels**: the resumed pass and the critical-path trace run in
  :mod:`systems.rlhfuse.intra.kernel` (compiled with numba when it is installed) over NumPy
  mirrors of the orders and times that this class keeps in step with its lists.
- **Memory**: a rank's activation profile depends only on its list order; a swap changes one
  prefix sum (after position ``i``), a move the prefix sums between its two positions, so the cap
  test and the new peak need no timing at all.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import accumulate
from collections.abc import Sequence

import numpy as np

from harness.schedule import ScheduleError, SimModel
from systems.rlhfuse.intra import kernel

_EPS = 1e-9
ABORTED = float("inf")  # makespan reported for a trial move cut short by its threshold


@lru_cache(maxsize=32)
def chain_tails(model: SimModel) -> list[float]:
    """Per action: the longest chain of dependent work that must still follow it (the later
    forwards and backwards of its micro-batch, with latencies): the "bottom level" of classic
    critical-path list scheduling, and a lower bound on how long the schedule lasts after it.
    Cached per model (``sim_model`` caches the models themselves); callers must not modify it."""
    n = model.num_actions
    succs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for v in range(n):
        for d, lat in ((model.dep_a[v], model.lat_a[v]), (model.dep_b[v], model.lat_b[v])):
            if d >= 0:
                succs[d].append((v, lat))
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


def _profile(seq: Sequence[int], delta: Sequence[float]) -> list[float]:
    run, out = 0.0, []
    for v in seq:
        run += delta[v]
        out.append(run)
    return out


class OrderState:
    """Per-rank orders (encoded ids) with cached timing and memory; supports trial moves."""

    def __init__(self, model: SimModel, seqs: Sequence[Sequence[int]], mem_cap: float | None = None,
                 tails: list[float] | None = None, compiled: bool | None = None):
        """``compiled``: run the kernels of :mod:`systems.rlhfuse.intra.kernel` compiled (default:
        whenever numba is available) or interpreted (same results, for tests and machines
        without numba)."""
        self.model = model
        self.mem_cap = mem_cap
        self.seqs = [list(s) for s in seqs]
        n = model.num_actions
        self.dur, self.delta = model.dur, model.mem_delta
        self.dep_a, self.dep_b, self.lat_a, self.lat_b = model.dep_a, model.dep_b, model.lat_a, model.lat_b
        succ: list[list[int]] = [[] for _ in range(n)]
        for v in range(n):
            for d in (self.dep_a[v], self.dep_b[v]):
                if d >= 0:
                    succ[d].append(v)
        self.dsucc = [tuple(s) for s in succ]
        self.tail = chain_tails(model) if tails is None else tails
        self.rank_of = [-1] * n
        self.pos = [-1] * n
        for r, seq in enumerate(self.seqs):
            for i, v in enumerate(seq):
                self.rank_of[v], self.pos[v] = r, i
        self.retime()
        self.prefix: list[list[float]] = [_profile(seq, self.delta) for seq in self.seqs]
        self.peak: list[float] = [max(pm, default=0.0) for pm in self.prefix]
        self._pending: tuple | None = None
        self.compiled = kernel.AVAILABLE if compiled is None else bool(compiled and kernel.AVAILABLE)
        self._resim_fn = kernel.resim if self.compiled else kernel.interpreted(kernel.resim)
        self._crit_fn = (kernel.critical_swaps if self.compiled
                         else kernel.interpreted(kernel.critical_swaps))
        self._cycle_fn = (kernel.move_closes_cycle if self.compiled
                          else kernel.interpreted(kernel.move_closes_cycle))
        self._init_arrays()

    def _init_arrays(self) -> None:
        """NumPy state of the kernels: orders (padded 2-D), each rank's work up to and including
        each position and in total, positions, times and scratch; kept in step with the lists by
        the trial moves, :meth:`commit` and :meth:`revert`."""
        seqs, n, R, dur = self.seqs, self.model.num_actions, len(self.seqs), self.dur
        width = max((len(s) for s in seqs), default=0)
        self._a_seq = np.full((R, max(width, 1)), -1, dtype=np.int64)
        self._a_cum = np.zeros((R, max(width, 1)), dtype=np.float64)
        for q, seq in enumerate(seqs):
            self._a_seq[q, :len(seq)] = seq
            self._a_cum[q, :len(seq)] = list(accumulate(dur[v] for v in seq))
        self._a_len = np.array([len(s) for s in seqs], dtype=np.int64)
        self._a_total = np.array([sum(dur[v] for v in seq) for seq in seqs], dtype=np.float64)
        self._a_static = tuple(np.array(x, dtype=t) for x, t in (
            (self.dep_a, np.int64), (self.dep_b, np.int64), (self.lat_a, np.float64),
            (self.lat_b, np.float64), (self.dur, np.float64), (self.tail, np.float64)))
        self._a_start = np.array(self.start, dtype=np.float64)
        self._a_end = np.array(self.end, dtype=np.float64)
        self._a_ss, self._a_se = np.empty(n), np.empty(n)
        self._a_waiter = np.full(n, -1, dtype=np.int64)
        self._a_next = np.full(R, -1, dtype=np.int64)
        self._a_blocked = np.zeros(max(n, 1), dtype=np.int64)
        self._a_firsts = np.zeros(R, dtype=np.int64)
        self._a_clock, self._a_left = np.zeros(R), np.zeros(R)
        self._a_ready = np.zeros(max(R, 1), dtype=np.int64)
        self._a_rank_of = np.array(self.rank_of, dtype=np.int64)
        # dependants of every action, compressed rows (the deadlock DFS), and its visit stamps
        self._a_succ_ptr = np.zeros(n + 1, dtype=np.int64)
        self._a_succ_ptr[1:] = np.cumsum([len(s) for s in self.dsucc])
        self._a_succ_idx = np.array([w for s in self.dsucc for w in s], dtype=np.int64)
        self._a_mark = np.full(max(n, 1), -1, dtype=np.int64)
        self._a_stack = np.zeros(max(n, 1), dtype=np.int64)
        self._epoch = 0
        self._a_pos = np.array(self.pos, dtype=np.int64)
        self._a_out = np.zeros((2 * n + 2, 2), dtype=np.int64)  # critical-path swaps

    @property
    def cum(self) -> list[list[float]]:
        """Per rank, the work done up to and including each position (what the kernels read)."""
        return [self._a_cum[q, :len(seq)].tolist() for q, seq in enumerate(self.seqs)]

    def _mirror_move(self, r: int, i: int, j: int) -> None:
        """Apply "the action at ``i`` of rank ``r`` goes to ``j``" to the 2-D order mirror."""
        row = self._a_seq[r]
        v = row[i]
        if j > i:
            row[i:j] = row[i + 1:j + 1].copy()
        else:
            row[j + 1:i + 1] = row[j:i].copy()
        row[j] = v

    def _resim(self, r: int, lo: int, t0: float, threshold: float) -> float | None:
        """Re-time everything that started at or after ``t0`` (rank ``r`` from position ``lo``)
        into the scratch arrays (``kernel.resim``). Returns the new makespan, ABORTED, or None on
        deadlock."""
        dep_a, dep_b, lat_a, lat_b, dur, tail = self._a_static
        out = self._resim_fn(self._a_seq, self._a_len, r, lo, t0, threshold, self._a_start, self._a_end,
                             self._a_se, self._a_ss, dep_a, dep_b, lat_a, lat_b, dur, tail,
                             self._a_total, self._a_cum, self._a_waiter, self._a_next, self._a_blocked,
                             self._a_firsts, self._a_clock, self._a_left, self._a_ready)
        return None if out == kernel.DEADLOCK else float(out)

    # ---- whole-schedule quantities -------------------------------------------------------
    def retime(self) -> None:
        """Full list-scheduling pass (``SimModel.run``); raises ScheduleError on deadlock."""
        end, start, _, _, pos = self.model.run(self.seqs, want_start=True)
        if any(p < len(s) for p, s in zip(pos, self.seqs)):
            raise ScheduleError("order deadlocks")
        self._start_list, self._end_list = start, end

    @property
    def start(self) -> list[float]:
        """Start time of every action, as a list (made from the array when read after a commit; the
        trial moves read the few entries they need from the array itself)."""
        if self._start_list is None:
            self._start_list = self._a_start.tolist()
        return self._start_list

    @property
    def end(self) -> list[float]:
        if self._end_list is None:
            self._end_list = self._a_end.tolist()
        return self._end_list

    def makespan(self) -> float:
        end = self.end
        return max((end[s[-1]] for s in self.seqs if s), default=0.0)

    def max_peak(self) -> float:
        return max(self.peak, default=0.0)

    def snapshot(self) -> list[list[int]]:
        return [list(s) for s in self.seqs]

    # ---- trial moves ---------------------------------------------------------------------
    def _closes_cycle(self, r: int, i: int, j: int) -> bool:
        """Would moving position ``i`` of rank ``r`` to ``j`` deadlock? (module docstring)"""
        self._epoch += 1
        return bool(self._cycle_fn(self._a_seq, self._a_len, self._a_rank_of, self._a_pos, self._a_start,
                                   self._a_succ_ptr, self._a_succ_idx, r, i, j, self._a_mark, self._epoch,
                                   self._a_stack))

    def _peak_after(self, r: int, lo: int, new_vals: list[float]) -> float:
        """Rank ``r``'s peak if its prefix sums ``lo .. lo+len(new_vals)-1`` became ``new_vals``."""
        pm = self.prefix[r]
        hi = lo + len(new_vals)
        old_peak = self.peak[r]
        new_max = max(new_vals, default=0.0)
        if new_max >= old_peak:
            return new_max
        if max(pm[lo:hi], default=0.0) < old_peak:
            return old_peak  # the old peak lies outside the changed range
        return max(max(pm[:lo], default=0.0), new_max, max(pm[hi:], default=0.0))

    def try_swap(self, r: int, i: int, threshold: float = ABORTED) -> tuple[float, float] | None:
        """Tentatively swap positions ``i, i+1`` of rank ``r``. Returns None (nothing changed) if
        the swap would deadlock or break the memory cap; otherwise ``(makespan, max peak)`` of
        the new order, where the makespan is :data:`ABORTED` as soon as re-timing proves it would
        exceed ``threshold``. Follow with :meth:`commit` (not after an abort) or :meth:`revert`.
        (The annealing loop makes the same trials inside its kernel, ``loop.anneal_loop``.)"""
        seq = self.seqs[r]
        a, b = seq[i], seq[i + 1]
        if self.dep_a[b] == a or self.dep_b[b] == a:
            return None
        pm = self.prefix[r]
        new_vals = [(pm[i - 1] if i > 0 else 0.0) + self.delta[b]]
        if self.mem_cap is not None and new_vals[0] > self.mem_cap + _EPS:
            return None
        if self._closes_cycle(r, i, i + 1):
            return None
        t0 = float(self._a_start[a])
        seq[i], seq[i + 1] = b, a
        self._a_seq[r, i], self._a_seq[r, i + 1] = b, a
        makespan = self._resim(r, i, t0, threshold)
        if makespan is None:  # cannot happen after the DFS above, but never leave a bad order
            seq[i], seq[i + 1] = a, b
            self._a_seq[r, i], self._a_seq[r, i + 1] = a, b
            return None
        rank_peak = self._peak_after(r, i, new_vals)
        # pending: rank, first changed position, last changed position, new prefix sums from
        # the first, the rank's new peak, the new makespan, the move (None for a swap)
        self._pending = (r, i, i + 1, new_vals, rank_peak, makespan, None)
        return makespan, self._max_peak_with(r, rank_peak)

    def move_prefix(self, r: int, i: int, j: int) -> tuple[int, list[float]]:
        """(first changed position, new prefix sums from there) if the action at position ``i``
        of rank ``r`` moved to position ``j``: no timing, nothing changed."""
        pm, d = self.prefix[r], self.delta[self.seqs[r][i]]
        if j > i:
            return i, [pm[k + 1] - d for k in range(i, j)] + [pm[j]]
        return j, [(pm[j - 1] if j > 0 else 0.0) + d] + [pm[k - 1] + d for k in range(j + 1, i + 1)]

    def try_move(self, r: int, i: int, j: int, threshold: float = ABORTED) -> tuple[float, float] | None:
        """Tentatively move the action at position ``i`` of rank ``r`` to position ``j`` (the
        others keep their relative order). Same contract as :meth:`try_swap`."""
        if i == j:
            return None
        seq = self.seqs[r]
        v = seq[i]
        dep_a, dep_b = self.dep_a, self.dep_b
        if j < i:   # moving earlier: it may not pass its own dependency
            da, db = dep_a[v], dep_b[v]
            for k in range(j, i):
                w = seq[k]
                if w == da or w == db:
                    return None
        else:       # moving later: nothing it passes may depend on it
            for k in range(i + 1, j + 1):
                w = seq[k]
                if dep_a[w] == v or dep_b[w] == v:
                    return None
        lo, new_vals = self.move_prefix(r, i, j)
        if self.mem_cap is not None and max(new_vals) > self.mem_cap + _EPS:
            return None
        if self._closes_cycle(r, i, j):
            return None
        t0 = float(self._a_start[seq[lo]])
        del seq[i]
        seq.insert(j, v)
        self._mirror_move(r, i, j)
        makespan = self._resim(r, lo, t0, threshold)
        if makespan is None:
            del seq[j]
            seq.insert(i, v)
            self._mirror_move(r, j, i)
            return None
        rank_peak = self._peak_after(r, lo, new_vals)
        self._pending = (r, lo, lo + len(new_vals) - 1, new_vals, rank_peak, makespan, (i, j))
        return makespan, self._max_peak_with(r, rank_peak)

    def _max_peak_with(self, r: int, rank_peak: float) -> float:
        out = rank_peak
        for q, pk in enumerate(self.peak):
            if q != r and pk > out:
                out = pk
        return out

    def commit(self) -> None:
        r, lo, hi, new_vals, rank_peak, makespan, _ = self._pending
        if makespan == ABORTED:
            raise RuntimeError("cannot commit a trial move that was cut short")
        self._a_start, self._a_ss = self._a_ss, self._a_start
        self._a_end, self._a_se = self._a_se, self._a_end
        self._start_list = self._end_list = None  # lists made again from the arrays when read
        seq, pos, dur = self.seqs[r], self.pos, self.dur
        self.prefix[r][lo:lo + len(new_vals)] = new_vals
        self.peak[r] = rank_peak
        run = float(self._a_cum[r, lo - 1]) if lo > 0 else 0.0
        work = []
        for k in range(lo, hi + 1):
            v = seq[k]
            pos[v] = k
            run += dur[v]
            work.append(run)
        self._a_cum[r, lo:hi + 1] = work
        self._a_pos[seq[lo:hi + 1]] = np.arange(lo, hi + 1)
        self._pending = None

    def revert(self) -> None:
        r, lo, _, _, _, _, move = self._pending
        seq = self.seqs[r]
        if move is None:
            seq[lo], seq[lo + 1] = seq[lo + 1], seq[lo]
            row = self._a_seq[r]
            row[lo], row[lo + 1] = row[lo + 1], row[lo]
        else:
            i, j = move
            seq.insert(i, seq.pop(j))
            self._mirror_move(r, j, i)
        self._pending = None

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
        count = self._crit_fn(seed, self._a_seq, self._a_len, self._a_rank_of, self._a_pos,
                              self._a_start, self._a_end, dep_a, dep_b, lat_a, lat_b, self._a_out)
        return [(r, p) for r, p in self._a_out[:count].tolist()]
