"""Compiled list-scheduling pass of :class:`harness.schedule.simulate.SimModel` (docs/DESIGN.md
section 4).

This module owns :func:`list_schedule`, the O(number of actions) worklist over ranks that times
encoded per-rank orders: a rank runs its actions in list order, each starting at the later of the
rank's clock and each dependency's end plus its latency; a rank that reaches an action whose
dependency has not run yet registers on that dependency (a linked list of waiting ranks per
action) and is woken when it runs. The arithmetic is the same as the interpreted pass it
replaced, in the same order for every action, so the times are bit-identical; the order in which
ranks are processed does not change any time (an action's start depends only on its inputs).

Compiled with numba when available (:mod:`harness.compiled`); planners run this pass hundreds of
times per plan, and in Python it was the largest single cost of RLHFuse's candidate screening.
"""
from __future__ import annotations

import numpy as np

from harness.compiled import njit

OK = -1  # ``list_schedule``'s status when no action appeared twice


@njit(cache=True)
def list_schedule(flat, offsets, dep_a, dep_b, lat_a, lat_b, dur, mem_delta, end, start, clock, peak, pos):
    """Time the orders ``flat[offsets[r]:offsets[r + 1]]`` of every rank ``r``. Fills ``end`` (-1
    for an action that never ran), ``start``, and per rank ``clock`` (its finish time), ``peak``
    (largest running sum of ``mem_delta`` in list order) and ``pos`` (how far it got: fewer than
    its actions means it is blocked). Returns :data:`OK`, or the id of an action met a second
    time (the pass stops there)."""
    num_actions = end.shape[0]
    num_ranks = offsets.shape[0] - 1
    for v in range(num_actions):
        end[v] = -1.0
        start[v] = 0.0
    waiter = np.full(num_actions, -1, dtype=np.int64)  # first rank blocked on each action
    next_waiter = np.full(num_ranks, -1, dtype=np.int64)  # the next rank blocked on the same one
    mem = np.zeros(num_ranks)
    ready = np.empty(num_ranks, dtype=np.int64)
    num_ready = 0
    for q in range(num_ranks - 1, -1, -1):
        clock[q] = 0.0
        peak[q] = 0.0
        pos[q] = 0
        ready[num_ready] = q
        num_ready += 1
    while num_ready > 0:
        num_ready -= 1
        r = ready[num_ready]
        i, t, m, pk = pos[r], clock[r], mem[r], peak[r]
        n = offsets[r + 1] - offsets[r]
        base = offsets[r]
        while i < n:
            a = flat[base + i]
            st = t
            waits_on = -1
            d = dep_a[a]
            if d >= 0:
                e = end[d]
                if e < 0.0:
                    waits_on = d
                else:
                    e += lat_a[a]
                    if e > st:
                        st = e
            if waits_on < 0:
                d = dep_b[a]
                if d >= 0:
                    e = end[d]
                    if e < 0.0:
                        waits_on = d
                    else:
                        e += lat_b[a]
                        if e > st:
                            st = e
            if waits_on >= 0:
                next_waiter[r] = waiter[waits_on]
                waiter[waits_on] = r
                break
            if end[a] >= 0.0:
                pos[r], clock[r], mem[r], peak[r] = i, t, m, pk
                return a
            t = st + dur[a]
            end[a] = t
            start[a] = st
            m += mem_delta[a]
            if m > pk:
                pk = m
            i += 1
            w = waiter[a]
            if w >= 0:
                waiter[a] = -1
                while w >= 0:
                    ready[num_ready] = w
                    num_ready += 1
                    w = next_waiter[w]
        pos[r], clock[r], mem[r], peak[r] = i, t, m, pk
    return OK
