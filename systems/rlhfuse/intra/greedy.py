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
- two more policies give the annealer other starting points (``search`` keeps the best):
  ``"alternate"`` -- backward before forward, then the model that did *not* run the rank's
  previous action (so the two models interleave like a bidirectional pipeline), then the larger
  model; ``"alternate_model"`` -- the other model first, then backward before forward. On equal
  models the fixed preference floods the ranks with model-1 forwards and starves model 2's
  pipeline; alternating keeps both pipelines moving;
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

from harness.schedule import PipeCosts, PipeSpec, Schedule, ScheduleError, sim_model
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
    """Per-rank in-flight activation memory and the cap + safety test (module docstring)."""

    def __init__(self, cap: float | None, num_ranks: int, models: list[int], need: list[list[float]]):
        self.cap = cap
        self.held = [0.0] * num_ranks
        self.held_by = {m: [0.0] * num_ranks for m in models}
        self.need = need  # need[m][r]: largest activation of model m on rank r (0 if none)
        self.models = models

    def allows(self, rank: int, model: int, act: float) -> bool:
        if self.cap is None or act <= 0:
            return True
        cap = self.cap + _EPS
        if self.held[rank] + act > cap:
            return False
        held = self.held
        for x in self.models:
            held_x, need_x = self.held_by[x], self.need[x]
            extra = act if model != x else 0.0
            if all(held[r] - held_x[r] + need_x[r] + (extra if r == rank else 0.0) <= cap
                   for r in range(len(held))):
                return True
        return False

    def add(self, rank: int, model: int, delta: float) -> None:
        self.held[rank] += delta
        self.held_by[model][rank] += delta


def chain_tails(model) -> list[float]:
    """Per action: the longest chain of dependent work that must still follow it (its own
    micro-batch's later forwards and backwards, with latencies): the "bottom level" of classic
    critical-path list scheduling."""
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


POLICIES = ("larger", "alternate", "alternate_model", "critical_path")


def greedy_schedule(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts],
                    mem_cap: float | None = None, policy: str = "larger") -> Schedule:
    """Event-driven greedy list schedule (module docstring). Raises ScheduleError if the pass gets
    stuck, which the memory-safety rule rules out for fused layouts whose cap admits one
    activation of each model per rank."""
    if policy not in POLICIES:
        raise ValueError(f"unknown greedy policy {policy!r}; known: {', '.join(POLICIES)}")
    pipes = dict(pipes)
    schedule = Schedule(pipes, {})
    model = sim_model(schedule, costs)
    ranks = schedule.ranks
    rank_pos = {r: i for i, r in enumerate(ranks)}
    n = model.num_actions
    acts, dur, delta = model.actions, model.dur, model.mem_delta
    home = [rank_pos[r] for r in model.home]
    prio = model_priority(pipes, costs)
    mindex = model_index(pipes)
    models = sorted(set(mindex.values()))
    need = [[0.0] * len(ranks) for _ in range(max(models) + 1)]
    for v in range(n):
        m = mindex[acts[v].pipe]
        need[m][home[v]] = max(need[m][home[v]], delta[v])
    guard = _MemoryGuard(mem_cap, len(ranks), models, need)
    act_model = [mindex[a.pipe] for a in acts]
    static = [(prio[a.pipe], 0 if a.kind == "B" else 1, a.mb, a.pipe, a.stage) for a in acts]
    last_model = [-1] * len(ranks)

    tail = chain_tails(model)

    def key(v: int, r: int) -> tuple:
        k = static[v]
        if policy == "larger":
            return k
        if policy == "critical_path":
            return (-tail[v], *k)
        other = act_model[v] == last_model[r]
        return (k[1], other, *k) if policy == "alternate" else (other, k[1], *k)

    succs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    missing = [0] * n
    for v in range(n):
        for d, lat in ((model.dep_a[v], model.lat_a[v]), (model.dep_b[v], model.lat_b[v])):
            if d >= 0:
                succs[d].append((v, lat))
                missing[v] += 1
    ready_at = [0.0] * n
    available: list[list[int]] = [[] for _ in ranks]  # deps done (maybe not yet arrived)
    for v in range(n):
        if missing[v] == 0:
            available[home[v]].append(v)
    order: list[list[int]] = [[] for _ in ranks]
    busy_until = [0.0] * len(ranks)
    idle = [True] * len(ranks)
    running: list[tuple[float, int]] = []  # (end time, action)
    t, done = 0.0, 0
    while done < n:
        for r in range(len(ranks)):
            if not idle[r] or not available[r]:
                continue
            best, best_key = None, None
            for v in available[r]:
                if ready_at[v] <= t + _EPS:
                    k = key(v, r)
                    if best is not None and k >= best_key:
                        continue
                    if delta[v] > 0 and not guard.allows(r, act_model[v], delta[v]):
                        continue
                    best, best_key = v, k
            if best is None:
                continue
            available[r].remove(best)
            order[r].append(best)
            last_model[r] = act_model[best]
            if delta[best] > 0:
                guard.add(r, act_model[best], delta[best])
            idle[r] = False
            busy_until[r] = t + dur[best]
            heapq.heappush(running, (busy_until[r], best))
        # next event: an action ends, or an available action's input arrives on an idle rank
        pending = [ready_at[v] for r in range(len(ranks)) if idle[r] for v in available[r]
                   if ready_at[v] > t + _EPS]
        nxt = min(pending, default=float("inf"))
        if running and running[0][0] <= nxt:
            nxt = running[0][0]
        if nxt == float("inf"):
            stuck = {ranks[r]: len(order[r]) for r in range(len(ranks)) if available[r]}
            raise ScheduleError(f"greedy scheduler is stuck at t={t:g} (memory cap {mem_cap}); "
                                f"ranks with waiting work at steps {stuck}")
        t = nxt
        while running and running[0][0] <= t + _EPS:
            end, v = heapq.heappop(running)
            r = home[v]
            idle[r] = True
            done += 1
            if delta[v] < 0:
                guard.add(r, act_model[v], delta[v])
            for w, lat in succs[v]:
                ready_at[w] = max(ready_at[w], end + lat)
                missing[w] -= 1
                if missing[w] == 0:
                    available[home[w]].append(w)
    return Schedule(pipes, {ranks[r]: [acts[v] for v in order[r]] for r in range(len(ranks))})
