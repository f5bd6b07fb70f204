"""Exact refinement of a fused schedule by constraint programming (CP-SAT from Google OR-tools),
after the annealing of RLHFuse (NSDI'25, arXiv 2409.13221, section 5) and with the same two
objectives: first the makespan, then, with the makespan fixed, the peak activation memory.

This module owns the constraint model of a fused pipeline schedule and the two refinements run on
the annealer's best order. The model is the timing model of ``harness.schedule.simulate``:

- one interval per action (its forward or backward time), ``F(s, m)`` after ``F(s-1, m)`` and
  ``B(s, m)`` after ``F(s, m)`` and ``B(s+1, m)``, ``p2p`` on edges between ranks;
- one rank runs one action at a time (a no-overlap constraint per rank);
- activation memory: micro-batch ``m`` holds ``activation[s]`` on stage ``s``'s rank from the
  start of ``F(s, m)`` to the end of ``B(s, m)`` (a cumulative constraint per rank whose capacity
  is the peak). Because a rank's actions never overlap, the largest sum of lifetimes at any
  instant is exactly the peak of the running sum over the rank's list that ``simulate`` reports;
- every stage runs its forwards, and its backwards, first-in first-out, which loses no schedule
  (any schedule relabels into one that does: docs/FUSED_SEARCH.md, "Exact refinement").

Times and memory are made integers by scaling so the shortest action lasts ``TIME_RESOLUTION``
units and the smallest activation is ``MEMORY_RESOLUTION`` units, *rounding down*, which keeps
every proof sound: a real schedule re-timed with the rounded-down durations is no longer, so a
bound proven on the integer problem holds for the real one. The other direction is checked: a
solution's orders are re-timed with the real costs and kept only if no longer than the target
(within ``1e-9`` relative) and holding less.

The annealer's order is the solver's hint (its integer re-timing is a feasible solution), so the
refinement starts where annealing stopped and never returns worse. With ``deterministic=True``
the solver interleaves its portfolio deterministically (``interleave_search``) and stops on its
*deterministic* time (an effort count, not the clock): the same inputs, seed, budget and number of
workers (an input: it picks the portfolio's subsolvers) give the same result on any machine.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from itertools import accumulate
from dataclasses import dataclass

from harness.schedule import SimModel
from systems.rlhfuse.intra.incremental import OrderState, chain_tails

TIME_RESOLUTION = 1e10   # integer units of the shortest action: a path's rounding is <= 2e-10 of it
MEMORY_RESOLUTION = 1000  # integer units of the smallest activation
# CP-SAT rejects models whose sums could overflow 64 bits; the cumulative constraints' energy is
# about (sum of activations) x horizon, so the time resolution is lowered when that would pass this
MAX_ENERGY = 2.0 ** 60
_REL_TOL = 1e-9


@dataclass
class ExactOutcome:
    seqs: list[list[int]]      # the refined order (the given one when nothing better was found)
    makespan: float
    peak_memory: float
    improved: bool
    objective: str             # "makespan" or "memory"
    status: str                # CP-SAT's: OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, MODEL_INVALID
    bound: float               # proven: no schedule (within the target makespan, for memory) does
                               # better than this, in real units (time or memory)
    deterministic_time: float  # solver effort spent (CP-SAT's deterministic time)
    wall_s: float


def _require_ortools():
    try:
        from ortools.sat.python import cp_model
    except ImportError as err:  # a core dependency; only a broken install gets here
        raise ImportError("the exact refinement of fused schedules needs OR-tools "
                          "(pip install ortools)") from err
    return cp_model


class _Scaled:
    """Integer (rounded-down) durations, p2p latencies and activations of a ``SimModel``."""

    def __init__(self, model: SimModel, makespan: float):
        acts = [x for x in model.mem_delta if x > 0]
        self.mem_unit = (min(acts) if acts else 1.0) / MEMORY_RESOLUTION
        positive = [d for d in model.dur if d > 0]
        self.time_unit = (min(positive) if positive else 1.0) / TIME_RESOLUTION
        total_act = sum(math.floor(x / self.mem_unit) for x in acts) or 1
        self.time_unit = max(self.time_unit, makespan * total_act / MAX_ENERGY)
        self.dur = [int(math.floor(d / self.time_unit)) for d in model.dur]
        self.lat_a = [int(math.floor(x / self.time_unit)) for x in model.lat_a]
        self.lat_b = [int(math.floor(x / self.time_unit)) for x in model.lat_b]
        # integer memory change of every action (a backward frees exactly its forward's units)
        self.delta = [int(math.floor(x / self.mem_unit)) if x > 0 else -int(math.floor(-x / self.mem_unit))
                      for x in model.mem_delta]
        self.act = [max(d, 0) for d in self.delta]  # what each forward holds (0 for backwards)

    def memory_units(self, memory: float) -> int:
        """The most integer memory a real ``memory`` can hold: its activations round down, so
        their integer sum is at most ``memory / mem_unit`` (plus a little for the float division:
        7.6 / 0.008 is 949.999...)."""
        return int(math.floor(memory / self.mem_unit + 1e-6))

    def retime(self, model: SimModel, seqs: Sequence[Sequence[int]]) -> list[int]:
        """Integer start time of every action when the ranks run ``seqs`` in order: ``simulate``'s
        list scheduling over the integer durations and latencies (exact in floats)."""
        return [int(t) for t in model.with_times(self.dur, self.lat_a, self.lat_b).run(seqs, want_start=True)[1]]


def _build(cp_model, model: SimModel, scaled: _Scaled, seqs: Sequence[Sequence[int]], horizon: int,
           cap_units: int | None, hint: Sequence[int]):
    """The constraint model over the actions ``seqs`` schedules (ids of ``model``): start
    variables (``hint``: the solver's starting values), per-rank lifetimes and the peak variable,
    at most ``cap_units`` when given."""
    m = cp_model.CpModel()
    n = model.num_actions
    dur = scaled.dur
    start = [m.new_int_var(0, max(0, horizon - dur[a]), f"s{a}") for a in range(n)]
    for a in (a for seq in seqs for a in seq):
        m.add_hint(start[a], hint[a])
    ends = [start[a] + dur[a] for a in range(n)]
    for r, seq in enumerate(seqs):
        m.add_no_overlap([m.new_fixed_size_interval_var(start[a], dur[a], f"i{a}") for a in seq])
    for a in range(n):
        if model.dep_a[a] >= 0:
            m.add(start[a] >= ends[model.dep_a[a]] + scaled.lat_a[a])
        if model.dep_b[a] >= 0:
            m.add(start[a] >= ends[model.dep_b[a]] + scaled.lat_b[a])
    total_act = sum(scaled.act)
    backward = _backward_map(model)
    peak = m.new_int_var(0, max(total_act, 0) if cap_units is None else max(0, cap_units), "peak")
    for _, (f_base, b_base, num_stages, num_mbs, _) in model.pipe_slots.items():
        # every stage first-in first-out, forwards and backwards (no loss: see the docstring)
        for base in (f_base, b_base):
            for stage in range(num_stages):
                first = base + stage * num_mbs
                for mb in range(num_mbs - 1):
                    m.add(start[first + mb + 1] >= ends[first + mb])
        if cap_units is None:
            continue
        # under a cap, a stage holds at most ``k`` of its activations: first-in first-out, the
        # forward of micro-batch ``mb + k`` waits for the backward of ``mb`` (implied by the
        # cumulative constraint, but as precedences they propagate far better)
        for stage in range(num_stages):
            act = scaled.act[f_base + stage * num_mbs]
            k = cap_units // act if act > 0 else num_mbs
            for mb in range(max(0, num_mbs - k)):
                m.add(start[f_base + stage * num_mbs + mb + k] >= ends[b_base + stage * num_mbs + mb])
    for seq in seqs:
        lifetimes, demands = [], []
        for f in seq:
            if model.mem_delta[f] <= 0 or scaled.act[f] == 0:
                continue
            b = backward[f]
            size = m.new_int_var(dur[f] + dur[b], horizon, f"l{f}")
            lifetimes.append(m.new_interval_var(start[f], size, ends[b], f"life{f}"))
            demands.append(scaled.act[f])
        if lifetimes:
            m.add_cumulative(lifetimes, demands, peak)
    return m, start, ends, peak


def _backward_map(model: SimModel) -> dict[int, int]:
    """Forward id -> the backward that frees its activation (same pipe, stage, micro-batch)."""
    out: dict[int, int] = {}
    for f_base, b_base, _, _, _ in model.pipe_slots.values():
        for f in range(f_base, b_base):
            out[f] = b_base + (f - f_base)
    return out


def _solve(cp_model, m, budget: float, num_workers: int, seed: int, deterministic: bool,
           time_limit_s: float | None):
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = max(1, int(num_workers))
    p.random_seed = int(seed)
    if deterministic:
        p.interleave_search = True
        p.max_deterministic_time = float(budget)
    else:
        p.max_time_in_seconds = float(budget)
    if time_limit_s is not None:
        p.max_time_in_seconds = min(p.max_time_in_seconds, float(time_limit_s))
    status = solver.solve(m)
    return solver, solver.status_name(status)


def _orders(solver, seqs: Sequence[Sequence[int]], start) -> list[list[int]]:
    return [sorted(seq, key=lambda a: (solver.value(start[a]), a)) for seq in seqs]


def refine(model: SimModel, seqs: Sequence[Sequence[int]], objective: str, budget: float,
           mem_cap: float | None = None, num_workers: int = 1, seed: int = 0,
           deterministic: bool = True, time_limit_s: float | None = None,
           max_makespan: float | None = None) -> ExactOutcome:
    """Refine the order ``seqs`` (action ids of ``model`` per rank) with CP-SAT.

    ``objective="makespan"``: the shortest schedule (peak at most ``mem_cap`` when given).
    ``objective="memory"``: the lowest peak activation memory among schedules no longer than
    ``max_makespan`` (default: ``seqs``'s own makespan; never below it) and within ``mem_cap``:
    minimised under a cap, then a bisection over caps (:func:`_descend_memory`).
    ``max_makespan`` above the order's own makespan trades time for memory (the search's
    ``makespan_slack_frac``). ``budget`` is the solver's deterministic time
    (``deterministic=True``, reproducible) or seconds. Returns the better of ``seqs`` and the
    solver's best, with the proven bound on the objective (0 when nothing was proven)."""
    if objective not in ("makespan", "memory"):
        raise ValueError(f"objective must be 'makespan' or 'memory', got {objective!r}")
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if max_makespan is not None and objective != "memory":
        raise ValueError("max_makespan applies to objective='memory' only")
    cp_model = _require_ortools()
    t0 = time.perf_counter()
    seqs = [list(s) for s in seqs]
    tails = chain_tails(model)
    given = OrderState(model, seqs, None, tails)
    given_makespan, given_peak = given.makespan(), given.max_peak()
    if max_makespan is not None and max_makespan < given_makespan * (1 - _REL_TOL):
        raise ValueError(f"max_makespan {max_makespan:g} is below the given order's makespan "
                         f"{given_makespan:g}")
    limit = given_makespan if max_makespan is None else max(given_makespan, max_makespan)
    scaled = _Scaled(model, limit)
    hint = scaled.retime(model, seqs)
    hint_makespan = max((hint[a] + scaled.dur[a] for seq in seqs for a in seq), default=0)
    # every real schedule no longer than the limit fits (rounding down only shortens it), so
    # the bounds the solver proves hold for the real problem; the given order itself fits
    horizon = max(hint_makespan, int(math.floor(limit / scaled.time_unit)))
    if objective == "memory":
        return _descend_memory(cp_model, model, seqs, limit, given_makespan, given_peak, scaled, horizon,
                               mem_cap, budget, num_workers, seed, deterministic, time_limit_s, t0)
    # the cap, in integer units (rounded down: every real schedule within it fits)
    cap_units = None if mem_cap is None else scaled.memory_units(mem_cap)
    m, start, ends, peak = _build(cp_model, model, scaled, seqs, horizon, cap_units, hint)
    makespan = m.new_int_var(0, horizon, "makespan")
    m.add_max_equality(makespan, [ends[a] for seq in seqs for a in seq])
    m.minimize(makespan)
    solver, status = _solve(cp_model, m, budget, num_workers, seed, deterministic, time_limit_s)
    bound = solver.best_objective_bound * scaled.time_unit if status in ("OPTIMAL", "FEASIBLE") else 0.0
    best_seqs, best_makespan, best_peak, improved = seqs, given_makespan, given_peak, False
    if status in ("OPTIMAL", "FEASIBLE"):
        cand = _orders(solver, seqs, start)
        state = OrderState(model, cand, None, tails)
        mk, pk = state.makespan(), state.max_peak()
        tol_t = _REL_TOL * max(abs(given_makespan), 1e-300)
        within_cap = mem_cap is None or pk <= mem_cap * (1 + _REL_TOL)
        if within_cap and (mk < given_makespan - tol_t or (mk <= given_makespan + tol_t and pk < given_peak)):
            best_seqs, best_makespan, best_peak, improved = cand, mk, pk, True
    return ExactOutcome(best_seqs, best_makespan, best_peak, improved, objective, status, bound,
                        solver.deterministic_time, time.perf_counter() - t0)


def _integer_peak(scaled: _Scaled, seqs: Sequence[Sequence[int]]) -> int:
    """The largest running sum of integer activations over the ranks' lists."""
    return max([0] + [held for seq in seqs for held in accumulate(scaled.delta[a] for a in seq)])


def _descend_memory(cp_model, model: SimModel, seqs: list[list[int]], limit: float,
                    given_makespan: float, given_peak: float, scaled: _Scaled, horizon: int,
                    mem_cap: float | None, budget: float, num_workers: int, seed: int, deterministic: bool,
                    time_limit_s: float | None, t0: float) -> ExactOutcome:
    """The memory objective, with the makespan at most ``limit`` (at least the given order's
    makespan), in two steps:

    1. minimise the peak under a cap at the best peak so far (half the budget). The cap is fixed
       in the model, so its implied precedences (``_build``) prune the search; this step often
       ends proven optimal.
    2. if not, bisect over integer caps between the proven bound ``lo`` and the best peak
       ``hi``: a feasibility problem at the middle (half of what is left), which either finds a
       schedule (``hi`` drops to its peak) or proves that none exists (``lo`` rises past the
       middle). A low cap is often refuted at once by propagation, which a minimisation's bound
       rarely reaches. A probe that runs out of its share undecided moves the next one up,
       between it and ``hi``. Stops when ``lo`` meets ``hi`` (the best is optimal to the
       rounding), when the probes reach ``hi``, or when the budget is spent.

    Returns the best order (the given one unless something better was found) and the proven
    bound ``lo`` in real units (no schedule that short holds less)."""
    tails = chain_tails(model)
    tol_t = _REL_TOL * max(abs(limit), 1e-300)
    cap_units = None if mem_cap is None else scaled.memory_units(mem_cap)
    best = {"seqs": seqs, "makespan": given_makespan, "peak": given_peak, "improved": False}
    within = mem_cap is None or given_peak <= mem_cap * (1 + _REL_TOL)
    hi = _integer_peak(scaled, seqs) if within else cap_units  # feasible level (to the rounding)
    lo = 0                                                   # proven: no schedule holds less
    effort = 0.0
    deadline = None if time_limit_s is None else t0 + time_limit_s

    def left() -> float:
        if deadline is not None and time.perf_counter() >= deadline:
            return 0.0
        return budget - effort if deterministic else budget - (time.perf_counter() - t0)

    def probe(cap: int, share: float, minimise: bool):
        nonlocal effort
        m, start, _, peak = _build(cp_model, model, scaled, seqs, horizon, cap, scaled.retime(model, best["seqs"]))
        if minimise:
            m.minimize(peak)
        solver, status = _solve(cp_model, m, share, num_workers, seed, deterministic,
                                None if deadline is None else max(1e-3, deadline - time.perf_counter()))
        effort += solver.deterministic_time
        if status in ("OPTIMAL", "FEASIBLE"):
            cand = _orders(solver, seqs, start)
            state = OrderState(model, cand, None, tails)
            mk, pk = state.makespan(), state.max_peak()
            if mk <= limit + tol_t and pk < best["peak"] * (1 - _REL_TOL) and (
                    mem_cap is None or pk <= mem_cap * (1 + _REL_TOL)):
                best.update(seqs=cand, makespan=mk, peak=pk, improved=True)
            return solver, status, _integer_peak(scaled, cand)
        return solver, status, None

    if left() > 1e-6:
        solver, status, found = probe(hi, left() / 2, minimise=True)
        if status == "OPTIMAL":
            lo = hi = found
        elif status == "INFEASIBLE":
            lo = hi + 1
        elif status == "FEASIBLE":
            hi = min(hi, found)
            lo = max(lo, int(math.ceil(solver.best_objective_bound - 1e-9)))
    floor = lo  # probes go no lower: proven (lo) or undecided below
    while floor < hi and left() > 1e-6:
        mid = (floor + hi) // 2
        _, status, found = probe(mid, left() / 2, minimise=False)
        if status in ("OPTIMAL", "FEASIBLE"):
            hi = min(mid, found)
        elif status == "INFEASIBLE":
            lo = floor = mid + 1
        else:
            floor = mid + 1  # undecided: try closer to the best, where schedules are easier to find
    proven = lo >= hi
    within = mem_cap is None or best["peak"] <= mem_cap * (1 + _REL_TOL)
    status = ("INFEASIBLE" if not within and lo > cap_units  # (not within: a cap was given)
              else "OPTIMAL" if proven and within else "FEASIBLE" if within else "UNKNOWN")
    return ExactOutcome(best["seqs"], best["makespan"], best["peak"], best["improved"], "memory",
                        status, lo * scaled.mem_unit, effort, time.perf_counter() - t0)
