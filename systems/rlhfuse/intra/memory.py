"""Memory phase of the fused-schedule search (RLHFuse, NSDI'25, arXiv 2409.13221, section 5: "we
first minimise the latency, then, with the latency fixed, minimise the peak memory").

This module owns :class:`MemorySearch`: given a target makespan ``T`` (the makespan phase's best),
find orders whose makespan is at most ``T`` and whose largest per-rank peak of in-flight activation
memory is as low as possible. It is a simulated annealing over per-rank orders (the moves and
timing of :class:`~systems.rlhfuse.intra.incremental.OrderState`) with a **memory cap of
increasing tightness**:

- **Energy** (both terms are penalties, so energy 0 means "done at this cap"): the makespan's
  excess over ``T`` in mean action times, plus the *area above the cap*: the sum over every rank
  and list position of how far the rank's in-flight activation memory after that position exceeds
  the cap, in units of the smallest activation. The area changes only at the positions a move
  touches, and unlike the peak it says how much of the profile still has to come down, and where.
  Both constraints are soft while annealing.
- **Ladder**: whenever the energy reaches 0 the state is a schedule with makespan <= ``T`` and
  peak <= cap: it is recorded, and the cap drops to its peak minus ``cap_step`` smallest
  activations, so the search always works on the next level down.
- **Moves** (each keeps micro-batches first-in first-out per pipe and stage): *memory-targeted*
  ones pick a position where a rank is over the cap and lower it (swap the action there with a
  following one that holds less, move the nearest earlier forward later, or the next backward
  earlier); *critical-path* swaps while the makespan is above ``T``; uniform swaps and short moves.
- **Acceptance**: Metropolis on the energy; the uniform number is drawn first, so the memory term
  (known before any timing) either rules the move out at once or leaves a makespan threshold
  that the re-timing aborts at.
- **Starting points**: :meth:`MemorySearch.run` starts from any order, feasible or not; runs share
  the best peak found so far, so a later run never works on a cap above it.

The loop runs as one kernel (:func:`memory_anneal`, compiled with numba; its plain Python form is
the fallback and the tests compare the two step by step). Its random numbers come from L'Ecuyer's
combined multiplicative generator (CACM 31(6), 1988), seeded per run from the ``random.Random``
passed in, in integer arithmetic that is exact in both forms; budgets are counted in trial moves,
so a run is a pure function of its inputs.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harness.schedule import SimModel
from systems.rlhfuse.intra import kernel
from systems.rlhfuse.intra.config import DEFAULT_MEMORY_MOVE_REACH
from systems.rlhfuse.intra.incremental import OrderState

_EPS = 1e-9
MAX_DRAWS = 256  # proposals drawn per step before the step is counted as an empty one
_M1, _A1, _M2, _A2 = 2147483563, 40014, 2147483399, 40692  # L'Ecuyer (1988)
_NONE, _SWAP, _MOVE = 0, 1, 2
# slots of the kernel's float state ``fs`` and integer state ``st``
(F_TARGET, F_TOL, F_UNIT, F_MEAN, F_CAPMAX, F_FLOOR, F_CAP, F_AREA, F_MAKESPAN, F_ENERGY, F_BEST_PEAK,
 F_BEST_MAKESPAN, F_TRIAL_AREA, F_LIMIT, F_RANK_PEAK, F_TRIAL_MAKESPAN) = range(16)
(S_STEP, S_RUNG_START, S_NUM_OVER, S_LEVELS, S_CRIT, S_EPOCH, S_STARTED, S_R, S_LO, S_HI, S_COUNT,
 S_KIND, S_I, S_J, S_HAS_BEST, S_NUM_RANKS) = range(16)


@dataclass
class MemoryParams:
    t0: float = 2.0         # start temperature (energy units: one mean action time / activation)
    t1: float = 0.02        # final temperature
    q_memory: float = 0.5   # share of memory-targeted proposals while some rank is over the cap
    q_critical: float = 0.25  # share of critical-path swaps while the makespan is above target
    q_move: float = 0.8     # share of moves (vs adjacent swaps) among memory-targeted and uniform
    max_shift: int = DEFAULT_MEMORY_MOVE_REACH  # longest distance a move carries an action
    cap_step: float = 0.5   # next cap = best peak - cap_step * smallest activation
    rung_steps: int = 10_000  # cooling from t0 to t1 restarts at every new level (and after this)


@dataclass
class MemoryOutcome:
    seqs: list[list[int]] | None  # best order found with makespan <= target (None: none)
    peak: float                   # its peak (inf when none)
    makespan: float
    steps: int
    levels: int                   # how many times the cap was lowered


# ---- the kernel ----------------------------------------------------------------------------------
@kernel.njit(cache=True)
def _uniform(rs):
    """The next number in (0, 1) of the combined generator whose two states are ``rs``."""
    s1 = rs[0] * _A1 % _M1
    s2 = rs[1] * _A2 % _M2
    rs[0], rs[1] = s1, s2
    z = s1 - s2
    if z < 1:
        z += _M1 - 1
    return z / float(_M1)


@kernel.njit(cache=True)
def _below(rs, n):
    return int(_uniform(rs) * n)


@kernel.njit(cache=True)
def _fifo_ok(seq2d, cls, r, i, j):
    """Does moving position ``i`` of rank ``r`` to ``j`` keep it behind / ahead of its own class?"""
    c = cls[seq2d[r, i]]
    lo, hi = (i + 1, j + 1) if j > i else (j, i)
    for k in range(lo, hi):
        if cls[seq2d[r, k]] == c:
            return False
    return True


@kernel.njit(cache=True)
def _set_cap(cap, seq2d, lens, pm2d, over_at, over_rk, fs, st):
    fs[F_CAP] = cap
    num, area = 0, 0.0
    for r in range(lens.shape[0]):
        for k in range(lens[r]):
            val = pm2d[r, k]
            if val > cap + _EPS:
                area += val - cap
                over_at[r, k] = num
                over_rk[num, 0], over_rk[num, 1] = r, k
                num += 1
            else:
                over_at[r, k] = -1
    st[S_NUM_OVER] = num
    fs[F_AREA] = area


@kernel.njit(cache=True)
def _mark(r, k, val, over_at, over_rk, fs, st):
    """Keep position (r, k) in the set of positions over the cap iff its new value ``val`` is."""
    if val > fs[F_CAP] + _EPS:
        if over_at[r, k] < 0:
            over_at[r, k] = st[S_NUM_OVER]
            over_rk[st[S_NUM_OVER], 0], over_rk[st[S_NUM_OVER], 1] = r, k
            st[S_NUM_OVER] += 1
    elif over_at[r, k] >= 0:
        j = over_at[r, k]
        over_at[r, k] = -1
        st[S_NUM_OVER] -= 1
        last = st[S_NUM_OVER]
        if j < last:
            lr, lk = over_rk[last, 0], over_rk[last, 1]
            over_rk[j, 0], over_rk[j, 1] = lr, lk
            over_at[lr, lk] = j


@kernel.njit(cache=True)
def _energy(makespan, area, fs):
    return max(0.0, makespan - fs[F_TARGET]) / fs[F_MEAN] + area / fs[F_UNIT]


@kernel.njit(cache=True)
def _record(seq2d, lens, pm2d, peak, best2d, over_at, over_rk, cap_step, fs, st):
    """The state is feasible at the cap: keep it if it holds less than the best, and lower the cap."""
    pk = 0.0
    for q in range(peak.shape[0]):
        if peak[q] > pk:
            pk = peak[q]
    if pk < fs[F_BEST_PEAK] - _EPS:
        if fs[F_BEST_PEAK] < np.inf:  # the first record is where the phase starts
            st[S_LEVELS] += 1
        fs[F_BEST_PEAK], fs[F_BEST_MAKESPAN] = pk, fs[F_MAKESPAN]
        best2d[:, :] = seq2d
        st[S_HAS_BEST] = 1
    _set_cap(fs[F_BEST_PEAK] - cap_step * fs[F_UNIT], seq2d, lens, pm2d, over_at, over_rk, fs, st)


@kernel.njit(cache=True)
def _propose(order, graph, pm2d, over_rk, ranks, crit_out, rs, par_f, par_i, fs, st):
    """One proposal: (kind, rank, i, j) with kind _NONE (dropped), _SWAP (i, i+1) or _MOVE (i to j)."""
    seq2d, lens, rank_of, pos, start, end = order
    dep_a, dep_b, lat_a, lat_b, dur, tail, cls, delta = graph
    q_memory, q_critical, q_move = par_f[2], par_f[3], par_f[4]
    max_shift = par_i[0]
    x = _uniform(rs)
    if st[S_NUM_OVER] > 0 and x < q_memory:  # lower a position over the cap
        idx = _below(rs, st[S_NUM_OVER])
        r, k = over_rk[idx, 0], over_rk[idx, 1]
        n = lens[r]
        if _uniform(rs) >= q_move:
            if k + 1 < n and delta[seq2d[r, k + 1]] < delta[seq2d[r, k]]:
                return _SWAP, r, k, k + 1
            return _NONE, 0, 0, 0
        if _uniform(rs) < 0.5:  # the nearest forward at or before k, later
            f = k
            while f >= 0 and delta[seq2d[r, f]] <= 0:
                f -= 1
            if f < 0:
                return _NONE, 0, 0, 0
            j = min(n - 1, k + 1 + _below(rs, max_shift))
            if j <= f or not _fifo_ok(seq2d, cls, r, f, j):
                return _NONE, 0, 0, 0
            return _MOVE, r, f, j
        b = k + 1  # the next backward after k, earlier
        while b < n and delta[seq2d[r, b]] >= 0:
            b += 1
        if b >= n:
            return _NONE, 0, 0, 0
        j = max(0, k - _below(rs, max_shift))
        if not _fifo_ok(seq2d, cls, r, b, j):
            return _NONE, 0, 0, 0
        return _MOVE, r, b, j
    if fs[F_MAKESPAN] > fs[F_TOL] and x < q_memory + q_critical:  # an end of a critical block
        if st[S_CRIT] < 0:
            seed = 1 + _below(rs, kernel.LEHMER_MODULUS - 1)
            st[S_CRIT] = kernel.critical_swaps(seed, seq2d, lens, rank_of, pos, start, end, dep_a, dep_b,
                                               lat_a, lat_b, crit_out)
        if st[S_CRIT] == 0:
            return _NONE, 0, 0, 0
        idx = _below(rs, st[S_CRIT])
        r, i = crit_out[idx, 0], crit_out[idx, 1]
        if cls[seq2d[r, i]] == cls[seq2d[r, i + 1]]:
            return _NONE, 0, 0, 0
        return _SWAP, r, i, i + 1
    r = ranks[_below(rs, st[S_NUM_RANKS])]  # uniform
    n = lens[r]
    if _uniform(rs) < q_move:
        i = _below(rs, n)
        shift = 1 + _below(rs, max_shift)
        j = i + shift if _uniform(rs) < 0.5 else i - shift
        if j < 0 or j >= n or not _fifo_ok(seq2d, cls, r, i, j):
            return _NONE, 0, 0, 0
        return _MOVE, r, i, j
    i = _below(rs, n - 1)
    if cls[seq2d[r, i]] == cls[seq2d[r, i + 1]]:
        return _NONE, 0, 0, 0
    return _SWAP, r, i, i + 1


@kernel.njit(cache=True)
def _try(kind, r, i, j, order, graph, work, pm2d, peak, nv, scratch, fs, st):
    """Time a proposal (``OrderState.try_swap`` / ``try_move`` with the memory phase's gate):
    returns False if it is dropped before timing (dependency, cap, energy limit, deadlock),
    otherwise leaves it pending (``st``: rank, range, move; ``fs``: makespan, rank peak) and
    returns True."""
    seq2d, lens, rank_of, pos, start, end = order
    dep_a, dep_b, lat_a, lat_b, dur, tail, cls, delta = graph
    total, cum2d, succ_ptr, succ_idx = work
    ss, se, mark, stack, waiter, next_waiter, blocked, firsts, clock, left, ready = scratch
    v = seq2d[r, i]
    if kind == _SWAP:
        b = seq2d[r, i + 1]
        if dep_a[b] == v or dep_b[b] == v:
            return False
        lo, count, hi = i, 1, i + 1
        nv[0] = (pm2d[r, i - 1] if i > 0 else 0.0) + delta[b]
    else:
        if j < i:  # moving earlier: it may not pass its own dependency
            for k in range(j, i):
                w = seq2d[r, k]
                if w == dep_a[v] or w == dep_b[v]:
                    return False
        else:  # moving later: nothing it passes may depend on it
            for k in range(i + 1, j + 1):
                w = seq2d[r, k]
                if dep_a[w] == v or dep_b[w] == v:
                    return False
        d = delta[v]
        if j > i:
            lo, count = i, j - i + 1
            for k in range(i, j):
                nv[k - i] = pm2d[r, k + 1] - d
            nv[j - i] = pm2d[r, j]
        else:
            lo, count = j, i - j + 1
            nv[0] = (pm2d[r, j - 1] if j > 0 else 0.0) + d
            for k in range(j + 1, i + 1):
                nv[k - j] = pm2d[r, k - 1] + d
        hi = lo + count - 1
    new_max = nv[0]
    for k in range(1, count):
        if nv[k] > new_max:
            new_max = nv[k]
    if new_max > fs[F_CAPMAX] + _EPS:
        return False
    # the gate: the memory term is known before any timing
    cap, area = fs[F_CAP], fs[F_AREA]
    for k in range(count):
        old, val = pm2d[r, lo + k], nv[k]
        area += (val - cap if val > cap else 0.0) - (old - cap if old > cap else 0.0)
    mem_e = area / fs[F_UNIT]
    if mem_e > fs[F_LIMIT] + _EPS:
        return False
    fs[F_TRIAL_AREA] = area
    threshold = fs[F_TARGET] + (fs[F_LIMIT] - mem_e) * fs[F_MEAN]
    st[S_EPOCH] += 1
    if kernel.move_closes_cycle(seq2d, lens, rank_of, pos, start, succ_ptr, succ_idx, r, i, j, mark, st[S_EPOCH],
                                stack):
        return False
    t0 = start[seq2d[r, lo]]
    _shift(seq2d, r, i, j)
    makespan = kernel.resim(seq2d, lens, r, lo, t0, threshold, start, end, se, ss, dep_a, dep_b, lat_a, lat_b,
                            dur, tail, total, cum2d, waiter, next_waiter, blocked, firsts, clock, left, ready)
    if makespan == kernel.DEADLOCK:  # cannot happen after the test above; never keep a bad order
        _shift(seq2d, r, j, i)
        return False
    # the rank's new peak
    old_peak = peak[r]
    if new_max >= old_peak:
        rank_peak = new_max
    else:
        old_max = 0.0
        for k in range(lo, lo + count):
            if pm2d[r, k] > old_max:
                old_max = pm2d[r, k]
        rank_peak = old_peak
        if old_max >= old_peak:  # the old peak lay in the changed range
            rank_peak = new_max
            for k in range(0, lo):
                if pm2d[r, k] > rank_peak:
                    rank_peak = pm2d[r, k]
            for k in range(lo + count, lens[r]):
                if pm2d[r, k] > rank_peak:
                    rank_peak = pm2d[r, k]
    st[S_R], st[S_LO], st[S_HI], st[S_COUNT], st[S_KIND], st[S_I], st[S_J] = r, lo, hi, count, kind, i, j
    fs[F_RANK_PEAK], fs[F_TRIAL_MAKESPAN] = rank_peak, makespan
    return True


@kernel.njit(cache=True)
def _shift(seq2d, r, i, j):
    """The action at position ``i`` of rank ``r`` goes to ``j`` (a swap is ``j = i + 1``)."""
    v = seq2d[r, i]
    if j > i:
        for k in range(i, j):
            seq2d[r, k] = seq2d[r, k + 1]
    else:
        for k in range(i, j, -1):
            seq2d[r, k] = seq2d[r, k - 1]
    seq2d[r, j] = v


@kernel.njit(cache=True)
def memory_anneal(order, graph, work, scratch, pm2d, peak, best2d, over_at, over_rk, ranks, crit_out, nv, rs,
                  par_f, par_i, fs, st, stop_step, trace):
    """Run the memory phase (module docstring) until step ``stop_step``, the trivial bound, or (on
    the first call of a run) nothing to move. All state lives in the arrays: ``order`` (orders,
    positions, times), ``pm2d`` / ``peak`` (each rank's memory profile and peak), ``best2d`` (the
    best order), the over-cap set, the generator ``rs`` and the scalars ``fs`` / ``st``; a run is
    resumed by calling again with a later ``stop_step``. ``trace`` (length 0: off) receives, per
    step, the makespan, area above the cap and peak of the order the step starts from (the tests
    compare compiled and interpreted runs with it, step by step)."""
    seq2d, lens, rank_of, pos, start, end = order
    dur = graph[4]
    total, cum2d, succ_ptr, succ_idx = work
    ss, se = scratch[0], scratch[1]
    t0, t1, cap_step = par_f[0], par_f[1], par_f[5]
    rung = par_i[1]
    if st[S_STARTED] == 0:
        st[S_STARTED] = 1
        mx = 0.0
        for q in range(peak.shape[0]):
            mx = max(mx, peak[q])
        cap = mx if fs[F_BEST_PEAK] == np.inf else fs[F_BEST_PEAK] - cap_step * fs[F_UNIT]
        _set_cap(cap, seq2d, lens, pm2d, over_at, over_rk, fs, st)
        if fs[F_MAKESPAN] <= fs[F_TOL] and fs[F_AREA] <= _EPS:
            _record(seq2d, lens, pm2d, peak, best2d, over_at, over_rk, cap_step, fs, st)
        fs[F_ENERGY] = _energy(fs[F_MAKESPAN], fs[F_AREA], fs)
    if st[S_NUM_RANKS] == 0:
        return
    while st[S_STEP] < stop_step and not fs[F_BEST_PEAK] <= fs[F_FLOOR] + _EPS:
        since = st[S_STEP] - st[S_RUNG_START]
        if since >= rung:  # cooled down without reaching the next level: reheat
            st[S_RUNG_START], since = st[S_STEP], 0
        temp = t0 * (t1 / t0) ** (since / rung)
        st[S_STEP] += 1
        if trace.shape[0] >= st[S_STEP]:
            row = st[S_STEP] - 1
            trace[row, 0], trace[row, 1], trace[row, 2] = fs[F_MAKESPAN], fs[F_AREA], peak.max()
        fs[F_LIMIT] = fs[F_ENERGY] - temp * np.log(1.0 - _uniform(rs))
        timed = False
        for _ in range(MAX_DRAWS):
            kind, r, i, j = _propose(order, graph, pm2d, over_rk, ranks, crit_out, rs, par_f, par_i, fs, st)
            if kind != _NONE and _try(kind, r, i, j, order, graph, work, pm2d, peak, nv, scratch, fs, st):
                timed = True
                break
        if not timed:
            continue
        makespan = fs[F_TRIAL_MAKESPAN]
        r, lo, hi, count = st[S_R], st[S_LO], st[S_HI], st[S_COUNT]
        if makespan == np.inf or _energy(makespan, fs[F_TRIAL_AREA], fs) > fs[F_LIMIT] + _EPS:
            _shift(seq2d, r, st[S_J], st[S_I])  # revert
            continue
        start[:] = ss  # commit
        end[:] = se
        for k in range(count):
            pm2d[r, lo + k] = nv[k]
        peak[r] = fs[F_RANK_PEAK]
        run = cum2d[r, lo - 1] if lo > 0 else 0.0
        for k in range(lo, hi + 1):
            v = seq2d[r, k]
            pos[v] = k
            run += dur[v]
            cum2d[r, k] = run
        for k in range(count):
            _mark(r, lo + k, nv[k], over_at, over_rk, fs, st)
        fs[F_AREA] = fs[F_TRIAL_AREA] if st[S_NUM_OVER] > 0 else 0.0
        fs[F_MAKESPAN] = makespan
        st[S_CRIT] = -1
        fs[F_ENERGY] = _energy(makespan, fs[F_AREA], fs)
        if makespan <= fs[F_TOL] and st[S_NUM_OVER] == 0:
            _record(seq2d, lens, pm2d, peak, best2d, over_at, over_rk, cap_step, fs, st)
            st[S_RUNG_START] = st[S_STEP]
            fs[F_ENERGY] = _energy(makespan, fs[F_AREA], fs)


# ---- the search object -----------------------------------------------------------------------------
class MemorySearch:
    """The memory phase (module docstring). One instance per (model, target); :meth:`run` may be
    called several times from different starting orders, sharing the best peak found.
    ``compiled``: run :func:`memory_anneal` compiled (default: whenever numba is available) or
    interpreted (the same steps; for tests and machines without numba)."""

    def __init__(self, model: SimModel, tails: list[float], target: float, mem_cap: float | None,
                 rng: random.Random, params: MemoryParams | None = None, compiled: bool | None = None):
        self.model, self.tails, self.target, self.mem_cap = model, tails, target, mem_cap
        self.rng = rng
        self.p = params or MemoryParams()
        self.compiled = kernel.AVAILABLE if compiled is None else bool(compiled and kernel.AVAILABLE)
        self.unit = min((d for d in model.mem_delta if d > 0), default=1.0)
        names: dict = {}  # class of an action: (pipe, kind); two actions of one class never trade places
        self.cls = np.array([names.setdefault((a.pipe, a.kind), len(names)) for a in model.actions], dtype=np.int64)
        self.best_peak = math.inf
        self.best_seqs: list[list[int]] | None = None
        self.best_makespan = math.inf
        self.floor = max(max(model.mem_delta, default=0.0), 0.0)
        self.levels_total = 0  # times the best peak was lowered, over all runs
        self.trace: np.ndarray = np.zeros((0, 3))  # give it rows to record (makespan, area, peak) per step

    def at_floor(self) -> bool:
        """Is the best peak already the trivial bound (the largest single activation)?"""
        return self.best_peak <= self.floor + _EPS

    def run(self, seqs: Sequence[Sequence[int]], steps: int | None,
            seconds: float | None = None) -> MemoryOutcome:
        """Anneal from ``seqs`` for ``steps`` trial moves and/or ``seconds`` (whichever runs out
        first; at least one must be given), or until the trivial bound is reached."""
        if steps is None and seconds is None:
            raise ValueError("the memory phase needs a step or time budget")
        deadline = None if seconds is None else time.perf_counter() + seconds
        state = OrderState(self.model, seqs, self.mem_cap, self.tails)
        p, n = self.p, self.model.num_actions
        R, L = state._a_seq.shape
        dep_a, dep_b, lat_a, lat_b, dur, tail = state._a_static
        order = (state._a_seq, state._a_len, state._a_rank_of, state._a_pos, state._a_start, state._a_end)
        graph = (dep_a, dep_b, lat_a, lat_b, dur, tail, self.cls, np.asarray(self.model.mem_delta, dtype=np.float64))
        work = (state._a_total, state._a_cum, state._a_succ_ptr, state._a_succ_idx)
        scratch = (state._a_ss, state._a_se, state._a_mark, state._a_stack, state._a_waiter, state._a_next,
                   state._a_blocked, state._a_firsts, state._a_clock, state._a_left, state._a_ready)
        pm2d = np.zeros((R, L))
        for r, pm in enumerate(state.prefix):
            pm2d[r, :len(pm)] = pm
        ranks = np.array([r for r, s in enumerate(state.seqs) if len(s) > 1], dtype=np.int64)
        fs = np.zeros(16)
        fs[[F_TARGET, F_TOL, F_UNIT, F_MEAN, F_CAPMAX, F_FLOOR, F_BEST_PEAK, F_BEST_MAKESPAN, F_MAKESPAN]] = [
            self.target, self.target + _EPS * max(1.0, abs(self.target)), self.unit,
            sum(self.model.dur) / max(n, 1) or 1.0, math.inf if self.mem_cap is None else self.mem_cap,
            self.floor, self.best_peak, self.best_makespan, state.makespan()]
        st = np.zeros(16, dtype=np.int64)
        st[S_CRIT], st[S_EPOCH], st[S_NUM_RANKS] = -1, state._epoch, len(ranks)
        rs = np.array([self.rng.randrange(1, _M1), self.rng.randrange(1, _M2)], dtype=np.int64)
        par_f = np.array([p.t0, p.t1, p.q_memory, p.q_critical, p.q_move, p.cap_step])
        par_i = np.array([int(p.max_shift), max(1, int(p.rung_steps))], dtype=np.int64)
        best2d = np.zeros_like(state._a_seq)
        args = (order, graph, work, scratch, pm2d, np.array(state.peak, dtype=np.float64), best2d,
                np.full((R, L), -1, dtype=np.int64), np.zeros((R * L + 1, 2), dtype=np.int64), ranks,
                state._a_out, np.zeros(L + 1), rs, par_f, par_i, fs, st)
        fn = memory_anneal if self.compiled else kernel.interpreted(memory_anneal)
        budget = math.inf if steps is None else steps
        while True:  # in slices of 64 steps under a time limit, so the clock is read between them
            stop = budget if deadline is None else min(budget, st[S_STEP] + 64)
            fn(*args, int(min(stop, 2**62)), self.trace)
            if (st[S_STEP] >= budget or fs[F_BEST_PEAK] <= self.floor + _EPS or not len(ranks)
                    or (deadline is not None and time.perf_counter() >= deadline)):
                break
        if st[S_HAS_BEST]:
            self.best_seqs = [best2d[r, :state._a_len[r]].tolist() for r in range(R)]
            self.best_peak, self.best_makespan = float(fs[F_BEST_PEAK]), float(fs[F_BEST_MAKESPAN])
        self.levels_total += int(st[S_LEVELS])
        return MemoryOutcome(None if self.best_seqs is None else [list(s) for s in self.best_seqs],
                             self.best_peak, self.best_makespan, int(st[S_STEP]), int(st[S_LEVELS]))
