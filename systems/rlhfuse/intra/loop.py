"""The annealing loop of the fused-schedule search, for both of its objectives (RLHFuse, NSDI'25,
arXiv 2409.13221, section 5: "we first minimise the latency, then, with the latency fixed,
minimise the peak memory").

This module owns :func:`anneal_loop`, one kernel (compiled with numba; its plain Python form is
the fallback, and the tests compare the two step by step) that anneals per-rank orders towards
either objective, the trial-move kernels it shares with
:class:`~systems.rlhfuse.intra.incremental.OrderState` (:func:`try_move`, :func:`commit_move`,
:func:`shift`), what the loop is given and keeps (:class:`LoopParams`, the record :data:`LOOP_STATE`,
:class:`OverCap`, :class:`Walk`), and :class:`Loop`, which runs the kernel on an ``OrderState``'s
arrays within a budget and reads the best order back; its drivers are ``anneal.MakespanPhase``
(objective MAKESPAN: energy the makespan, critical-block and uniform swaps, a rung is a cooling
cycle) and ``memory.MemorySearch`` (MEMORY: the makespan's excess over the target plus the area
above a cap that drops at every level, memory-targeted moves added; a new rung at every level). A
step draws the Metropolis limit before timing, so the memory term rules a move out before any
timing and re-timing aborts as soon as the limit is broken; no proposal lets two actions of one
class trade places. Random numbers: MT19937 continued from the phase's ``random.Random``
(MAKESPAN: the moves the Python loop made) or L'Ecuyer's combined generator (CACM 31(6), 1988;
MEMORY), exact integer arithmetic in both forms, so a run is a pure function of its inputs
(docs/FUSED_SEARCH.md, "One annealing loop for both objectives").
"""
from __future__ import annotations

import math
import random
import time
from typing import NamedTuple, get_type_hints

import numpy as np

from systems.rlhfuse.intra import kernel

_EPS = 1e-9
_M1, _A1, _M2, _A2 = 2147483563, 40014, 2147483399, 40692  # L'Ecuyer (1988)
L_ECUYER = (_M1, _M2)  # the moduli its two states are below
NONE, SWAP, MOVE = 0, 1, 2  # proposal kinds
MAKESPAN, MEMORY = 0, 1  # objectives
STOPPED, DONE, CYCLE_END = 0, 1, 2  # what ``anneal_loop`` returns
SLICE_STEPS = 64  # steps per call of the kernel under a time limit (the clock is read between calls)


class LoopParams(NamedTuple):
    """What a run of the loop is given (fixed while it runs). The energy of an order is its
    makespan's excess over ``target`` per ``time_unit`` plus its activation memory above the cap,
    summed over every position, per ``mem_unit`` (the makespan's defaults: the makespan itself)."""
    objective: int           # MAKESPAN or MEMORY
    t0: float                # start temperature (energy)
    t1: float                # final temperature
    rung: int                # steps of one cooling from t0 to t1
    max_draws: int           # proposals drawn per step before the step counts as an empty one
    q_memory: float = 0.0    # share of proposals that lower a position over the cap (while one is)
    q_critical: float = 0.0  # share of critical-block swaps (MEMORY: while the makespan is above tol)
    q_move: float = 0.0      # share of moves (vs adjacent swaps) among memory-targeted and uniform proposals
    max_shift: int = 1       # longest shift of a move
    cap_step: float = 0.0    # MEMORY: the cap goes this many mem_units below each new best peak
    accept_tol: float = 0.0  # a timed trial is kept up to this much above the step's limit
    target: float = 0.0
    time_unit: float = 1.0
    mem_unit: float = 1.0
    tol: float = 0.0         # the makespan goal: MAKESPAN is done at or below it, MEMORY records there
    floor: float = 0.0       # MEMORY: done once the best peak is at most this
    cap_max: float = math.inf  # hard cap on a rank's activation memory (Loop: its OrderState's)

    def typed(self) -> LoopParams:
        """The same values as the kernel's types (``int`` and ``float`` fields as declared), so that
        one compiled version serves every run."""
        return LoopParams(*(kind(value) for kind, value in zip(_PARAM_TYPES, self)))


_PARAM_TYPES = tuple(get_type_hints(LoopParams)[name] for name in LoopParams._fields)  # int or float, by field


