"""Compiled inner loops of the fused-schedule search (RLHFuse, NSDI'25, arXiv 2409.13221, section 5:
the search scores every trial move by re-timing the schedule) and the named arrays they work on.

This module owns the structures every kernel reads (:class:`Orders`: a schedule as per-rank orders
with times and work and memory profiles; :class:`Graph`: the actions' dependencies and costs;
:class:`Scratch`: one trial move's work arrays) and the timing kernels over them: :func:`resim`, the
resumed list-scheduling pass of :class:`~systems.rlhfuse.intra.incremental.OrderState`,
:func:`move_closes_cycle`, the deadlock test before any timing, and :func:`critical_swaps`, the
critical-path trace that proposes the makespan moves (the algorithms: docs/FUSED_SEARCH.md,
"Timing engine"; why compiled: "Compiled kernels"). The annealing loop of both phases
(:func:`systems.rlhfuse.intra.loop.anneal_loop`) calls these. It also owns the greedy list
scheduler's pass, :func:`greedy_pass`, over :class:`GreedyInputs`, :class:`GreedyPriority` and
:class:`GreedyLimits`. Without numba (:mod:`harness.compiled`) they run interpreted, with the same
results; the tests compare both move by move.

Sizes in the field comments: ``R`` ranks, ``L`` actions on the longest rank, ``n`` actions. A
compiled call passes a structure as the descriptors of all its arrays, so the kernels every step
of the loop calls (:func:`resim`, :func:`move_closes_cycle`, the loop's proposal) are inlined into
their compiled callers (numba's ``inline='always'``), and the greedy pass's helpers take only the
arrays they read.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from harness.compiled import AVAILABLE, interpreted, njit  # noqa: F401 (re-exported for callers)

DEADLOCK = -1.0  # returned when a rank is left blocked


class Orders(NamedTuple):
    """A schedule as per-rank orders with every action's times and each rank's running work and
    activation memory (a committed move changes them in place)."""
    seq: np.ndarray         # (R, L) int: per rank, the action ids in order (-1 past the rank's length)
    lens: np.ndarray        # (R,) int: actions on each rank
    rank_of: np.ndarray     # (n,) int: each action's rank
    pos: np.ndarray         # (n,) int: each action's position on its rank
    start: np.ndarray       # (n,) float: start times
    end: np.ndarray         # (n,) float: end times
    work_done: np.ndarray   # (R, L) float: the rank's work up to and including each position
    work_total: np.ndarray  # (R,) float: each rank's work
    held: np.ndarray        # (R, L) float: activation memory the rank holds after each position
    peak: np.ndarray        # (R,) float: each rank's largest ``held``


class Graph(NamedTuple):
    """The actions' dependencies and costs (fixed for a model)."""
    dep_a: np.ndarray     # (n,) int: an action's first dependency (-1: none)
    dep_b: np.ndarray     # (n,) int: its second (-1: none)
    lat_a: np.ndarray     # (n,) float: the delay after the first dependency ends
    lat_b: np.ndarray     # (n,) float: after the second
    dur: np.ndarray       # (n,) float: duration
    tail: np.ndarray      # (n,) float: the longest chain of work that must still follow (incremental.chain_tails)
    delta: np.ndarray     # (n,) float: activation memory an action takes (> 0) or frees (< 0)
    succ_ptr: np.ndarray  # (n + 1,) int: dependants of v are succ_idx[succ_ptr[v]:succ_ptr[v + 1]]
    succ_idx: np.ndarray  # (edges,) int


class Scratch(NamedTuple):
    """Work arrays of one trial move: its times and memory values, what re-timing keeps per rank,
    and the deadlock test's depth-first search."""
    start: np.ndarray        # (n,) float: the trial's start times
    end: np.ndarray          # (n,) float: the trial's end times (-1: not re-timed yet)
    held: np.ndarray         # (L + 1,) float: the changed positions' new ``Orders.held``
    waiter: np.ndarray       # (n,) int: the first rank blocked on an action (-1: none; all -1 between calls)
    next_waiter: np.ndarray  # (R,) int: the next rank blocked on the same action
    blocked: np.ndarray      # (n,) int: actions some rank is blocked on
    firsts: np.ndarray       # (R,) int: each rank's first position not re-timed yet
    clock: np.ndarray        # (R,) float: each rank's time
    left: np.ndarray         # (R,) float: each rank's work still to re-time
    ready: np.ndarray        # (R,) int: stack of ranks that can go on
    mark: np.ndarray         # (n,) int: the search's visit stamps
    stack: np.ndarray        # (n,) int: its stack
    epoch: np.ndarray        # (1,) int: the last stamp used


