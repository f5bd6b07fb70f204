"""Compiled inner loops of the fused-schedule annealer (RLHFuse, NSDI'25, arXiv 2409.13221,
section 5: the search scores every trial move by re-timing the schedule): :func:`resim`, the
resumed list-scheduling pass of :class:`~systems.rlhfuse.intra.incremental.OrderState`,
:func:`move_closes_cycle`, the deadlock test before any timing, and :func:`critical_swaps`, the
critical-path trace that proposes the makespan moves (the algorithms: docs/FUSED_SEARCH.md,
"Timing engine"; why compiled: "Compiled kernels"). The annealing loop of both phases
(:func:`systems.rlhfuse.intra.loop.anneal_loop`) calls these. Without numba (:mod:`harness.compiled`)
they run interpreted, with the same results; the tests compare both move by move.
"""
from __future__ import annotations

import numpy as np

from harness.compiled import AVAILABLE, interpreted, njit  # noqa: F401 (re-exported for callers)

DEADLOCK = -1.0  # returned when a rank is left blocked


@njit(cache=True)
def resim(seq2d, lens, r, lo, t0, threshold, start, end, se, ss, dep_a, dep_b, lat_a, lat_b,
          dur, tail, total, cum2d, waiter, next_waiter, blocked, firsts, clock, left, ready):
    """Re-time every action that started at or after ``t0`` (rank ``r`` from position ``lo``) into
    ``se``/``ss`` (end/start scratch, overwritten from ``end``/``start`` first). ``waiter`` must
    be all -1 on entry and is left so. Returns the makespan, ``inf`` once an action provably ends
    the schedule later than ``threshold``, or :data:`DEADLOCK`."""
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


@njit(cache=True)
def move_closes_cycle(seq2d, lens, rank_of, pos, start, succ_ptr, succ_idx, r, i, j, mark, epoch, stack):
    """Would moving the action at position ``i`` of rank ``r`` to position ``j`` close a cycle of
    dependency and same-rank edges (a deadlock)? The old graph is acyclic, so a new cycle must use
    the one new ordering the move makes (docs/FUSED_SEARCH.md, "Timing engine"); a DFS bounded by
    start times (a path ``u -> w`` implies ``start[u] <= start[w]``) looks for it. ``mark`` holds
    visit stamps, ``epoch`` a stamp not used before; ``stack`` has room for every action."""
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
def critical_swaps(seed, seq2d, lens, rank_of, pos, start, end, dep_a, dep_b, lat_a, lat_b, out):
    """Trace one critical path back from a last-finishing action and write the adjacent swaps at
    the two ends of each of its rank blocks into ``out`` (rows of (rank, position)); returns how
    many. See ``OrderState.critical_swaps`` for the rule and why."""
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


@njit(cache=True)
def _greedy_allows(cap, has_cap, rank, model, act, held, room, room_max, present):
    """The memory guard's test (cap and banker's safety rule; ``greedy`` module docstring)."""
    if not has_cap or act <= 0:
        return True
    limit = cap + GREEDY_EPS
    if held[rank] + act > limit:
        return False
    for x in range(room.shape[0]):
        if not present[x]:  # not a model of these pipes
            continue
        at_rank = room[x, rank] + (act if model != x else 0.0)
        if room_max[x] <= limit and at_rank <= limit:
            return True
    return False


@njit(cache=True)
def _greedy_add(has_cap, rank, model, delta, held, held_by, need, room, room_max, present):
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
def greedy_pass(num_ranks, home, dur, delta, is_fwd, act_model, key_a, key_b, srank, key_mode, stage_slot,
                limit, succ_ptr, succ_idx, succ_lat, missing, cap, has_cap, need, models_present, placed):
    """The event-driven greedy list schedule of ``systems.rlhfuse.intra.greedy`` (read that
    docstring for the rules) over arrays. Priority of action ``v`` on rank ``r``, smallest first:
    ``(k0, k1, srank[v])`` with ``k0, k1 = key_a[v], key_b[v]`` (``KEY_STATIC``), ``key_a[v], same``
    (``KEY_FLAG_SECOND``) or ``same, key_a[v]`` (``KEY_FLAG_FIRST``), ``same`` = 1 when ``v``'s
    model ran the rank's previous action. Writes the actions in the order they start into
    ``placed`` and returns how many (fewer than all: stuck; the time is returned beside)."""
    n = home.shape[0]
    num_models = need.shape[0]
    held = np.zeros(num_ranks)
    held_by = np.zeros((num_models, num_ranks))
    room = np.zeros((num_models, num_ranks))
    room_max = np.zeros(num_models)
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
        if missing[v] == 0:
            avail[home[v], num_avail[home[v]]] = v
            num_avail[home[v]] += 1
    ready_at = np.zeros(n)
    in_flight = np.zeros(n, dtype=np.int64)
    last_model = np.full(num_ranks, -1, dtype=np.int64)
    run_end = np.full(num_ranks, np.inf)  # the one action a busy rank runs, and when it ends
    run_v = np.full(num_ranks, -1, dtype=np.int64)
    missing = missing.copy()
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
                                  not _greedy_allows(cap, has_cap, r, act_model[v], delta[v], held, room, room_max,
                                                 models_present)):
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
                _greedy_add(has_cap, r, act_model[best], delta[best], held, held_by, need, room, room_max,
                            models_present)
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
                _greedy_add(has_cap, r, act_model[v], delta[v], held, held_by, need, room, room_max, models_present)
            for j in range(succ_ptr[v], succ_ptr[v + 1]):
                w = succ_idx[j]
                if end + succ_lat[j] > ready_at[w]:
                    ready_at[w] = end + succ_lat[j]
                missing[w] -= 1
                if missing[w] == 0:
                    avail[home[w], num_avail[home[w]]] = w
                    num_avail[home[w]] += 1
    return num_placed, t
