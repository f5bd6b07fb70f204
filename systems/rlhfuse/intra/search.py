"""Fused actor+critic schedule search, end to end (RLHFuse, NSDI'25, arXiv 2409.13221, section 5).

This module owns :func:`search_fused_schedule`: the serial references (:func:`paper_serial`, and 1F1B
back to back, also a start), the greedy starts (:class:`GreedyStarts`), with many micro-batches a
start grown from the search of half as many (:func:`_grow_from_half`), the seeds' annealing
(:mod:`.anneal`), the optional exact refinement (:class:`ExactRefinement`), and the result against
the bounds. Budgets are steps per seed (the same schedule with any number of workers) or seconds.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace

from harness.schedule import PipeCosts, PipeSpec, Schedule, ScheduleError, sim_model, simulate, validate
from systems.rlhfuse.intra.anneal import AnnealParams, Candidate, anneal_seeds
from systems.rlhfuse.intra.bounds import LowerBound, lower_bound_terms, peak_lower_bound
from systems.rlhfuse.intra.config import FusedSearchConfig
from systems.rlhfuse.intra.greedy import POLICIES, greedy_schedule
from systems.rlhfuse.intra.grow import grow_order
from systems.rlhfuse.intra.incremental import OrderState, chain_tails
from systems.rlhfuse.intra.memory import MemoryParams
from systems.rlhfuse.intra.pipes import serial_schedule


@dataclass
class ExactReport:
    """The annealed best, then the exact refinement's CP-SAT status per objective ("": not run),
    effort and wall time (part of ``search_s``)."""
    annealed_makespan: float = 0.0
    annealed_peak_memory: float = 0.0
    makespan_status: str = ""
    memory_status: str = ""
    effort_used: float = 0.0
    wall_s: float = 0.0

    def summary(self) -> dict:
        return {"annealed_makespan": self.annealed_makespan, "annealed_peak_memory": self.annealed_peak_memory,
                "exact_makespan_status": self.makespan_status, "exact_memory_status": self.memory_status,
                "exact_effort_used": self.effort_used, "exact_s": self.wall_s}


@dataclass
class FusedResult:
    schedule: Schedule
    makespan: float
    lower_bound: float
    serial_makespan: float
    greedy_makespan: float
    peak_memory: float
    serial_peak_memory: float
    bubble_frac: float
    search_s: float
    valid: bool
    steps: int
    greedy_peak_memory: float = 0.0
    serial_no_barrier_makespan: float = 0.0  # each rank its actor's 1F1B list, then its critic's
    serial_no_barrier_peak_memory: float = 0.0
    bound_terms: dict[str, float] = field(default_factory=dict)
    config: FusedSearchConfig = field(default_factory=FusedSearchConfig)  # as run (max_steps resolved)
    best_seed: int = 0
    best_start: str = ""
    start_makespan: float = 0.0
    steps_memory: int = 0       # of ``steps``, those spent in the memory phase
    steps_per_s: float = 0.0    # annealing steps (trial moves) per second, best seed
    phase1_makespan: float = 0.0     # the makespan phase's result (kept, or within the slack above it)
    phase1_peak_memory: float = 0.0  # peak of the makespan phase's result (memory phase start)
    memory_levels: int = 0      # times the memory phase lowered the peak (best seed)
    origin: str = ""            # the start phase 1's result came from (own, or a lower-memory one), then each phase
    phase1_tries: int = 0       # lower-memory starts phase 1 tried (best seed)
    exact: ExactReport = field(default_factory=ExactReport)  # the annealed best, then its refinement
    makespan_bound: float = 0.0        # proven: no schedule is shorter (>= lower_bound)
    peak_bound: float = 0.0            # proven: no schedule this short holds less (0: none proven)
    peak_lower_bound: float = 0.0  # of any schedule this short: the closed form's or the proof's, if higher

    @property
    def makespan_optimal(self) -> bool:
        """The makespan is proven optimal: at the lower bound, or proven by the exact refinement."""
        return self.makespan <= self.makespan_bound * (1.0 + 1e-9)

    @property
    def makespan_vs_lower_bound(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def peak_memory_vs_serial(self) -> float:
        """Peak activation memory over the paper's serial baseline's peak."""
        return self.peak_memory / self.serial_peak_memory if self.serial_peak_memory > 0 else 1.0

    @property
    def gap_to_lower_bound_frac(self) -> float:
        """``makespan / lower_bound - 1`` (0 when the bound is reached)."""
        return self.makespan / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    def summary(self) -> dict:
        """JSON-able numbers (no schedule): every field, the options it ran with, and the ratios."""
        def ratio(a: float, b: float, default: float) -> float:
            return a / b if b > 0 else default

        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("schedule", "config", "exact")}
        out["lower_bound_terms"] = dict(out.pop("bound_terms"))
        out.update(self.exact.summary())
        return {**out, **asdict(self.config), "seeds": self.config.seeds,
                "gap_to_lower_bound_frac": self.gap_to_lower_bound_frac,
                "makespan_vs_lower_bound": self.makespan_vs_lower_bound, "makespan_optimal": self.makespan_optimal,
                "speedup_vs_serial": ratio(self.serial_makespan, self.makespan, 1.0),
                "speedup_vs_serial_no_barrier": ratio(self.serial_no_barrier_makespan, self.makespan, 1.0),
                "peak_memory_vs_serial": self.peak_memory_vs_serial,
                "phase1_peak_memory_vs_serial": ratio(self.phase1_peak_memory, self.serial_peak_memory, 1.0),
                "peak_bound_vs_serial": ratio(self.peak_bound, self.serial_peak_memory, 0.0),
                "peak_lower_bound_vs_serial": ratio(self.peak_lower_bound, self.serial_peak_memory, 0.0)}


def paper_serial(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts]) -> tuple[float, float]:
    """The paper's serial baseline (RLHFuse section 5 / Table 3): each model's 1F1B pipeline run
    to completion, one model after the other, with a barrier between. Returns (makespan, peak
    activation memory): the sum of the models' makespans, the larger of their peaks (the first
    model's activations are all released before the second starts)."""
    by_model: dict[str, dict[str, PipeSpec]] = {}
    for name, pipe in pipes.items():
        by_model.setdefault(pipe.model, {})[name] = pipe
    runs = [simulate(serial_schedule(group), {n: costs[n] for n in group}, record_times=False)
            for group in by_model.values()]
    return sum(r.makespan for r in runs), max(r.max_peak_memory for r in runs)