def new_scratch(num_ranks: int, longest: int, num_actions: int) -> Scratch:
    n, room = num_actions, max(num_actions, 1)
    return Scratch(start=np.empty(n), end=np.empty(n), held=np.zeros(longest + 1),
                   waiter=np.full(n, -1, dtype=np.int64), next_waiter=np.full(num_ranks, -1, dtype=np.int64),
                   blocked=np.zeros(room, dtype=np.int64), firsts=np.zeros(num_ranks, dtype=np.int64),
                   clock=np.zeros(num_ranks), left=np.zeros(num_ranks),
                   ready=np.zeros(max(num_ranks, 1), dtype=np.int64),
                   mark=np.full(room, -1, dtype=np.int64), stack=np.zeros(room, dtype=np.int64),
                   epoch=np.zeros(1, dtype=np.int64))


@njit(cache=True, inline='always')
def resim(orders, graph, scratch, r, lo, t0, threshold):
    """Re-time every action of ``orders`` that started at or after ``t0`` (rank ``r`` from position
    ``lo``) into ``scratch.start`` / ``scratch.end`` (copied from ``orders`` first). Returns the
    makespan, ``inf`` once an action provably ends the schedule later than ``threshold``, or
    :data:`DEADLOCK`."""
    seq2d, lens, start, end = orders.seq, orders.lens, orders.start, orders.end
    dep_a, dep_b, lat_a, lat_b, dur, tail = graph.dep_a, graph.dep_b, graph.lat_a, graph.lat_b, graph.dur, graph.tail
    se, ss, waiter, next_waiter = scratch.end, scratch.start, scratch.waiter, scratch.next_waiter
    blocked, firsts, clock, left, ready = scratch.blocked, scratch.firsts, scratch.clock, scratch.left, scratch.ready
    total, cum2d = orders.work_total, orders.work_done
    n_actions = end.shape[0]
    for v in range(n_actions):
        se[v] = end[v]
        ss[v] = start[v]
    num_ranks = lens.shape[0]
    for q in range(num_ranks):
        n = lens[q]
        if q == r:
            k = lo
        else:  # first position whose action starts at or after t0 (starts grow along a rank)
            a, b = 0, n
            while a < b:
                mid = (a + b) // 2
                if start[seq2d[q, mid]] < t0:
                    a = mid + 1
                else:
                    b = mid
            k = a
        firsts[q] = k
        for x in range(k, n):
            se[seq2d[q, x]] = -1.0
        if k > 0:
            clock[q] = se[seq2d[q, k - 1]]
            left[q] = total[q] - cum2d[q, k - 1]
        else:
            clock[q] = 0.0
            left[q] = total[q]
    num_ready = 0
    for q in range(num_ranks - 1, -1, -1):
        ready[num_ready] = q
        num_ready += 1
    num_blocked = 0
    aborted = False
    while num_ready > 0:
        num_ready -= 1
        q = ready[num_ready]
        k, t, w_left = firsts[q], clock[q], left[q]
        n = lens[q]
        while k < n:
            v = seq2d[q, k]
            st = t
            waits_on = -1  # a dependency not re-timed yet: the rank blocks on it
            for which in range(2):
                d = dep_a[v] if which == 0 else dep_b[v]
                if d < 0:
                    break
                e = se[d]
                if e < 0.0:
                    waits_on = d
                    break
                e += lat_a[v] if which == 0 else lat_b[v]
                if e > st:
                    st = e
            if waits_on >= 0:
                if waiter[waits_on] < 0:
                    blocked[num_blocked] = waits_on
                    num_blocked += 1
                next_waiter[q] = waiter[waits_on]
                waiter[waits_on] = q
                break
            t = st + dur[v]
            se[v] = t
            ss[v] = st
            w_left -= dur[v]
            tl = tail[v]
            if t + (w_left if w_left > tl else tl) > threshold:
                aborted = True
                break
            k += 1
            w = waiter[v]
            if w >= 0:
                waiter[v] = -1
                while w >= 0:
                    ready[num_ready] = w
                    num_ready += 1
                    w = next_waiter[w]
        if aborted:
            break
        firsts[q], clock[q], left[q] = k, t, w_left
    for i in range(num_blocked):
        waiter[blocked[i]] = -1
    if aborted:
        return np.inf
    makespan = 0.0
    for q in range(num_ranks):
        n = lens[q]
        if firsts[q] < n:
            return DEADLOCK
        if n > 0:
            e = se[seq2d[q, n - 1]]
            if e > makespan:
                makespan = e
    return makespan