# The loop's scalar state, one record (changed in place by the kernels; read back by name).
LOOP_STATE = np.dtype([
    ("step", np.int64),            # steps taken (a step: one proposal timed, or max_draws dropped)
    ("rung_start", np.int64),      # the step the current cooling started at
    ("started", np.int64),         # 1 once the first call set the cap and the energy
    ("levels", np.int64),          # MEMORY: times the best peak was lowered
    ("has_best", np.int64),        # 1 once a best order is recorded
    ("num_over", np.int64),        # positions above the cap (OverCap)
    ("num_critical", np.int64),    # critical swaps of the current order in Walk.critical (-1: not traced)
    ("makespan", np.float64),      # of the current order
    ("energy", np.float64),        # of the current order
    ("limit", np.float64),         # the step's Metropolis limit on the energy
    ("cap", np.float64),           # the soft cap (the area term's; MEMORY)
    ("area", np.float64),          # activation memory above the cap, summed over every position
    ("best_peak", np.float64),
    ("best_makespan", np.float64),
    # the trial move try_move leaves pending: position trial_i of rank trial_rank goes to trial_j,
    # positions trial_lo..trial_hi (trial_count) change; its makespan, area and the rank's new peak
    ("trial_kind", np.int64), ("trial_rank", np.int64), ("trial_i", np.int64), ("trial_j", np.int64),
    ("trial_lo", np.int64), ("trial_hi", np.int64), ("trial_count", np.int64),
    ("trial_makespan", np.float64), ("trial_area", np.float64), ("trial_peak", np.float64),
], align=True)


def new_state(**values: float) -> np.record:
    """A :data:`LOOP_STATE` record, every field 0 but ``values`` (an unknown name is an error)."""
    state = np.zeros(1, dtype=LOOP_STATE).view(np.recarray)[0]
    for name, value in values.items():
        if name not in LOOP_STATE.names:
            raise AttributeError(f"the loop state has no field {name!r}")
        setattr(state, name, value)
    return state


class OverCap(NamedTuple):
    """The positions whose activation memory is above the cap, a set with constant-time insertion
    and removal (its size: the state's ``num_over``)."""
    at: np.ndarray         # (R, L) int: a position's row in ``positions`` (-1: not above the cap)
    positions: np.ndarray  # (R L + 1, 2) int: (rank, position) of each, the first num_over rows


class Walk(NamedTuple):
    """The annealing loop's own arrays, beside the orders it changes."""
    classes: np.ndarray   # (n,) int: each action's (pipe, kind) class; two of a class never trade places
    ranks: np.ndarray     # int: the ranks with more than one action (where uniform proposals fall)
    rng: np.ndarray       # int: the generator, MT19937 (624 words and the index) or L'Ecuyer's (2 states)
    best: np.ndarray      # (R, L) int: the best order recorded (Orders.seq's layout)
    critical: np.ndarray  # (2 n + 2, 2) int: the current order's critical swaps, (rank, position) rows


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
def _set_cap(cap, orders, over, state):
    """Put the cap at ``cap``: the set of positions above it and the area above it anew."""
    state.cap = cap
    lens, pm2d, over_at, over_rk = orders.lens, orders.held, over.at, over.positions
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
    state.num_over = num
    state.area = area


@kernel.njit(cache=True)
def _mark(r, k, val, over, state):
    """Keep position (r, k) in the set of positions over the cap iff its new value ``val`` is."""
    over_at, over_rk = over.at, over.positions
    if val > state.cap + _EPS:
        if over_at[r, k] < 0:
            over_at[r, k] = state.num_over
            over_rk[state.num_over, 0], over_rk[state.num_over, 1] = r, k
            state.num_over += 1
    elif over_at[r, k] >= 0:
        j = over_at[r, k]
        over_at[r, k] = -1
        state.num_over -= 1
        last = state.num_over
        if j < last:
            lr, lk = over_rk[last, 0], over_rk[last, 1]
            over_rk[j, 0], over_rk[j, 1] = lr, lk
            over_at[lr, lk] = j


@kernel.njit(cache=True)
def _energy(makespan, area, params):
    return max(0.0, makespan - params.target) / params.time_unit + area / params.mem_unit


