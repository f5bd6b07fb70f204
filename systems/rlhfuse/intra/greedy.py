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

from collections.abc import Mapping
from math import ceil, inf

import numpy as np

from harness.schedule import PipeCosts, PipeSpec, Schedule, ScheduleError, sim_model
from systems.rlhfuse.intra import kernel
from systems.rlhfuse.intra.incremental import chain_tails
from systems.rlhfuse.intra.pipes import model_index

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


POLICIES = ("larger", "alternate", "alternate_model", "critical_path", "fifo")


# how each policy's key reads (kernel.greedy_pass): per action ``key_a``/``key_b``, and where the
# dynamic "same model as the rank's previous action" flag goes
_KEY_MODES = {"larger": kernel.KEY_STATIC, "critical_path": kernel.KEY_STATIC, "fifo": kernel.KEY_STATIC,
              "alternate": kernel.KEY_FLAG_SECOND, "alternate_model": kernel.KEY_FLAG_FIRST}


def _keys(policy: str, static: list[tuple], tail: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A policy's priority as arrays (``key_a``, ``key_b``, ``srank``): ``srank`` ranks the static
    tuples ``(model priority, B before F, micro-batch, pipe, stage)``, which are distinct, so every
    key is a total order and the pass never depends on the order it scans ready actions in."""
    n = len(static)
    srank = np.empty(n, dtype=np.int64)
    srank[sorted(range(n), key=static.__getitem__)] = np.arange(n)
    neg_tail = -np.asarray(tail, dtype=np.float64)
    zero = np.zeros(n)
    bf = np.array([st[1] for st in static], dtype=np.float64)
    mb = np.array([st[2] for st in static], dtype=np.float64)
    key_a, key_b = {"larger": (zero, zero), "critical_path": (neg_tail, zero), "fifo": (mb, neg_tail),
                    "alternate": (bf, zero), "alternate_model": (bf, zero)}[policy]
    return key_a, key_b, srank


def _stage_limits(pipes: Mapping[str, PipeSpec], acts: list, window: float | None):
    """Per action: an id of its (pipe, stage), and the in-flight limit of each such id."""
    slot = {(a.pipe, a.stage): i for i, a in enumerate(acts) if a.kind == "F" and a.mb == 0}
    stage_slot = np.array([slot[(a.pipe, a.stage)] for a in acts], dtype=np.int64)
    limit = np.full(len(acts), len(acts), dtype=np.int64)
    if window is not None:
        for v, a in enumerate(acts):
            limit[stage_slot[v]] = max(1, ceil(window * (pipes[a.pipe].num_stages - a.stage)))
    return stage_slot, limit


def _dependents(model) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The dependency graph reversed, in CSR form (``ptr``, dependent action, latency), and how
    many dependencies each action has."""
    edges = sorted((d, v, lat) for v in range(model.num_actions)
                   for d, lat in ((model.dep_a[v], model.lat_a[v]), (model.dep_b[v], model.lat_b[v])) if d >= 0)
    ptr = np.zeros(model.num_actions + 1, dtype=np.int64)
    missing = np.zeros(model.num_actions, dtype=np.int64)
    for d, v, _ in edges:
        ptr[d + 1] += 1
        missing[v] += 1
    return (np.cumsum(ptr), np.array([v for _, v, _ in edges], dtype=np.int64),
            np.array([lat for _, _, lat in edges], dtype=np.float64), missing)


def greedy_schedule(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts],
                    mem_cap: float | None = None, policy: str = "larger",
                    window: float | None = None) -> Schedule:
    """Event-driven greedy list schedule (module docstring; the pass is
    :func:`~systems.rlhfuse.intra.kernel.greedy_pass`, compiled where numba is). Raises
    ScheduleError if the pass gets stuck, which the memory-safety rule rules out for fused
    layouts whose cap admits one activation of each model per rank."""
    if policy not in POLICIES:
        raise ValueError(f"unknown greedy policy {policy!r}; known: {', '.join(POLICIES)}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    pipes = dict(pipes)
    schedule = Schedule(pipes, {})
    model = sim_model(schedule, costs)
    ranks = schedule.ranks
    rank_pos = {r: i for i, r in enumerate(ranks)}
    acts = model.actions
    home = np.array([rank_pos[r] for r in model.home], dtype=np.int64)
    mindex = model_index(pipes)
    act_model = np.array([mindex[a.pipe] for a in acts], dtype=np.int64)
    delta = np.asarray(model.mem_delta, dtype=np.float64)
    need = np.zeros((int(act_model.max()) + 1, len(ranks)))
    np.maximum.at(need, (act_model, home), delta)  # largest activation of each model on each rank
    present = np.zeros(need.shape[0], dtype=np.bool_)
    present[act_model] = True
    prio = model_priority(pipes, costs)
    static = [(prio[a.pipe], 0 if a.kind == "B" else 1, a.mb, a.pipe, a.stage) for a in acts]
    key_a, key_b, srank = _keys(policy, static, chain_tails(model))
    stage_slot, limit = _stage_limits(pipes, acts, window)
    succ_ptr, succ_idx, succ_lat, missing = _dependents(model)
    is_fwd = np.array([a.kind == "F" for a in acts], dtype=np.bool_)
    placed = np.empty(len(acts), dtype=np.int64)
    fn = kernel.greedy_pass if kernel.AVAILABLE else kernel.interpreted(kernel.greedy_pass)
    num_placed, t = fn(len(ranks), home, np.asarray(model.dur, dtype=np.float64), delta, is_fwd, act_model,
                       key_a, key_b, srank, _KEY_MODES[policy], stage_slot, limit, succ_ptr, succ_idx, succ_lat,
                       missing, inf if mem_cap is None else float(mem_cap), mem_cap is not None, need, present,
                       placed)
    order: list[list[int]] = [[] for _ in ranks]
    for v in placed[:num_placed].tolist():
        order[home[v]].append(v)
    if num_placed < len(acts):
        unplaced = np.ones(len(acts), dtype=np.bool_)
        unplaced[placed[:num_placed]] = False
        stuck = {ranks[r]: len(order[r]) for r in sorted(set(home[unplaced].tolist()))}
        raise ScheduleError(f"greedy scheduler is stuck at t={t:g} (memory cap {mem_cap}); "
                            f"ranks with work left, at steps {stuck}")
    return Schedule(pipes, {ranks[r]: [acts[v] for v in order[r]] for r in range(len(ranks))})