@njit(cache=True)
def _visit(w, limit, start, mark, epoch, stack, n):
    """Push ``w`` on the DFS stack (of ``n`` entries) if it starts by ``limit`` and is not yet
    stamped ``epoch``; returns the new stack size."""
    if start[w] <= limit and mark[w] != epoch:
        mark[w] = epoch
        stack[n] = w
        n += 1
    return n


@njit(cache=True, inline='always')
def move_closes_cycle(orders, graph, scratch, r, i, j):
    """Would moving the action at position ``i`` of rank ``r`` to position ``j`` close a cycle of
    dependency and same-rank edges (a deadlock)? The old graph is acyclic, so a new cycle must use
    the one new ordering the move makes (docs/FUSED_SEARCH.md, "Timing engine"); a DFS bounded by
    start times (a path ``u -> w`` implies ``start[u] <= start[w]``) looks for it, stamping the
    actions it visits in ``scratch.mark`` with a stamp not used before (``scratch.epoch``, raised)."""
    seq2d, lens, rank_of, pos, start = orders.seq, orders.lens, orders.rank_of, orders.pos, orders.start
    succ_ptr, succ_idx, mark, stack = graph.succ_ptr, graph.succ_idx, scratch.mark, scratch.stack
    scratch.epoch[0] += 1
    epoch = scratch.epoch[0]
    v = seq2d[r, i]
    n = 0
    if j < i:  # v goes before seq[j..i-1]: a cycle iff one of them reaches v other than along rank r
        limit = start[v]
        lo_t, hi_t = i, i
        for k in range(j, i):
            u = seq2d[r, k]
            for e in range(succ_ptr[u], succ_ptr[u + 1]):
                n = _visit(succ_idx[e], limit, start, mark, epoch, stack, n)
    else:  # v goes after seq[i+1..j]: a cycle iff v reaches one of them through its dependants
        limit = start[seq2d[r, j]]
        lo_t, hi_t = i + 1, j
        for e in range(succ_ptr[v], succ_ptr[v + 1]):
            n = _visit(succ_idx[e], limit, start, mark, epoch, stack, n)
    while n > 0:
        n -= 1
        u = stack[n]
        q = rank_of[u]
        if q == r and lo_t <= pos[u] <= hi_t:
            return True
        for e in range(succ_ptr[u], succ_ptr[u + 1]):
            n = _visit(succ_idx[e], limit, start, mark, epoch, stack, n)
        # the next action on u's rank; on rank r, when v moves earlier, that chain leads to v only
        # through the edge the move removes (seq[i-1] -> v), so it is not followed
        k = pos[u] + 1
        if k < lens[q] and not (j < i and q == r):
            n = _visit(seq2d[q, k], limit, start, mark, epoch, stack, n)
    return False


# Tie-breaking along a critical path uses this small generator (Lehmer / MINSTD: x -> 48271 x
# mod 2^31 - 1) seeded once per call from the search's ``random.Random``: the compiled and the
# interpreted function make the same choices, and the search stays a function of its seed.
LEHMER_MODULUS = 2147483647
LEHMER_MULTIPLIER = 48271