@kernel.njit(cache=True)
def _record(orders, over, walk, params, state):
    """The state is at the target makespan and under the cap or the best peak: keep it if it
    holds less than the best, and put the cap ``cap_step`` below the best."""
    pk = max(0.0, orders.peak.max())
    if pk < state.best_peak - _EPS:
        if state.best_peak < np.inf:  # the first record is where the phase starts
            state.levels += 1
        state.best_peak, state.best_makespan = pk, state.makespan
        walk.best[:, :] = orders.seq
        state.has_best = 1
    _set_cap(state.best_peak - params.cap_step * params.mem_unit, orders, over, state)


@kernel.njit(cache=True, inline='always')
def _propose(orders, graph, over, walk, params, state):
    """One proposal: (kind, rank, i, j) with kind NONE (dropped), SWAP (i, i+1) or MOVE (i to j)."""
    seq2d, lens, delta = orders.seq, orders.lens, graph.delta
    cls, rs, over_rk, crit_out = walk.classes, walk.rng, over.positions, walk.critical
    q_memory, q_critical, q_move = params.q_memory, params.q_critical, params.q_move
    max_shift = params.max_shift
    x = _uniform(rs)
    if state.num_over > 0 and x < q_memory:  # lower a position over the cap
        idx = _below(rs, state.num_over)
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
    if (params.objective == MAKESPAN or state.makespan > params.tol) and x < q_memory + q_critical:
        # an end of a critical block
        if state.num_critical < 0:
            seed = 1 + _below(rs, kernel.LEHMER_MODULUS - 1)
            state.num_critical = kernel.critical_swaps(seed, orders, graph, crit_out)
        if state.num_critical == 0:
            return NONE, 0, 0, 0
        idx = _below(rs, state.num_critical)
        r, i = crit_out[idx, 0], crit_out[idx, 1]
        if cls[seq2d[r, i]] == cls[seq2d[r, i + 1]]:
            return NONE, 0, 0, 0
        return SWAP, r, i, i + 1
    r = walk.ranks[_below(rs, walk.ranks.shape[0])]  # uniform
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
def try_move(kind, r, i, j, orders, graph, scratch, params, state):
    """Time a proposal (``OrderState.try_swap`` / ``try_move`` with the memory phase's gate):
    returns False if it is dropped before timing (dependency, cap, the state's energy ``limit``,
    deadlock), otherwise leaves it pending (the state's ``trial_*``, the new times and memory
    values in ``scratch``; the order already moved) and returns True."""
    seq2d, pm2d, peak = orders.seq, orders.held, orders.peak
    dep_a, dep_b, delta = graph.dep_a, graph.dep_b, graph.delta
    nv = scratch.held
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
    if new_max > params.cap_max + _EPS:
        return False
    # the gate: the memory term is known before any timing
    cap, area = state.cap, state.area
    for k in range(count):
        old, val = pm2d[r, lo + k], nv[k]
        area += (val - cap if val > cap else 0.0) - (old - cap if old > cap else 0.0)
    mem_e = area / params.mem_unit
    if mem_e > state.limit + _EPS:
        return False
    state.trial_area = area
    threshold = params.target + (state.limit - mem_e) * params.time_unit
    if kernel.move_closes_cycle(orders, graph, scratch, r, i, j):
        return False
    t0 = orders.start[seq2d[r, lo]]
    shift(seq2d, r, i, j)
    makespan = kernel.resim(orders, graph, scratch, r, lo, t0, threshold)
    if makespan == kernel.DEADLOCK:  # cannot happen after the test above; never keep a bad order
        shift(seq2d, r, j, i)
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
            for k in range(lo + count, orders.lens[r]):
                if pm2d[r, k] > rank_peak:
                    rank_peak = pm2d[r, k]
    state.trial_rank, state.trial_lo, state.trial_hi, state.trial_count = r, lo, hi, count
    state.trial_kind, state.trial_i, state.trial_j = kind, i, j
    state.trial_peak, state.trial_makespan = rank_peak, makespan
    return True


@kernel.njit(cache=True)
def shift(seq2d, r, i, j):
    """The action at position ``i`` of rank ``r`` goes to ``j`` (a swap is ``j = i + 1``; the pending
    trial is reverted by ``shift(seq2d, trial_rank, trial_j, trial_i)``)."""
    v = seq2d[r, i]
    if j > i:
        for k in range(i, j):
            seq2d[r, k] = seq2d[r, k + 1]
    else:
        for k in range(i, j, -1):
            seq2d[r, k] = seq2d[r, k - 1]
    seq2d[r, j] = v


