"""Incremental re-timing of per-rank orders under adjacent swaps: the evaluation engine of the
RLHFuse schedule annealer (NSDI'25, arXiv 2409.13221, section 5).

This module owns :class:`OrderState`: a schedule in the encoded form of
``harness.schedule.simulate.SimModel`` (per-rank lists of action ids) together with every
action's start/end time and each rank's running activation memory, and the one move the
annealer makes: swap two adjacent actions on one rank.

Timing is ``simulate``'s list-scheduling rule, so a state always agrees with
``harness.schedule.simulate`` (the tests check this after long random walks). Rather than
re-simulating every action after a swap, :meth:`OrderState.try_swap` re-times only what the swap
can change. View the schedule as a DAG whose edges are the dependency edges plus "next on the same
rank"; an action's start is the max over its in-edges of (predecessor end + latency). Swapping
``a, b`` (``a`` first) on rank ``r`` replaces the rank edges ``p->a->b->n`` by ``p->b->a->n``.

- **Deadlock**: the new graph has a cycle iff ``b`` is reachable from ``a`` in the old graph
  other than through the edge ``a->b`` (any other new edge is implied by an old path). Times grow
  along every path, so the search only visits actions that started no later than ``b``: a short,
  time-bounded DFS. (This is the deadlock that ``simulate`` would report as ScheduleError.)
- **Memory**: the activation profile of a rank depends only on its list order; the swap changes
  one prefix sum (after position ``i``), so the cap test and the new peak are O(1) (a rank's peak
  is recomputed only when its old peak position was lowered).
- **Times**: only descendants of ``a`` and ``b`` in the new graph can move. They are re-timed with
  a priority queue keyed by their *old* start time (``b`` first, then ``a``); apart from the swapped
  pair, old start times order every changed action after its predecessors, so each action is
  re-timed once, and propagation stops wherever a recomputed start equals the old one.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from harness.schedule import ScheduleError, SimModel

_EPS = 1e-9
ABORTED = float("inf")  # makespan reported for a trial swap cut short by its threshold


def chain_tails(model: SimModel) -> list[float]:
    """Per action: the longest chain of dependent work that must still follow it (the later
    forwards and backwards of its micro-batch, with latencies): the "bottom level" of classic
    critical-path list scheduling, and a lower bound on how long the schedule lasts after it."""
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


class OrderState:
    """Per-rank orders (encoded ids) with cached timing and memory; supports trial swaps."""

    def __init__(self, model: SimModel, seqs: Sequence[Sequence[int]], mem_cap: float | None = None,
                 tails: list[float] | None = None):
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
        self.prefix: list[list[float]] = []  # memory held after each position
        self.after: list[list[float]] = []   # work left on the rank after each position
        self.peak: list[float] = []
        for seq in self.seqs:
            run, pm = 0.0, []
            for v in seq:
                run += self.delta[v]
                pm.append(run)
            left, af = 0.0, [0.0] * len(seq)
            for k in range(len(seq) - 1, -1, -1):
                af[k] = left
                left += self.dur[seq[k]]
            self.prefix.append(pm)
            self.after.append(af)
            self.peak.append(max(pm, default=0.0))
        self._pending: tuple | None = None

    # ---- whole-schedule quantities -------------------------------------------------------
    def retime(self) -> None:
        """Full list-scheduling pass (``SimModel.run``); raises ScheduleError on deadlock."""
        end, start, _, _, pos = self.model.run(self.seqs, want_start=True)
        if any(p < len(s) for p, s in zip(pos, self.seqs)):
            raise ScheduleError("order deadlocks")
        self.start, self.end = start, end

    def makespan(self) -> float:
        end = self.end
        return max((end[s[-1]] for s in self.seqs if s), default=0.0)

    def max_peak(self) -> float:
        return max(self.peak, default=0.0)

    def snapshot(self) -> list[list[int]]:
        return [list(s) for s in self.seqs]

    # ---- trial moves ---------------------------------------------------------------------
    def _reaches(self, a: int, b: int) -> bool:
        """Is ``b`` reachable from ``a`` without the rank edge ``a -> b``? (time-bounded DFS)"""
        start, dsucc, seqs, rank_of, pos = self.start, self.dsucc, self.seqs, self.rank_of, self.pos
        limit = start[b]
        stack = [v for v in dsucc[a] if start[v] <= limit]
        seen = set(stack)
        while stack:
            u = stack.pop()
            if u == b:
                return True
            seq = seqs[rank_of[u]]
            k = pos[u] + 1
            nxt = list(dsucc[u])
            if k < len(seq):
                nxt.append(seq[k])
            for w in nxt:
                if w not in seen and start[w] <= limit:
                    seen.add(w)
                    stack.append(w)
        return False

    def try_swap(self, r: int, i: int, threshold: float = ABORTED) -> tuple[float, float] | None:
        """Tentatively swap positions ``i, i+1`` of rank ``r``. Returns None (nothing changed) if
        the swap would deadlock or break the memory cap; otherwise ``(makespan, max peak)`` of
        the new order, where the makespan is :data:`ABORTED` as soon as re-timing proves it would
        exceed ``threshold`` (an action's new end plus the work left after it on its rank, or
        plus its chain tail). Follow with :meth:`commit` (not after an abort) or :meth:`revert`."""
        seq = self.seqs[r]
        a, b = seq[i], seq[i + 1]
        if self.dep_a[b] == a or self.dep_b[b] == a:
            return None
        pm = self.prefix[r]
        new_val = (pm[i - 1] if i > 0 else 0.0) + self.delta[b]
        if self.mem_cap is not None and new_val > self.mem_cap + _EPS:
            return None
        if self._reaches(a, b):
            return None
        seq[i], seq[i + 1] = b, a
        pos = self.pos
        pos[a], pos[b] = i + 1, i
        af = self.after[r]
        old_after = af[i]
        af[i] = af[i + 1] + self.dur[a]
        old_peak = self.peak[r]
        if new_val >= old_peak:
            rank_peak = new_val
        elif pm[i] < old_peak:
            rank_peak = old_peak
        else:
            rank_peak = max(max(pm[:i], default=new_val), new_val, max(pm[i + 1:], default=new_val))
        max_peak = rank_peak
        for q, pk in enumerate(self.peak):
            if q != r and pk > max_peak:
                max_peak = pk
        ns, ne = self._propagate(r, i, a, b, threshold)
        self._pending = (r, i, ns, ne, new_val, rank_peak, old_after)
        if ns is None:
            return ABORTED, max_peak
        end = self.end
        makespan = 0.0
        for s in self.seqs:
            if s:
                x = s[-1]
                e = ne.get(x)
                if e is None:
                    e = end[x]
                if e > makespan:
                    makespan = e
        return makespan, max_peak

    def _propagate(self, r: int, i: int, a: int, b: int, threshold: float):
        """New start/end of every action the swap moves (dicts), or (None, None) on abort."""
        start, end, dur, tail = self.start, self.end, self.dur, self.tail
        dep_a, dep_b, lat_a, lat_b = self.dep_a, self.dep_b, self.lat_a, self.lat_b
        dsucc, seqs, rank_of, pos, after = self.dsucc, self.seqs, self.rank_of, self.pos, self.after
        ns: dict[int, float] = {}
        ne: dict[int, float] = {}
        t0 = start[a]
        heap = [(t0, -2, b), (t0, -1, a)]
        queued = {a, b}
        seq = seqs[r]
        if i + 2 < len(seq):
            n_ = seq[i + 2]
            heap.append((start[n_], n_, n_))
            queued.add(n_)
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, _, v = pop(heap)
            queued.discard(v)
            rv = rank_of[v]
            rq = seqs[rv]
            p = pos[v]
            st = 0.0
            if p > 0:
                u = rq[p - 1]
                e = ne.get(u)
                st = end[u] if e is None else e
            d = dep_a[v]
            if d >= 0:  # only a backward has dep_b, and it always has dep_a (its own forward)
                e = ne.get(d)
                e = (end[d] if e is None else e) + lat_a[v]
                if e > st:
                    st = e
                d = dep_b[v]
                if d >= 0:
                    e = ne.get(d)
                    e = (end[d] if e is None else e) + lat_b[v]
                    if e > st:
                        st = e
            old = ns.get(v)
            if old is None:
                old = start[v]
            if st == old:
                continue
            e = st + dur[v]
            if st > old:
                rest = after[rv][p]
                if tail[v] > rest:
                    rest = tail[v]
                if e + rest > threshold:
                    return None, None
            ns[v] = st
            ne[v] = e
            if p + 1 < len(rq):
                w = rq[p + 1]
                if w not in queued:
                    queued.add(w)
                    push(heap, (start[w], w, w))
            for w in dsucc[v]:
                if w not in queued:
                    queued.add(w)
                    push(heap, (start[w], w, w))
        return ns, ne

    def pending_rank_peak(self) -> tuple[int, float]:
        """(rank, its new peak) of the trial swap awaiting commit/revert."""
        return self._pending[0], self._pending[5]

    def commit(self) -> None:
        r, i, ns, ne, new_val, rank_peak, _ = self._pending
        start, end = self.start, self.end
        for v, s in ns.items():
            start[v] = s
        for v, e in ne.items():
            end[v] = e
        self.prefix[r][i] = new_val
        self.peak[r] = rank_peak
        self._pending = None

    def revert(self) -> None:
        r, i, old_after = self._pending[0], self._pending[1], self._pending[6]
        seq = self.seqs[r]
        a, b = seq[i + 1], seq[i]
        seq[i], seq[i + 1] = a, b
        self.pos[a], self.pos[b] = i, i + 1
        self.after[r][i] = old_after
        self._pending = None

    # ---- critical path ---------------------------------------------------------------------
    def critical_swaps(self, rng) -> list[tuple[int, int]]:
        """Trace one critical path back from a last-finishing action (ties broken with ``rng``)
        and return the adjacent swaps at the two ends of each of its rank blocks (runs of
        consecutive actions on one rank, each starting as the previous ends). As in job-shop
        scheduling (the N5 neighbourhood of Nowicki and Smutnicki), reordering inside a block
        keeps the path as long as it was, so only swaps at block ends can lower the makespan."""
        start, end, seqs, rank_of, pos = self.start, self.end, self.seqs, self.rank_of, self.pos
        dep_a, dep_b, lat_a, lat_b = self.dep_a, self.dep_b, self.lat_a, self.lat_b
        best = max((end[s[-1]] for s in seqs if s), default=0.0)
        lasts = [s[-1] for s in seqs if s and end[s[-1]] == best]
        x = lasts[rng.randrange(len(lasts))] if lasts else -1
        swaps: list[tuple[int, int]] = []
        block_last = -1  # position of the current block's last action
        while x >= 0:
            st = start[x]
            r, p = rank_of[x], pos[x]
            if block_last < 0:
                block_last = p
            options = []
            if p > 0 and end[seqs[r][p - 1]] == st:
                options.append(seqs[r][p - 1])
            for d, lat in ((dep_a[x], lat_a[x]), (dep_b[x], lat_b[x])):
                if d >= 0 and end[d] + lat == st:
                    options.append(d)
            nxt = options[rng.randrange(len(options))] if len(options) > 1 else (
                options[0] if options else -1)
            if nxt < 0 or rank_of[nxt] != r or pos[nxt] != p - 1:  # the block is p..block_last
                if block_last > p:
                    swaps.append((r, p))
                    if block_last - 1 != p:
                        swaps.append((r, block_last - 1))
                block_last = -1
            x = nxt
        return swaps