@njit(cache=True)
def critical_swaps(seed, orders, graph, out):
    """Trace one critical path of ``orders`` back from a last-finishing action and write the
    adjacent swaps at the two ends of each of its rank blocks into ``out`` (rows of (rank,
    position)); returns how many. See ``OrderState.critical_swaps`` for the rule and why."""
    seq2d, lens, rank_of, pos = orders.seq, orders.lens, orders.rank_of, orders.pos
    start, end = orders.start, orders.end
    dep_a, dep_b, lat_a, lat_b = graph.dep_a, graph.dep_b, graph.lat_a, graph.lat_b
    state = seed
    num_ranks = lens.shape[0]
    best = 0.0
    for q in range(num_ranks):
        if lens[q] > 0 and end[seq2d[q, lens[q] - 1]] > best:
            best = end[seq2d[q, lens[q] - 1]]
    num_lasts = 0
    for q in range(num_ranks):
        if lens[q] > 0 and end[seq2d[q, lens[q] - 1]] == best:
            num_lasts += 1
    x = -1
    if num_lasts > 0:
        state = state * LEHMER_MULTIPLIER % LEHMER_MODULUS
        pick = state % num_lasts
        for q in range(num_ranks):
            if lens[q] > 0 and end[seq2d[q, lens[q] - 1]] == best:
                if pick == 0:
                    x = seq2d[q, lens[q] - 1]
                    break
                pick -= 1
    count = 0
    block_last = -1
    options = np.empty(3, dtype=np.int64)
    while x >= 0:
        st = start[x]
        r, p = rank_of[x], pos[x]
        if block_last < 0:
            block_last = p
        num_options = 0
        if p > 0 and end[seq2d[r, p - 1]] == st:
            options[num_options] = seq2d[r, p - 1]
            num_options += 1
        d = dep_a[x]
        if d >= 0 and end[d] + lat_a[x] == st:
            options[num_options] = d
            num_options += 1
        d = dep_b[x]
        if d >= 0 and end[d] + lat_b[x] == st:
            options[num_options] = d
            num_options += 1
        if num_options > 1:
            state = state * LEHMER_MULTIPLIER % LEHMER_MODULUS
            nxt = options[state % num_options]
        elif num_options == 1:
            nxt = options[0]
        else:
            nxt = -1
        if nxt < 0 or rank_of[nxt] != r or pos[nxt] != p - 1:  # the block is p..block_last
            if block_last > p:
                out[count, 0], out[count, 1] = r, p
                count += 1
                if block_last - 1 != p:
                    out[count, 0], out[count, 1] = r, block_last - 1
                    count += 1
            block_last = -1
        x = nxt
    return count


# Policy codes of :func:`greedy_pass` (how the dynamic "same model as the rank's last action"
# flag enters the key; ``systems.rlhfuse.intra.greedy`` maps policy names to them).
KEY_STATIC, KEY_FLAG_SECOND, KEY_FLAG_FIRST = 0, 1, 2
GREEDY_EPS = 1e-9


class GreedyInputs(NamedTuple):
    """What the greedy pass reads of a model (fixed for it; ``M`` models)."""
    num_ranks: int
    home: np.ndarray            # (n,) int: each action's rank, 0 .. R - 1
    dur: np.ndarray             # (n,) float: duration
    delta: np.ndarray           # (n,) float: activation memory an action takes (> 0) or frees (< 0)
    is_fwd: np.ndarray          # (n,) bool: a forward
    model_of: np.ndarray        # (n,) int: the action's model, 0 .. M - 1
    static_rank: np.ndarray     # (n,) int: rank of the action's static priority (the last key, distinct)
    stage_slot: np.ndarray      # (n,) int: an id of the action's (pipe, stage)
    succ_ptr: np.ndarray        # (n + 1,) int: dependants of v are succ_idx[succ_ptr[v]:succ_ptr[v + 1]] ...
    succ_idx: np.ndarray        # (edges,) int
    succ_lat: np.ndarray        # (edges,) float: ... each after this delay
    num_deps: np.ndarray        # (n,) int: each action's dependencies
    need: np.ndarray            # (M, R) float: each model's largest activation on each rank
    models_present: np.ndarray  # (M,) bool: a model of these pipes