@kernel.njit(cache=True)
def commit_move(orders, graph, scratch, over, state):
    """Make the pending trial (:func:`try_move`) the state: times, positions, work sums, memory
    profile, the over-cap set and the area above the cap."""
    seq2d, pos, pm2d, cum2d, dur, nv = orders.seq, orders.pos, orders.held, orders.work_done, graph.dur, scratch.held
    r, lo, hi, count = state.trial_rank, state.trial_lo, state.trial_hi, state.trial_count
    orders.start[:] = scratch.start
    orders.end[:] = scratch.end
    for k in range(count):
        pm2d[r, lo + k] = nv[k]
    orders.peak[r] = state.trial_peak
    run = cum2d[r, lo - 1] if lo > 0 else 0.0
    for k in range(lo, hi + 1):
        v = seq2d[r, k]
        pos[v] = k
        run += dur[v]
        cum2d[r, k] = run
    for k in range(count):
        _mark(r, lo + k, nv[k], over, state)
    state.area = state.trial_area if state.num_over > 0 else 0.0
    state.makespan = state.trial_makespan
    state.num_critical = -1


@kernel.njit(cache=True)
def _done(params, state):
    if params.objective == MAKESPAN:
        return state.best_makespan <= params.tol
    return state.best_peak <= params.floor + _EPS