def _encode(schedule: Schedule, costs: Mapping[str, PipeCosts]) -> list[list[int]]:
    model = sim_model(schedule, costs)
    return [model.encode(schedule.order.get(r, []), r) for r in schedule.ranks]


START_WINDOWS = (None, 1.5, 2.0, 3.0)
# phase 1's lower-memory starts: greedy schedules over these policies x in-flight windows x caps of
# these multiples of the serial 1F1B peak (None: uncapped), of which the Pareto front in (peak,
# makespan) with makespan within FRONT_MAX_GAP of the lower bound (why these two policies:
# docs/FUSED_SEARCH.md, "Reading it").
FRONT_POLICIES = ("critical_path", "larger")
FRONT_WINDOWS = (None, 1.0, 1.5, 2.0)
FRONT_CAPS = (None, 1.3, 1.6, 2.0)
FRONT_MAX_GAP = 0.15


class GreedyStarts:
    """The orders the seeds start from, as labelled, fully timed :class:`Candidate` objects. :meth:`run`
    returns ``starts`` (serial 1F1B and every greedy policy x window, deduplicated, best (makespan,
    peak) first) and, with the memory phase, ``front``: phase 1's lower-memory starts, the (peak,
    makespan) Pareto front of a greedy pass per ``FRONT_*`` policy x window x cap (caps clipped to
    ``mem_cap``) within ``FRONT_MAX_GAP`` of the bound, highest peak first (docs/FUSED_SEARCH.md)."""

    def __init__(self, pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts], mem_cap: float | None):
        self.pipes, self.costs, self.mem_cap = pipes, costs, mem_cap

    def _passes(self, cap, windows=START_WINDOWS, policies=POLICIES):
        for policy in policies:
            for window in windows:
                try:
                    sched = greedy_schedule(self.pipes, self.costs, cap, policy=policy, window=window)
                except ScheduleError:  # not for fused layouts (see greedy's safety rule)
                    continue
                yield (policy if window is None else f"{policy}/window{window:g}"), sched

    def _candidate(self, label: str, sched: Schedule) -> Candidate:
        sim = simulate(sched, self.costs, record_times=False)
        return Candidate(_encode(sched, self.costs), sim.makespan, sim.max_peak_memory, (label,))

    def run(self, serial: Schedule, serial_peak: float, lower_bound: float,
            with_front: bool) -> tuple[list[Candidate], list[Candidate]]:
        orders, starts = [serial.order], [self._candidate("serial", serial)]
        for name, sched in self._passes(self.mem_cap):
            if sched.order not in orders:
                orders.append(sched.order)
                starts.append(self._candidate(name, sched))
        starts.sort(key=lambda c: (c.makespan, c.peak))
        found = []
        for factor in FRONT_CAPS if with_front else ():
            cap = self.mem_cap if factor is None else factor * serial_peak
            cap = cap if self.mem_cap is None or cap is None else min(cap, self.mem_cap)
            for name, sched in self._passes(cap, FRONT_WINDOWS, FRONT_POLICIES):
                found.append(self._candidate(name if factor is None else f"{name}/cap{factor:g}", sched))
        found.sort(key=lambda c: (c.peak, c.makespan, c.origin))
        front: list[Candidate] = []
        for c in found:
            if c.makespan <= lower_bound * (1.0 + FRONT_MAX_GAP) and (not front or c.makespan < front[-1].makespan - 1e-12):
                front.append(c)
        return starts, front[::-1]


