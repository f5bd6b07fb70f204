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
  (docs/FUSED_SEARCH.md, "Reading it"); the other orders keep both pipelines moving;
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

import weakref
from collections.abc import Mapping
from math import inf

import numpy as np

from harness.schedule import PipeCosts, PipeSpec, Schedule, ScheduleError, SimModel, sim_model
from systems.rlhfuse.intra import kernel
from systems.rlhfuse.intra.incremental import chain_tails, dependants
from systems.rlhfuse.intra.pipes import model_index


def model_priority(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts]) -> dict[str, int]:
    """Pipe name -> priority class (0 = scheduled first): models sorted by mean per-stage
    ``F + B`` (larger first), ties by model order (model 1 first)."""
    index = model_index(pipes)
    totals: dict[int, list[float]] = {}
    for name, pipe in pipes.items():
        cost = costs[name]
        totals.setdefault(index[name], []).extend(cost.fwd[s] + cost.bwd[s] for s in range(pipe.num_stages))
    mean = {m: sum(v) / len(v) for m, v in totals.items()}
    ranking = sorted(mean, key=lambda m: (-mean[m], m))
    return {name: ranking.index(index[name]) for name in pipes}


POLICIES = ("larger", "alternate", "alternate_model", "critical_path", "fifo")


# how each policy's key reads (kernel.greedy_pass): per action ``key_a``/``key_b``, and where the
# dynamic "same model as the rank's previous action" flag goes
_KEY_MODES = {"larger": kernel.KEY_STATIC, "critical_path": kernel.KEY_STATIC, "fifo": kernel.KEY_STATIC,
              "alternate": kernel.KEY_FLAG_SECOND, "alternate_model": kernel.KEY_FLAG_FIRST}


class _PassInputs:
    """Everything :func:`~systems.rlhfuse.intra.kernel.greedy_pass` reads that depends only on
    (pipes, costs): the pass's :class:`~systems.rlhfuse.intra.kernel.GreedyInputs` (``arrays``) and
    what each policy's keys and each window's limits are made of; built once per :class:`SimModel`
    (the search runs ~90 passes over one model: policies x windows x caps)."""

    def __init__(self, model: SimModel, pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts],
                 ranks: list[int]):
        acts, n = model.actions, model.num_actions
        rank_pos = {r: i for i, r in enumerate(ranks)}
        home = np.array([rank_pos[r] for r in model.home], dtype=np.int64)
        mindex = model_index(pipes)
        model_of = np.array([mindex[a.pipe] for a in acts], dtype=np.int64)
        delta = np.asarray(model.mem_delta, dtype=np.float64)
        need = np.zeros((int(model_of.max()) + 1, len(ranks)))
        np.maximum.at(need, (model_of, home), delta)  # largest activation per model, rank
        present = np.zeros(need.shape[0], dtype=np.bool_)
        present[model_of] = True
        # priority keys: ``static_rank`` ranks the static tuples (model priority, B before F,
        # micro-batch, pipe, stage), which are distinct, so every policy's key is a total order and
        # the pass never depends on the order it scans ready actions in
        prio = model_priority(pipes, costs)
        static = [(prio[a.pipe], 0 if a.kind == "B" else 1, a.mb, a.pipe, a.stage) for a in acts]
        static_rank = np.empty(n, dtype=np.int64)
        static_rank[sorted(range(n), key=static.__getitem__)] = np.arange(n)
        self.neg_tail = -np.asarray(chain_tails(model), dtype=np.float64)
        self.zero = np.zeros(n)
        self.bf = np.array([st[1] for st in static], dtype=np.float64)
        self.mb = np.array([st[2] for st in static], dtype=np.float64)
        # per action: an id of its (pipe, stage) (the action of its micro-batch 0 forward), and
        # the number of stages after it (the window's in-flight limit is ceil(window * that))
        slot = {(a.pipe, a.stage): i for i, a in enumerate(acts) if a.kind == "F" and a.mb == 0}
        stage_slot = np.array([slot[(a.pipe, a.stage)] for a in acts], dtype=np.int64)
        self.stages_left = np.array([pipes[a.pipe].num_stages - a.stage for a in acts], dtype=np.float64)
        # the dependency graph reversed, in CSR form, and how many dependencies each action has
        succ_ptr, succ_idx, succ_lat = dependants(model)
        self.arrays = kernel.GreedyInputs(
            num_ranks=len(ranks), home=home, dur=np.asarray(model.dur, dtype=np.float64), delta=delta,
            is_fwd=np.array([a.kind == "F" for a in acts], dtype=np.bool_), model_of=model_of,
            static_rank=static_rank, stage_slot=stage_slot, succ_ptr=succ_ptr, succ_idx=succ_idx,
            succ_lat=succ_lat, num_deps=np.bincount(succ_idx, minlength=n).astype(np.int64), need=need,
            models_present=present)

    def priority(self, policy: str) -> kernel.GreedyPriority:
        """A policy's keys (see ``_KEY_MODES`` for where the dynamic flag goes)."""
        key_a, key_b = {"larger": (self.zero, self.zero), "critical_path": (self.neg_tail, self.zero),
                        "fifo": (self.mb, self.neg_tail), "alternate": (self.bf, self.zero),
                        "alternate_model": (self.bf, self.zero)}[policy]
        return kernel.GreedyPriority(_KEY_MODES[policy], key_a, key_b)

    def limits(self, window: float | None, mem_cap: float | None) -> kernel.GreedyLimits:
        """In-flight limit per (pipe, stage) id: ``ceil(window * stages left)``, at least 1 (none
        without a window); and the memory cap."""
        stage_slot = self.arrays.stage_slot
        n = len(stage_slot)
        limit = np.full(n, n, dtype=np.int64)
        if window is not None:
            limit[stage_slot] = np.maximum(1, np.ceil(window * self.stages_left)).astype(np.int64)
        return kernel.GreedyLimits(limit, inf if mem_cap is None else float(mem_cap), mem_cap is not None)


_INPUTS: "weakref.WeakKeyDictionary[SimModel, _PassInputs]" = weakref.WeakKeyDictionary()


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
    acts = model.actions
    x = _INPUTS.get(model)
    if x is None:
        x = _INPUTS[model] = _PassInputs(model, pipes, costs, ranks)
    home = x.arrays.home
    placed = np.empty(len(acts), dtype=np.int64)
    fn = kernel.greedy_pass if kernel.AVAILABLE else kernel.interpreted(kernel.greedy_pass)
    num_placed, t = fn(x.arrays, x.priority(policy), x.limits(window, mem_cap), placed)
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