@kernel.njit(cache=True)
def anneal_loop(orders, graph, scratch, over, walk, params, state, stop_step, time_frac, trace):
    """Anneal (module docstring) until step ``stop_step`` (returns STOPPED), the goal (DONE: the
    lower bound, or the trivial peak bound; also when nothing can move), or, for the makespan,
    the end of a cooling cycle (CYCLE_END). All state lives in the arguments: ``orders`` (orders,
    positions, times, each rank's memory profile and peak), ``over`` (the positions above the
    cap), ``walk`` (the generator, the best order) and the record ``state`` (:data:`LOOP_STATE`:
    step, energy, cap, best, ...); ``params`` (:class:`LoopParams`) are fixed. A run is resumed by
    calling again with a later ``stop_step``. ``time_frac``: the share of a time limit used, the
    least share of the cooling done. ``trace`` (length 0: off) receives, per step, the makespan,
    area above the cap and peak of the order the step starts from (the tests compare compiled and
    interpreted runs with it, step by step)."""
    seq2d, peak = orders.seq, orders.peak
    t0, t1, accept_tol = params.t0, params.t1, params.accept_tol
    rung, memory = params.rung, params.objective == MEMORY
    if state.started == 0:
        state.started = 1
        cap = np.inf  # the makespan: no area term
        if memory:
            cap = peak.max() if state.best_peak == np.inf else state.best_peak - params.cap_step * params.mem_unit
        _set_cap(cap, orders, over, state)
        if memory and state.makespan <= params.tol and state.area <= _EPS:
            _record(orders, over, walk, params, state)
        state.energy = _energy(state.makespan, state.area, params)
    if walk.ranks.shape[0] == 0:
        return DONE
    while state.step < stop_step:
        if _done(params, state):
            return DONE
        since = state.step - state.rung_start
        if since >= rung:  # cooled down without reaching the goal (the next level)
            if not memory:
                return CYCLE_END  # the driver starts the next cycle from the first order
            state.rung_start = state.step  # reheat
            since = 0
        temp = t0 * (t1 / t0) ** max(since / rung, time_frac)
        state.step += 1
        if trace.shape[0] >= state.step:
            row = state.step - 1
            trace[row, 0], trace[row, 1], trace[row, 2] = state.makespan, state.area, peak.max()
        state.limit = state.energy - temp * np.log(1.0 - _uniform(walk.rng))
        timed = False
        for _ in range(params.max_draws):
            kind, r, i, j = _propose(orders, graph, over, walk, params, state)
            if kind != NONE and try_move(kind, r, i, j, orders, graph, scratch, params, state):
                timed = True
                break
        if not timed:
            continue
        makespan = state.trial_makespan
        if makespan == np.inf or _energy(makespan, state.trial_area, params) > state.limit + accept_tol:
            shift(seq2d, state.trial_rank, state.trial_j, state.trial_i)  # revert
            continue
        commit_move(orders, graph, scratch, over, state)
        state.energy = _energy(makespan, state.area, params)
        if not memory:
            if makespan < state.best_makespan - _EPS:
                state.best_makespan = makespan
                walk.best[:, :] = seq2d
                state.has_best = 1
        elif makespan <= params.tol and (state.num_over == 0 or peak.max() < state.best_peak - _EPS):
            _record(orders, over, walk, params, state)
            state.rung_start = state.step
            state.energy = _energy(makespan, state.area, params)
    return DONE if _done(params, state) else STOPPED


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
    """One run of :func:`anneal_loop` on the arrays of ``order_state`` (an
    ``incremental.OrderState``, changed in place: it holds the loop's current order after a run)
    with ``params`` (:class:`LoopParams`; the hard cap is the order state's), the action
    ``classes`` (:func:`action_classes`) and the generator ``rng`` (:func:`mt_state`, or L'Ecuyer's
    two states), from the best makespan and peak known (``inf``: none) and step ``step``.
    ``compiled``: run the kernel compiled (default: whenever numba is available) or interpreted
    (the same steps). After a run: ``state`` (the record :data:`LOOP_STATE`), :meth:`best_seqs`."""

    def __init__(self, order_state, classes: np.ndarray, params: LoopParams, rng: np.ndarray,
                 best_makespan: float = math.inf, best_peak: float = math.inf, step: int = 0,
                 compiled: bool | None = None):
        self.order_state, orders = order_state, order_state.orders
        (num_ranks, longest), num_actions = orders.seq.shape, orders.start.shape[0]
        cap_max = math.inf if order_state.mem_cap is None else order_state.mem_cap
        self.params = params._replace(cap_max=cap_max).typed()
        self.state = new_state(makespan=order_state.makespan(), best_makespan=best_makespan, best_peak=best_peak,
                               num_critical=-1, step=step, rung_start=step)
        self.over = OverCap(np.full((num_ranks, longest), -1, dtype=np.int64),
                            np.zeros((num_ranks * longest + 1, 2), dtype=np.int64))
        movable = np.array([r for r, n in enumerate(orders.lens) if n > 1], dtype=np.int64)
        self.walk = Walk(classes=classes, ranks=movable, rng=rng, best=np.zeros_like(orders.seq),
                         critical=np.zeros((2 * num_actions + 2, 2), dtype=np.int64))
        self.time_frac = 0.0  # the share of the time limit used (time_cools)
        self.compiled = kernel.AVAILABLE if compiled is None else bool(compiled and kernel.AVAILABLE)
        self.fn = anneal_loop if self.compiled else kernel.interpreted(anneal_loop)

    @property
    def step(self) -> int:
        return int(self.state.step)

    def run(self, steps: int | None, seconds: float | None = None, trace: np.ndarray | None = None,
            time_cools: bool = False) -> int:
        """Anneal until ``steps`` (the loop's step count) or ``seconds`` from now, whichever comes
        first, or until the kernel returns DONE or CYCLE_END (what is returned; else STOPPED).
        Under a time limit the kernel runs in slices of :data:`SLICE_STEPS` steps with the clock
        read between them; with ``time_cools`` the share of the time used also sets the temperature."""
        stop = 2**62 if steps is None else steps
        deadline = None if seconds is None else time.perf_counter() + seconds
        trace = np.zeros((0, 3)) if trace is None else trace
        arrays = (self.order_state.orders, self.order_state.graph, self.order_state.scratch, self.over, self.walk,
                  self.params, self.state)
        out = STOPPED
        while deadline is None or time.perf_counter() < deadline:
            if deadline is not None and time_cools:
                self.time_frac = 1.0 - (deadline - time.perf_counter()) / seconds
            out = self.fn(*arrays, min(stop, self.step + SLICE_STEPS) if deadline is not None else stop,
                          self.time_frac, trace)
            if out != STOPPED or self.step >= stop:
                break
        return out

    def best_seqs(self) -> list[list[int]] | None:
        """The best order the run recorded (None: none)."""
        if not self.state.has_best:
            return None
        return [self.walk.best[r, :n].tolist() for r, n in enumerate(self.order_state.orders.lens)]