def search_fused_schedule(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts],
                          mem_cap: float | None = None, config: FusedSearchConfig | None = None) -> FusedResult:
    """Search a fused schedule under ``config`` (:class:`FusedSearchConfig`). Seeds ``seed, seed+1,
    ...`` each get the step budget or ``time_limit_s``, ``num_workers`` at a time; seed ``seed + k``
    anneals from the ``k``-th best start, the grown one first when every pipe has at least
    ``grow_min_microbatches`` (``anneal.anneal_seeds``; the best: ``anneal.best_outcome``); then, with
    ``exact_effort > 0`` and no pipe above ``exact_max_microbatches``, CP-SAT (:class:`ExactRefinement`).
    ``makespan_slack_frac``: the result may be up to that much longer than the phase-1 best if it holds less.
    Deterministic for a step budget. Raises ValueError if ``mem_cap`` is below the serial
    schedule's peak, or on an option out of range (:meth:`FusedSearchConfig.check`)."""
    t_begin = time.perf_counter()
    cfg = config or FusedSearchConfig()
    cfg.check()
    pipes = dict(pipes)
    num_mbs = [p.num_mbs for p in pipes.values()]
    refines = not cfg.exact_max_microbatches or max(num_mbs) <= cfg.exact_max_microbatches  # docs/FUSED_SEARCH.md
    cfg = replace(cfg, max_steps=cfg.step_budget, exact_effort=cfg.exact_effort if refines else 0.0)
    bound: LowerBound = lower_bound_terms(pipes, costs)
    serial = serial_schedule(pipes)
    serial_sim = simulate(serial, costs, record_times=False)
    if mem_cap is not None and mem_cap < serial_sim.max_peak_memory - 1e-9:
        raise ValueError(f"memory cap {mem_cap:g} is below the peak in-flight activation memory "
                         f"{serial_sim.max_peak_memory:g} that even the serial 1F1B schedule needs")
    starts, front = GreedyStarts(pipes, costs, mem_cap).run(serial, serial_sim.max_peak_memory, bound.value,
                                                             cfg.memory_phase)
    greedy = next((c for c in starts if c.origin == ("larger",)), next(c for c in starts if c.origin == ("serial",)))
    barrier_makespan, barrier_peak = paper_serial(pipes, costs)
    model = sim_model(serial, costs)
    params = AnnealParams(seed=cfg.seed, time_limit_s=cfg.time_limit_s, max_steps=cfg.max_steps,
                          memory_phase=cfg.memory_phase, makespan_slack_frac=cfg.makespan_slack_frac,
                          memory=MemoryParams(max_shift=int(cfg.memory_move_reach)),
                          memory_cap_steps=tuple(float(s) for s in cfg.memory_cap_steps),
                          memory_makespan_weights=tuple(float(w) for w in cfg.memory_makespan_weights))
    if cfg.grow_min_microbatches and min(num_mbs) >= max(2, cfg.grow_min_microbatches):  # every pipe that long
        grown, params = _grow_from_half(pipes, costs, mem_cap, cfg, model, bound.value, params)
        starts = grown + starts
    best, _ = anneal_seeds(model, starts, bound.value, mem_cap, cfg.seeds, params, cfg.num_workers, front)
    start = next(c for c in starts if c.origin == (best.start,))
    exact = ExactRefinement(cfg, None if cfg.time_limit_s is None else
                            max(0.0, cfg.time_limit_s - (time.perf_counter() - t_begin)), best.phase1_makespan)
    final = exact.run(model, bound.value, mem_cap, Candidate(best.seqs, best.makespan, best.peak_memory, (best.origin,)))
    tol = 1e-9 * max(1.0, start.makespan)  # incremental and full timing differ in the last bits
    allowed = start.makespan  # what the start gives; with a slack, what the slack allows
    if cfg.makespan_slack_frac > 0:
        allowed = max(allowed, best.phase1_makespan * (1.0 + cfg.makespan_slack_frac))
    if final.makespan > allowed + tol or (final.makespan >= start.makespan - tol and final.peak > start.peak + 1e-12):
        final = start  # cannot happen (the annealer keeps its best), but never return worse
    schedule = Schedule(pipes, {r: [model.actions[v] for v in seq] for r, seq in zip(serial.ranks, final.seqs)})
    result = simulate(schedule, costs, record_times=False)
    try:
        validate(schedule)
        valid = mem_cap is None or result.max_peak_memory <= mem_cap + 1e-9
    except ScheduleError:
        valid = False
    return FusedResult(
        schedule=schedule, makespan=result.makespan, lower_bound=bound.value,
        serial_makespan=barrier_makespan, greedy_makespan=greedy.makespan,
        peak_memory=result.max_peak_memory, serial_peak_memory=barrier_peak,
        serial_no_barrier_makespan=serial_sim.makespan, serial_no_barrier_peak_memory=serial_sim.max_peak_memory,
        bubble_frac=result.bubble_frac, search_s=time.perf_counter() - t_begin, valid=valid,
        steps=best.steps, greedy_peak_memory=greedy.peak,
        bound_terms=bound.terms(), config=cfg, best_seed=best.seed, best_start=best.start,
        start_makespan=start.makespan, steps_memory=best.steps_memory,
        steps_per_s=best.steps / best.elapsed_s if best.elapsed_s > 0 else 0.0,
        phase1_makespan=best.phase1_makespan, phase1_peak_memory=best.phase1_peak_memory, exact=exact.report,
        memory_levels=best.memory_levels, origin=" > ".join(final.origin), phase1_tries=best.phase1_tries,
        makespan_bound=exact.makespan_bound, peak_bound=exact.peak_bound,
        peak_lower_bound=max(peak_lower_bound(pipes, costs, result.makespan), exact.peak_bound))


