"""The annealing loop of the fused-schedule search, for both of its objectives (RLHFuse, NSDI'25,
arXiv 2409.13221, section 5: "we first minimise the latency, then, with the latency fixed,
minimise the peak memory").

This module owns :func:`anneal_loop`, one kernel (compiled with numba; its plain Python form is
the fallback, and the tests compare the two step by step) that anneals per-rank orders towards
either objective, and :class:`Loop`, which runs it on an
:class:`~systems.rlhfuse.intra.incremental.OrderState`'s arrays within a budget and reads the best
order back; its drivers are ``anneal.MakespanPhase`` (objective MAKESPAN: energy the makespan,
critical-block and uniform swaps, a rung is a cooling cycle) and ``memory.MemorySearch``
(MEMORY: the makespan's excess over the target plus the area above a cap that drops at every
level, memory-targeted moves added; a new rung at every level). A step draws the Metropolis limit
before timing, so the memory term rules a move out before any timing and re-timing aborts as
soon as the limit is broken; no proposal lets two actions of one class trade places. Random
numbers: MT19937 continued from the phase's ``random.Random`` (MAKESPAN: the moves the Python
loop made) or L'Ecuyer's combined generator (CACM 31(6), 1988; MEMORY), exact integer arithmetic
in both forms, so a run is a pure function of its inputs (docs/FUSED_SEARCH.md, "One annealing
loop for both objectives").
"""
from __future__ import annotations

import math
import random
import time

import numpy as np

from systems.rlhfuse.intra import kernel

_EPS = 1e-9
_M1, _A1, _M2, _A2 = 2147483563, 40014, 2147483399, 40692  # L'Ecuyer (1988)
L_ECUYER = (_M1, _M2)  # the moduli its two states are below
NONE, SWAP, MOVE = 0, 1, 2  # proposal kinds
MAKESPAN, MEMORY = 0, 1  # objectives
STOPPED, DONE, CYCLE_END = 0, 1, 2  # what ``anneal_loop`` returns
# slots of the kernel's float state ``fs``, integer state ``st`` and integer parameters ``par_i``
(F_TARGET, F_TOL, F_UNIT, F_TIME_UNIT, F_CAPMAX, F_FLOOR, F_CAP, F_AREA, F_MAKESPAN, F_ENERGY, F_BEST_PEAK,
 F_BEST_MAKESPAN, F_TRIAL_AREA, F_LIMIT, F_RANK_PEAK, F_TRIAL_MAKESPAN, F_TIME_FRAC) = range(NUM_F := 17)
(S_STEP, S_RUNG_START, S_NUM_OVER, S_LEVELS, S_CRIT, S_EPOCH, S_STARTED, S_R, S_LO, S_HI, S_COUNT,
 S_KIND, S_I, S_J, S_HAS_BEST, S_NUM_RANKS) = range(NUM_S := 16)
I_MAX_SHIFT, I_RUNG, I_MAX_DRAWS, I_OBJECTIVE = range(4)


