"""Greedy list scheduler for fused pipelines: the starting point of the RLHFuse schedule search
(NSDI'25, arXiv 2409.13221, section 5: "we first generate a schedule greedily, prioritising the
larger model, then refine it with simulated annealing").

This module owns one event-driven pass over (pipes, costs) that emits a valid per-rank order:

- time advances from event to event (an action ends, or a waiting action's input arrives after
  its ``p2p`` delay); whenever a rank is idle it picks among its *ready* actions (every
  dependency has ended and arrived by now);
- priority (``policy="larger"``, the paper's rule and the default): the larger model first
  (larger mean per-stage ``F + B`` per micro-batch; model 1 on ties), then backward before
  forward (frees activation memory), then the lower micro-batch, then the pipe name;
- more policies give the annealer other starting points (``search`` tries them all and
  anneals from the best), each falling back on the paper's order to break ties:
  ``"alternate"`` -- backward before forward, then the model that did *not* run the rank's
  previous action (the two models interleave like a bidirectional pipeline);
  ``"alternate_model"`` -- the other model first, then backward before forward;
  ``"critical_path"`` -- the longest chain of dependent work still to follow first (classic
  critical-path list scheduling: early-stage forwards, last-stage backwards);
  ``"fifo"`` -- the lowest micro-batch first, then the longest chain. On two equal models the
  paper's fixed preference floods the ranks with model-1 forwards and starves model 2's pipeline
  (16+16 stages, 16+16 micro-batches: 151 vs a lower bound of 117 in units of one forward);
  the other orders keep both pipelines moving;
- ``window`` (optional): at most ``ceil(window * (S - s))`` micro-batches in flight on stage ``s``
  of an ``S``-stage pipe (``window=1`` is 1F1B's limit); this bounds memory without a cap;
- memory (when ``mem_cap`` is given): a forward may start only if the rank's in-flight
  activation memory stays within the cap *and* the state stays safe, in the banker's-algorithm
  sense: for some model ``x``, every rank keeps room for one more activation of ``x`` on top of
  what the other models hold. Then ``x`` can always make progress on its own (the micro-batch
  furthest ahead in a pipe of ``x`` moves into a stage that holds no activation of ``x``; a ready
  backward never needs memory), and once ``x`` is done the others can, so the greedy pass never
  deadlocks with a cap that admits one activation of each model per rank. Without this rule two
  models can fill each other's ranks with activations whose backwards wait on forwards that no
  longer fit (e.g. 2+2 stages, cap 2).

The timing it follows is exactly ``harness.schedule.simulate``'s, so its makespan is the
simulated makespan of the order it returns.
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping
from math import ceil, inf

from harness.schedule import PipeCosts, PipeSpec, Schedule, ScheduleError, sim_model
from systems.rlhfuse.intra.incremental import chain_tails
from systems.rlhfuse.intra.pipes import model_index

_EPS = 1e-9


def model_priority(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts]) -> dict[str, int]:
    """Pipe name -> priority class (0 = scheduled first): models sorted by mean per-stage
    ``F + B`` (larger first), ties by model order (model 1 first)."""
    index = model_index(pipes)
    totals: dict[int, list[float]] = {}
    for name, pipe in pipes.items():
        cost = costs[name]
        totals.setdefault(index[name], []).extend(
            cost.fwd[s] + cost.bwd[s] for s in range(pipe.num_stages))
    mean = {m: sum(v) / len(v) for m, v in totals.items()}
    ranking = sorted(mean, key=lambda m: (-mean[m], m))
    return {name: ranking.index(index[name]) for name in pipes}


class _MemoryGuard:
    """Per-rank in-flight activation memory and the cap + safety test (module docstring).

    For each model ``x`` it keeps, per rank, ``held - held by x + need of x`` (what the rank
    would hold with one more activation of ``x`` in place of all of ``x``'s) and its maximum over
    the ranks, so that the safety test is O(models) per query instead of O(models x ranks)."""

    def __init__(self, cap: float | None, num_ranks: int, models: list[int], need: list[list[float]]):
        self.cap = cap
        self.held = [0.0] * num_ranks
        self.held_by = {m: [0.0] * num_ranks for m in models}
        self.need = need  # need[m][r]: largest activation of model m on rank r (0 if none)
        self.models = models
        self.room = {x: [self.held[r] - self.held_by[x][r] + need[x][r] for r in range(num_ranks)]
                     for x in models}
        self.room_max = {x: max(self.room[x], default=0.0) for x in models}

    def allows(self, rank: int, model: int, act: float) -> bool:
        if self.cap is None or act <= 0:
            return True
        cap = self.cap + _EPS
        if self.held[rank] + act > cap:
            return False
        for x in self.models:
            # max over ranks of room, with this activation added on ``rank`` if it is not x's
            at_rank = self.room[x][rank] + (act if model != x else 0.0)
            if self.room_max[x] <= cap and at_rank <= cap:
                return True
        return False

    @classmethod
    def for_model(cls, cap: float | None, num_ranks: int, act_model: list[int], home: list[int],
                  delta: list[float]) -> "_MemoryGuard":
        models = sorted(set(act_model))
        need = [[0.0] * num_ranks for _ in range(max(models) + 1)]
        for v, m in enumerate(act_model):
            need[m][home[v]] = max(need[m][home[v]], delta[v])
        return cls(cap, num_ranks, models, need)

    def add(self, rank: int, model: int, delta: float) -> None:
        self.held[rank] += delta
        self.held_by[model][rank] += delta
        if self.cap is None:
            return
        for x in self.models:
            room = self.room[x]
            room[rank] = self.held[rank] - self.held_by[x][rank] + self.need[x][rank]
            self.room_max[x] = max(room)


POLICIES = ("larger", "alternate", "alternate_model", "critical_path", "fifo")


def _priority(policy: str, static: list[tuple], tail: list[float], act_model: list[int],
              last_model: list[int]):
    """The key function of a policy: ``key(action, rank)``, smaller runs first."""
    if policy == "larger":
        return lambda v, r: static[v]
    if policy == "critical_path":
        return lambda v, r: (-tail[v], *static[v])
    if policy == "fifo":
        return lambda v, r: (static[v][2], -tail[v], *static[v])
    if policy == "alternate":
        return lambda v, r: (static[v][1], act_model[v] == last_model[r], *static[v])
    return lambda v, r: (act_model[v] == last_model[r], static[v][1], *static[v])


def _stage_limits(pipes: Mapping[str, PipeSpec], acts: list, window: float | None):
    """Per action: an id of its (pipe, stage), and the in-flight limit of each such id."""
    slot = {(a.pipe, a.stage): i for i, a in enumerate(acts) if a.kind == "F" and a.mb == 0}
    stage_slot = [slot[(a.pipe, a.stage)] for a in acts]
    limit = [len(acts)] * len(acts)
    if window is not None:
        for v, a in enumerate(acts):
            limit[stage_slot[v]] = max(1, ceil(window * (pipes[a.pipe].num_stages - a.stage)))
    return stage_slot, limit


def _dependents(model) -> tuple[list[list[tuple[int, float]]], list[int]]:
    """Per action: (dependent action, latency) pairs, and how many dependencies it has."""
    succs: list[list[tuple[int, float]]] = [[] for _ in range(model.num_actions)]
    missing = [0] * model.num_actions
    for v in range(model.num_actions):
        for d, lat in ((model.dep_a[v], model.lat_a[v]), (model.dep_b[v], model.lat_b[v])):
            if d >= 0:
                succs[d].append((v, lat))
                missing[v] += 1
    return succs, missing


def greedy_schedule(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts],
                    mem_cap: float | None = None, policy: str = "larger",
                    window: float | None = None) -> Schedule:
    """Event-driven greedy list schedule (module docstring). Raises ScheduleError if the pass gets
    stuck, which the memory-safety rule rules out for fused layouts whose cap admits one
    activation of each model per rank."""
    if policy not in POLICIES:
        raise ValueError(f"unknown greedy policy {policy!r}; known: {', '.join(POLICIES)}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    pipes = dict(pipes)
    schedule = Schedule(pipes, {})
    model = sim_model(schedule, costs)
    ranks = schedule.ranks
    rank_pos = {r: i for i, r in enumerate(ranks)}
    n, R = model.num_actions, len(ranks)
    acts, dur, delta = model.actions, model.dur, model.mem_delta
    home = [rank_pos[r] for r in model.home]
    mindex = model_index(pipes)
    act_model = [mindex[a.pipe] for a in acts]
    guard = _MemoryGuard.for_model(mem_cap, R, act_model, home, delta)
    prio = model_priority(pipes, costs)
    static = [(prio[a.pipe], 0 if a.kind == "B" else 1, a.mb, a.pipe, a.stage) for a in acts]
    last_model = [-1] * R
    key = _priority(policy, static, chain_tails(model), act_model, last_model)
    stage_slot, limit = _stage_limits(pipes, acts, window)
    in_flight = [0] * n  # indexed by stage slot
    succs, missing = _dependents(model)
    ready_at = [0.0] * n
    available: list[list[int]] = [[] for _ in ranks]  # deps done (input may still be in transit)
    for v in range(n):
        if missing[v] == 0:
            available[home[v]].append(v)

    def pick(r: int, t: float) -> int | None:
        best, best_key = None, None
        for v in available[r]:
            if ready_at[v] > t + _EPS:
                continue
            k = key(v, r)
            if best is not None and k >= best_key:
                continue
            if acts[v].kind == "F" and (in_flight[stage_slot[v]] >= limit[stage_slot[v]] or
                                        not guard.allows(r, act_model[v], delta[v])):
                continue
            best, best_key = v, k
        return best

    order: list[list[int]] = [[] for _ in ranks]
    idle = [True] * R
    running: list[tuple[float, int]] = []  # (end time, action)
    t, done = 0.0, 0
    while done < n:
        for r in range(R):
            v = pick(r, t) if idle[r] and available[r] else None
            if v is None:
                continue
            available[r].remove(v)
            order[r].append(v)
            last_model[r] = act_model[v]
            if acts[v].kind == "F":
                in_flight[stage_slot[v]] += 1
                guard.add(r, act_model[v], delta[v])
            idle[r] = False
            heapq.heappush(running, (t + dur[v], v))
        # next event: an action ends, or an available action's input arrives on an idle rank
        nxt = min((ready_at[v] for r in range(R) if idle[r] for v in available[r]
                   if ready_at[v] > t + _EPS), default=inf)
        if running and running[0][0] <= nxt:
            nxt = running[0][0]
        if nxt == inf:
            stuck = {ranks[r]: len(order[r]) for r in range(R) if available[r]}
            raise ScheduleError(f"greedy scheduler is stuck at t={t:g} (memory cap {mem_cap}); "
                                f"ranks with waiting work at steps {stuck}")
        t = nxt
        while running and running[0][0] <= t + _EPS:
            end, v = heapq.heappop(running)
            idle[home[v]] = True
            done += 1
            if acts[v].kind == "B":
                in_flight[stage_slot[v]] -= 1
                guard.add(home[v], act_model[v], delta[v])
            for w, lat in succs[v]:
                ready_at[w] = max(ready_at[w], end + lat)
                missing[w] -= 1
                if missing[w] == 0:
                    available[home[w]].append(w)
    return Schedule(pipes, {ranks[r]: [acts[v] for v in order[r]] for r in range(R)})