GROW_FRAC, GROW_MAX_GAP = 0.25, 0.02  # half's budget share; grown start kept within this of the bound
GROW_MIN_SWEEPS = 100  # and only when that share is at least this many steps per action of the half


def _grow_from_half(pipes, costs, mem_cap, cfg: FusedSearchConfig, model, lower_bound: float, params: AnnealParams):
    """Seed 0's start: the order of half the micro-batches (``GROW_FRAC`` of the budget), grown. Returns
    ([that start] or [], the annealing's parameters less that budget; unchanged if the share is too small)."""
    half = {name: replace(p, num_mbs=p.num_mbs // 2) for name, p in pipes.items()}
    steps = None if cfg.max_steps is None else round(cfg.max_steps * GROW_FRAC)
    if steps is not None and steps < GROW_MIN_SWEEPS * sum(2 * p.num_stages * p.num_mbs for p in half.values()):
        return [], params
    share = replace(cfg, exact_effort=0.0, max_steps=steps, memory_makespan_weights=cfg.grow_makespan_weights,
                    time_limit_s=None if cfg.time_limit_s is None else cfg.time_limit_s * GROW_FRAC)
    sub = search_fused_schedule(half, costs, mem_cap, share)
    rest = replace(params, max_steps=None if cfg.max_steps is None else cfg.max_steps - share.max_steps,
                   time_limit_s=None if cfg.time_limit_s is None else max(0.0, cfg.time_limit_s - sub.search_s))
    seqs = grow_order(sim_model(sub.schedule, costs), _encode(sub.schedule, costs), model)
    state = None if seqs is None else OrderState(model, seqs, mem_cap, chain_tails(model))
    near = state is not None and state.makespan() <= lower_bound * (1.0 + GROW_MAX_GAP)
    return [Candidate(seqs, state.makespan(), state.max_peak(), ("grown",), grown=True)] if near else [], rest


class ExactRefinement:
    """The last phase (:mod:`.exact`, ``config.exact_effort`` of CP-SAT deterministic time, 0: off):
    above the lower bound, minimise the makespan, then with it fixed the peak (with a slack, within
    it above the shorter of the annealed order and ``reference_makespan``). Deterministic unless
    ``time_left_s`` is given. After :meth:`run`: ``report``, ``makespan_bound``, ``peak_bound``."""
    name = "exact"

    def __init__(self, cfg: FusedSearchConfig, time_left_s: float | None, reference_makespan: float):
        self.cfg, self.time_left_s, self.reference_makespan = cfg, time_left_s, reference_makespan
        self.report, self.makespan_bound, self.peak_bound = ExactReport(), 0.0, 0.0  # set by run

    def run(self, model, lower_bound: float, mem_cap: float | None, start: Candidate) -> Candidate:
        cfg, effort, slack_frac = self.cfg, self.cfg.exact_effort, self.cfg.makespan_slack_frac
        self.report, self.makespan_bound = ExactReport(start.makespan, start.peak), lower_bound
        if effort <= 0:
            return start
        from systems.rlhfuse.intra.exact import refine  # OR-tools is only loaded when asked for

        deterministic, t0 = self.time_left_s is None, time.perf_counter()
        seqs, used, tails = [list(s) for s in start.seqs], 0.0, chain_tails(model)
        annealed, slack = OrderState(model, seqs, None, tails), slack_frac > 0
        reference = min(annealed.makespan(), self.reference_makespan) if slack else annealed.makespan()
        if reference > lower_bound * (1.0 + 1e-9):
            out = refine(model, seqs, "makespan", effort / 2, mem_cap, cfg.exact_workers, cfg.seed, deterministic,
                         self.time_left_s)
            used, self.report.makespan_status = out.deterministic_time, out.status
            self.makespan_bound = max(lower_bound, out.bound)  # OPTIMAL: the makespan, to the rounding
            if not slack:
                seqs = out.seqs
            else:
                reference = min(reference, out.makespan)  # out is no longer than the annealed order
                if annealed.makespan() > reference * (1.0 + slack_frac) * (1.0 + 1e-9) or \
                        out.peak_memory < annealed.max_peak():
                    seqs = out.seqs  # the annealed order no longer fits the slack, or holds more
        limit = max(reference * (1.0 + slack_frac), OrderState(model, seqs, None, tails).makespan()) if slack else None
        time_left = None if self.time_left_s is None else max(1e-3, self.time_left_s - (time.perf_counter() - t0))
        mem = refine(model, seqs, "memory", max(1e-3, effort - used), mem_cap, cfg.exact_workers, cfg.seed,
                     deterministic, time_left, max_makespan=limit)
        self.peak_bound, self.report.memory_status = mem.bound, mem.status
        self.report.effort_used, self.report.wall_s = used + mem.deterministic_time, time.perf_counter() - t0
        return Candidate(mem.seqs, mem.makespan, mem.peak_memory, start.origin + (self.name,))