@kernel.njit(cache=True)
def _mt_word(rs):
    """The next 32-bit output of MT19937 (Matsumoto and Nishimura, ACM TOMACS 8(1), 1998) whose
    624 words and index are ``rs``: the generator of Python's ``random.Random``."""
    if rs[624] >= 624:
        for k in range(624):
            y = (rs[k] & 0x80000000) | (rs[(k + 1) % 624] & 0x7FFFFFFF)
            rs[k] = rs[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        rs[624] = 0
    y = rs[rs[624]]
    rs[624] += 1
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    return y ^ (y >> 18)


@kernel.njit(cache=True)
def _uniform(rs):
    """The next number in [0, 1): ``random.Random.random()``'s for an MT19937 state (625 words),
    else (in (0, 1)) that of the combined generator whose two states are ``rs``."""
    if rs.shape[0] > 2:
        return ((_mt_word(rs) >> 5) * 67108864.0 + (_mt_word(rs) >> 6)) * (1.0 / 9007199254740992.0)
    s1 = rs[0] * _A1 % _M1
    s2 = rs[1] * _A2 % _M2
    rs[0], rs[1] = s1, s2
    z = s1 - s2
    if z < 1:
        z += _M1 - 1
    return z / float(_M1)


@kernel.njit(cache=True)
def _below(rs, n):
    """A number in [0, n): ``random.Random.randrange(n)``'s for an MT19937 state (the top bits of
    a word, drawn again while out of range), else ``int(u * n)``."""
    if rs.shape[0] > 2:
        bits = 0
        while (n >> bits) > 0:
            bits += 1
        r = _mt_word(rs) >> (32 - bits)
        while r >= n:
            r = _mt_word(rs) >> (32 - bits)
        return r
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
    return max(0.0, makespan - fs[F_TARGET]) / fs[F_TIME_UNIT] + area / fs[F_UNIT]


@kernel.njit(cache=True)
def _record(seq2d, lens, pm2d, peak, best2d, over_at, over_rk, cap_step, fs, st):
    """The state is at the target makespan and under the cap or the best peak: keep it if it
    holds less than the best, and put the cap ``cap_step`` below the best."""
    pk = max(0.0, peak.max())
    if pk < fs[F_BEST_PEAK] - _EPS:
        if fs[F_BEST_PEAK] < np.inf:  # the first record is where the phase starts
            st[S_LEVELS] += 1
        fs[F_BEST_PEAK], fs[F_BEST_MAKESPAN] = pk, fs[F_MAKESPAN]
        best2d[:, :] = seq2d
        st[S_HAS_BEST] = 1
    _set_cap(fs[F_BEST_PEAK] - cap_step * fs[F_UNIT], seq2d, lens, pm2d, over_at, over_rk, fs, st)


@kernel.njit(cache=True)
def _propose(order, graph, pm2d, over_rk, ranks, crit_out, rs, par_f, par_i, fs, st):
    """One proposal: (kind, rank, i, j) with kind NONE (dropped), SWAP (i, i+1) or MOVE (i to j)."""
    seq2d, lens, rank_of, pos, start, end = order
    dep_a, dep_b, lat_a, lat_b, dur, tail, cls, delta = graph
    q_memory, q_critical, q_move = par_f[2], par_f[3], par_f[4]
    max_shift = par_i[I_MAX_SHIFT]
    x = _uniform(rs)
    if st[S_NUM_OVER] > 0 and x < q_memory:  # lower a position over the cap
        idx = _below(rs, st[S_NUM_OVER])
        r, k = over_rk[idx, 0], over_rk[idx, 1]
        n = lens[r]
        if _uniform(rs) >= q_move:
            if k + 1 < n and delta[seq2d[r, k + 1]] < delta[seq2d[r, k]]:
                return SWAP, r, k, k + 1
            return NONE, 0, 0, 0
        if _uniform(rs) < 0.5:  # the nearest forward at or before k, later
            f = k
            while f >= 0 and delta[seq2d[r, f]] <= 0:
                f -= 1
            if f < 0:
                return NONE, 0, 0, 0
            j = min(n - 1, k + 1 + _below(rs, max_shift))
            if j <= f or not _fifo_ok(seq2d, cls, r, f, j):
                return NONE, 0, 0, 0
            return MOVE, r, f, j
        b = k + 1  # the next backward after k, earlier
        while b < n and delta[seq2d[r, b]] >= 0:
            b += 1
        if b >= n:
            return NONE, 0, 0, 0
        j = max(0, k - _below(rs, max_shift))
        if not _fifo_ok(seq2d, cls, r, b, j):
            return NONE, 0, 0, 0
        return MOVE, r, b, j
    if (par_i[I_OBJECTIVE] == MAKESPAN or fs[F_MAKESPAN] > fs[F_TOL]) and x < q_memory + q_critical:
        # an end of a critical block
        if st[S_CRIT] < 0:
            seed = 1 + _below(rs, kernel.LEHMER_MODULUS - 1)
            st[S_CRIT] = kernel.critical_swaps(seed, seq2d, lens, rank_of, pos, start, end, dep_a, dep_b,
                                               lat_a, lat_b, crit_out)
        if st[S_CRIT] == 0:
            return NONE, 0, 0, 0
        idx = _below(rs, st[S_CRIT])
        r, i = crit_out[idx, 0], crit_out[idx, 1]
        if cls[seq2d[r, i]] == cls[seq2d[r, i + 1]]:
            return NONE, 0, 0, 0
        return SWAP, r, i, i + 1
    r = ranks[_below(rs, st[S_NUM_RANKS])]  # uniform
    n = lens[r]
    if q_move > 0 and _uniform(rs) < q_move:
        i = _below(rs, n)
        shift = 1 + _below(rs, max_shift)
        j = i + shift if _uniform(rs) < 0.5 else i - shift
        if j < 0 or j >= n or not _fifo_ok(seq2d, cls, r, i, j):
            return NONE, 0, 0, 0
        return MOVE, r, i, j
    i = _below(rs, n - 1)
    if cls[seq2d[r, i]] == cls[seq2d[r, i + 1]]:
        return NONE, 0, 0, 0
    return SWAP, r, i, i + 1


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
    if kind == SWAP:
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
    threshold = fs[F_TARGET] + (fs[F_LIMIT] - mem_e) * fs[F_TIME_UNIT]
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
def _commit(order, graph, work, scratch, pm2d, peak, over_at, over_rk, nv, fs, st):
    """Make the pending trial (``_try``) the state: times, positions, work sums, memory profile,
    the over-cap set and the area above the cap."""
    seq2d, lens, rank_of, pos, start, end = order
    dur = graph[4]
    cum2d = work[1]
    r, lo, hi, count = st[S_R], st[S_LO], st[S_HI], st[S_COUNT]
    start[:] = scratch[0]
    end[:] = scratch[1]
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
    fs[F_MAKESPAN] = fs[F_TRIAL_MAKESPAN]
    st[S_CRIT] = -1


@kernel.njit(cache=True)
def _done(fs, par_i):
    if par_i[I_OBJECTIVE] == MAKESPAN:
        return fs[F_BEST_MAKESPAN] <= fs[F_TOL]
    return fs[F_BEST_PEAK] <= fs[F_FLOOR] + _EPS


@kernel.njit(cache=True)
def anneal_loop(order, graph, work, scratch, pm2d, peak, best2d, over_at, over_rk, ranks, crit_out, nv, rs,
                par_f, par_i, fs, st, stop_step, trace):
    """Anneal (module docstring) until step ``stop_step`` (returns STOPPED), the goal (DONE: the
    lower bound, or the trivial peak bound; also when nothing can move), or, for the makespan,
    the end of a cooling cycle (CYCLE_END). All state lives in the arrays: ``order`` (orders,
    positions, times), ``pm2d`` / ``peak`` (each rank's memory profile and peak), ``best2d`` (the
    best order), the over-cap set, the generator ``rs`` and the scalars ``fs`` / ``st``; a run is
    resumed by calling again with a later ``stop_step``. ``trace`` (length 0: off) receives, per
    step, the makespan, area above the cap and peak of the order the step starts from (the tests
    compare compiled and interpreted runs with it, step by step)."""
    seq2d, lens = order[0], order[1]
    t0, t1, cap_step, accept_tol = par_f[0], par_f[1], par_f[5], par_f[6]
    rung, memory = par_i[I_RUNG], par_i[I_OBJECTIVE] == MEMORY
    if st[S_STARTED] == 0:
        st[S_STARTED] = 1
        cap = np.inf  # the makespan: no area term
        if memory:
            cap = peak.max() if fs[F_BEST_PEAK] == np.inf else fs[F_BEST_PEAK] - cap_step * fs[F_UNIT]
        _set_cap(cap, seq2d, lens, pm2d, over_at, over_rk, fs, st)
        if memory and fs[F_MAKESPAN] <= fs[F_TOL] and fs[F_AREA] <= _EPS:
            _record(seq2d, lens, pm2d, peak, best2d, over_at, over_rk, cap_step, fs, st)
        fs[F_ENERGY] = _energy(fs[F_MAKESPAN], fs[F_AREA], fs)
    if st[S_NUM_RANKS] == 0:
        return DONE
    while st[S_STEP] < stop_step:
        if _done(fs, par_i):
            return DONE
        since = st[S_STEP] - st[S_RUNG_START]
        if since >= rung:  # cooled down without reaching the goal (the next level)
            if not memory:
                return CYCLE_END  # the driver starts the next cycle from the first order
            st[S_RUNG_START], since = st[S_STEP], 0  # reheat
        temp = t0 * (t1 / t0) ** max(since / rung, fs[F_TIME_FRAC])
        st[S_STEP] += 1
        if trace.shape[0] >= st[S_STEP]:
            row = st[S_STEP] - 1
            trace[row, 0], trace[row, 1], trace[row, 2] = fs[F_MAKESPAN], fs[F_AREA], peak.max()
        fs[F_LIMIT] = fs[F_ENERGY] - temp * np.log(1.0 - _uniform(rs))
        timed = False
        for _ in range(par_i[I_MAX_DRAWS]):
            kind, r, i, j = _propose(order, graph, pm2d, over_rk, ranks, crit_out, rs, par_f, par_i, fs, st)
            if kind != NONE and _try(kind, r, i, j, order, graph, work, pm2d, peak, nv, scratch, fs, st):
                timed = True
                break
        if not timed:
            continue
        makespan = fs[F_TRIAL_MAKESPAN]
        if makespan == np.inf or _energy(makespan, fs[F_TRIAL_AREA], fs) > fs[F_LIMIT] + accept_tol:
            _shift(seq2d, st[S_R], st[S_J], st[S_I])  # revert
            continue
        _commit(order, graph, work, scratch, pm2d, peak, over_at, over_rk, nv, fs, st)
        fs[F_ENERGY] = _energy(makespan, fs[F_AREA], fs)
        if not memory:
            if makespan < fs[F_BEST_MAKESPAN] - _EPS:
                fs[F_BEST_MAKESPAN] = makespan
                best2d[:, :] = seq2d
                st[S_HAS_BEST] = 1
        elif makespan <= fs[F_TOL] and (st[S_NUM_OVER] == 0 or peak.max() < fs[F_BEST_PEAK] - _EPS):
            _record(seq2d, lens, pm2d, peak, best2d, over_at, over_rk, cap_step, fs, st)
            st[S_RUNG_START] = st[S_STEP]
            fs[F_ENERGY] = _energy(makespan, fs[F_AREA], fs)
    return DONE if _done(fs, par_i) else STOPPED


def action_classes(model) -> np.ndarray:
    """Per action: an id of its (pipe, kind). Two actions of one class never trade places."""
    names: dict[tuple[str, str], int] = {}
    return np.array([names.setdefault((a.pipe, a.kind), len(names)) for a in model.actions], dtype=np.int64)


def mt_state(rng: random.Random) -> np.ndarray:
    """``rng``'s MT19937 state as the kernel's generator array (624 words and the index)."""
    return np.array(rng.getstate()[1], dtype=np.int64)


def mt_restore(rng: random.Random, rs: np.ndarray) -> None:
    """Hand the kernel's MT19937 state back to ``rng`` (it goes on from where the kernel stopped)."""
    version, _, gauss = rng.getstate()
    rng.setstate((version, tuple(int(x) for x in rs), gauss))


class Loop:
    """One run of :func:`anneal_loop` on the arrays of ``state`` (an ``incremental.OrderState``,
    changed in place: it holds the loop's current order after a run): ``objective`` (MAKESPAN or
    MEMORY), the generator ``rs``, the float parameters ``(t0, t1, q_memory, q_critical, q_move,
    cap_step, accept_tol)``, the integer ones ``(max_shift, rung, max_draws)`` and the float
    state slots ``fs`` given by name (``F_TARGET``, ...; the makespan's defaults make the energy
    the makespan). ``step``: the step count it goes on from. ``compiled``: run the kernel
    compiled (default: whenever numba is available) or interpreted (the same steps)."""

    def __init__(self, state, cls: np.ndarray, objective: int, rs: np.ndarray,
                 par_f: tuple, par_i: tuple, fs: dict[int, float], step: int = 0, compiled: bool | None = None):
        self.state, (R, L) = state, state._a_seq.shape
        self.ranks = np.array([r for r, n in enumerate(state._a_len) if n > 1], dtype=np.int64)
        self.fs, self.st = np.zeros(NUM_F), np.zeros(NUM_S, dtype=np.int64)
        self.fs[[F_UNIT, F_TIME_UNIT, F_CAPMAX, F_BEST_PEAK, F_BEST_MAKESPAN, F_MAKESPAN]] = [
            1.0, 1.0, math.inf if state.mem_cap is None else state.mem_cap, math.inf, math.inf, state.makespan()]
        for slot, value in fs.items():
            self.fs[slot] = value
        self.st[S_CRIT], self.st[S_EPOCH], self.st[S_NUM_RANKS] = -1, state.st[S_EPOCH], len(self.ranks)
        self.st[S_STEP] = self.st[S_RUNG_START] = step
        self.rs, self.best2d = rs, np.zeros_like(state._a_seq)
        self.args = (state.order, (*state.graph[:6], cls, state.graph[7]), state.work, state.scratch, state._pm,
                     state._peak, self.best2d, np.full((R, L), -1, dtype=np.int64),
                     np.zeros((R * L + 1, 2), dtype=np.int64), self.ranks, state._a_out, np.zeros(L + 1), rs,
                     np.array(par_f, dtype=np.float64), np.array([*par_i, objective], dtype=np.int64), self.fs, self.st)
        self.compiled = kernel.AVAILABLE if compiled is None else bool(compiled and kernel.AVAILABLE)
        self.fn = anneal_loop if self.compiled else kernel.interpreted(anneal_loop)

    @property
    def step(self) -> int:
        return int(self.st[S_STEP])

    def run(self, steps: int | None, seconds: float | None = None, trace: np.ndarray | None = None,
            time_cools: bool = False) -> int:
        """Anneal until ``steps`` (the loop's step count) or ``seconds`` from now, whichever comes
        first, or until the kernel returns DONE or CYCLE_END (what is returned; else STOPPED).
        Under a time limit the kernel runs in slices of 64 steps with the clock read between
        them; with ``time_cools`` the share of the time used also sets the temperature."""
        stop = 2**62 if steps is None else steps
        deadline = None if seconds is None else time.perf_counter() + seconds
        trace = np.zeros((0, 3)) if trace is None else trace
        out = STOPPED
        while deadline is None or time.perf_counter() < deadline:
            if deadline is not None and time_cools:
                self.fs[F_TIME_FRAC] = 1.0 - (deadline - time.perf_counter()) / seconds
            out = self.fn(*self.args, min(stop, self.step + 64) if deadline is not None else stop, trace)
            if out != STOPPED or self.step >= stop:
                break
        self.state.st[S_EPOCH] = self.st[S_EPOCH]  # the state's own deadlock tests go on from here
        return out

    def best_seqs(self) -> list[list[int]] | None:
        """The best order the run recorded (None: none)."""
        if not self.st[S_HAS_BEST]:
            return None
        return [self.best2d[r, :n].tolist() for r, n in enumerate(self.state._a_len)]