class GreedyPriority(NamedTuple):
    """A policy's priority of action ``v`` on a rank, smallest first: ``(k0, k1, static_rank[v])``
    with ``k0, k1 = key_a[v], key_b[v]`` (``mode`` ``KEY_STATIC``), ``key_a[v], same``
    (``KEY_FLAG_SECOND``) or ``same, key_a[v]`` (``KEY_FLAG_FIRST``), ``same`` = 1 when ``v``'s
    model ran the rank's previous action."""
    mode: int
    key_a: np.ndarray  # (n,) float
    key_b: np.ndarray  # (n,) float


class GreedyLimits(NamedTuple):
    """What a forward may not exceed: micro-batches in flight per (pipe, stage) and, with
    ``has_cap``, activation memory per rank (``cap``, with the banker's safety rule)."""
    in_flight: np.ndarray  # (n,) int, read at a stage_slot id: the in-flight limit of that (pipe, stage)
    cap: float
    has_cap: bool


class _GreedyMemory(NamedTuple):
    held: np.ndarray      # (R,) activation memory each rank holds
    held_by: np.ndarray   # (M, R) ... of each model
    room: np.ndarray      # (M, R) what each rank would hold with one more activation of the model
    room_max: np.ndarray  # (M,) the largest ``room`` of each model


@njit(cache=True)
def _greedy_allows(limits, memory, present, rank, model, act):
    """The memory guard's test (cap and banker's safety rule; ``greedy`` module docstring) of an
    activation ``act`` of ``model`` on ``rank`` (``present``: the models of these pipes)."""
    if not limits.has_cap or act <= 0:
        return True
    limit = limits.cap + GREEDY_EPS
    if memory.held[rank] + act > limit:
        return False
    room, room_max = memory.room, memory.room_max
    for x in range(room.shape[0]):
        if not present[x]:  # not a model of these pipes
            continue
        at_rank = room[x, rank] + (act if model != x else 0.0)
        if room_max[x] <= limit and at_rank <= limit:
            return True
    return False


@njit(cache=True)
def _greedy_add(has_cap, memory, need, present, rank, model, delta):
    """``rank`` takes (frees) ``delta`` of ``model``'s activations; with a cap, the room left anew."""
    held, held_by, room, room_max = memory.held, memory.held_by, memory.room, memory.room_max
    held[rank] += delta
    held_by[model, rank] += delta
    if not has_cap:
        return
    for x in range(room.shape[0]):
        if not present[x]:
            continue
        room[x, rank] = held[rank] - held_by[x, rank] + need[x, rank]
        best = room[x, 0]
        for q in range(1, room.shape[1]):
            if room[x, q] > best:
                best = room[x, q]
        room_max[x] = best


@njit(cache=True)
def greedy_pass(inputs, priority, limits, placed):
    """The event-driven greedy list schedule of ``systems.rlhfuse.intra.greedy`` (read that
    docstring for the rules) over arrays, by ``priority`` (:class:`GreedyPriority`) within
    ``limits``. Writes the actions in the order they start into ``placed`` and returns how many
    (fewer than all: stuck; the time is returned beside)."""
    num_ranks, home, dur, delta, is_fwd = inputs.num_ranks, inputs.home, inputs.dur, inputs.delta, inputs.is_fwd
    act_model, srank, stage_slot, need = inputs.model_of, inputs.static_rank, inputs.stage_slot, inputs.need
    succ_ptr, succ_idx, succ_lat = inputs.succ_ptr, inputs.succ_idx, inputs.succ_lat
    models_present = inputs.models_present
    key_mode, key_a, key_b, limit = priority.mode, priority.key_a, priority.key_b, limits.in_flight
    n = home.shape[0]
    num_models = need.shape[0]
    memory = _GreedyMemory(np.zeros(num_ranks), np.zeros((num_models, num_ranks)), np.zeros((num_models, num_ranks)),
                           np.zeros(num_models))
    room, room_max = memory.room, memory.room_max
    for x in range(num_models):
        if models_present[x]:
            for q in range(num_ranks):
                room[x, q] = need[x, q]
            best = room[x, 0]
            for q in range(1, num_ranks):
                if room[x, q] > best:
                    best = room[x, q]
            room_max[x] = best
    avail = np.empty((num_ranks, n), dtype=np.int64)  # per rank: actions whose inputs have ended
    num_avail = np.zeros(num_ranks, dtype=np.int64)
    for v in range(n):
        if inputs.num_deps[v] == 0:
            avail[home[v], num_avail[home[v]]] = v
            num_avail[home[v]] += 1
    ready_at = np.zeros(n)
    in_flight = np.zeros(n, dtype=np.int64)
    last_model = np.full(num_ranks, -1, dtype=np.int64)
    run_end = np.full(num_ranks, np.inf)  # the one action a busy rank runs, and when it ends
    run_v = np.full(num_ranks, -1, dtype=np.int64)
    missing = inputs.num_deps.copy()
    t = 0.0
    done = 0
    num_placed = 0
    while done < n:
        for r in range(num_ranks):
            if run_v[r] >= 0 or num_avail[r] == 0:
                continue
            best, best_i = -1, -1
            b0, b1, b2 = 0.0, 0.0, 0
            for i in range(num_avail[r]):
                v = avail[r, i]
                if ready_at[v] > t + GREEDY_EPS:
                    continue
                same = 1.0 if act_model[v] == last_model[r] else 0.0
                if key_mode == KEY_STATIC:
                    k0, k1 = key_a[v], key_b[v]
                elif key_mode == KEY_FLAG_SECOND:
                    k0, k1 = key_a[v], same
                else:
                    k0, k1 = same, key_a[v]
                k2 = srank[v]
                if best >= 0 and not (k0 < b0 or (k0 == b0 and (k1 < b1 or (k1 == b1 and k2 < b2)))):
                    continue
                if is_fwd[v] and (in_flight[stage_slot[v]] >= limit[stage_slot[v]] or
                                  not _greedy_allows(limits, memory, models_present, r, act_model[v], delta[v])):
                    continue
                best, best_i, b0, b1, b2 = v, i, k0, k1, k2
            if best < 0:
                continue
            num_avail[r] -= 1
            avail[r, best_i] = avail[r, num_avail[r]]
            placed[num_placed] = best
            num_placed += 1
            last_model[r] = act_model[best]
            if is_fwd[best]:
                in_flight[stage_slot[best]] += 1
                _greedy_add(limits.has_cap, memory, need, models_present, r, act_model[best], delta[best])
            run_v[r] = best
            run_end[r] = t + dur[best]
        # next event: an action ends, or an available action's input arrives on an idle rank
        nxt = np.inf
        for r in range(num_ranks):
            if run_v[r] >= 0:
                continue
            for i in range(num_avail[r]):
                a = ready_at[avail[r, i]]
                if a > t + GREEDY_EPS and a < nxt:
                    nxt = a
        first_end = np.inf
        for r in range(num_ranks):
            if run_end[r] < first_end:
                first_end = run_end[r]
        if first_end <= nxt:
            nxt = first_end
        if nxt == np.inf:
            return num_placed, t
        t = nxt
        for r in range(num_ranks):
            if run_v[r] < 0 or run_end[r] > t + GREEDY_EPS:
                continue
            v, end = run_v[r], run_end[r]
            run_v[r], run_end[r] = -1, np.inf
            done += 1
            if not is_fwd[v]:
                in_flight[stage_slot[v]] -= 1
                _greedy_add(limits.has_cap, memory, need, models_present, r, act_model[v], delta[v])
            for j in range(succ_ptr[v], succ_ptr[v + 1]):
                w = succ_idx[j]
                if end + succ_lat[j] > ready_at[w]:
                    ready_at[w] = end + succ_lat[j]
                missing[w] -= 1
                if missing[w] == 0:
                    avail[home[w], num_avail[home[w]]] = w
                    num_avail[home[w]] += 1
    return num_placed, t
