"""Two-phase simulated annealing over per-rank orders of a fused pipeline schedule (RLHFuse,
NSDI'25, arXiv 2409.13221, section 5: minimise the latency, then, with the latency fixed, the peak
memory).

This module owns one seed's search: its context (:class:`SearchContext`: what every phase reads,
and a budget that phases take shares of and book what they spent against), its phases as objects
that take a :class:`Candidate` and return one tagged with its origin (:class:`MakespanPhase`, then
:class:`LowerMemoryStarts`; :class:`MemoryPhase`, with a slack :class:`TimeForMemory`), the order
they run in (:func:`makespan_round`, then :func:`memory_round`), and the fan-out over seeds in two
rounds, so that every seed's memory phase works at the shortest makespan (:func:`anneal_seeds`).
Both phases run the one annealing loop of :mod:`systems.rlhfuse.intra.loop`. Budget: phase 1 may
use ``phase1_frac`` of ``max_steps`` / ``time_limit_s``, phase 2 the rest; a step is one timed
trial move. All randomness comes from ``random.Random(seed)``: with ``max_steps`` the result is a
pure function of the inputs. What each phase does and why: docs/FUSED_SEARCH.md.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from harness.schedule import SimModel
from systems.rlhfuse.intra.incremental import OrderState, chain_tails
from systems.rlhfuse.intra import loop
from systems.rlhfuse.intra.config import DEFAULT_MEMORY_CAP_STEPS, DEFAULT_MEMORY_MAKESPAN_WEIGHTS, FusedSearchConfig
from systems.rlhfuse.intra.memory import MemoryParams, MemorySearch

_EPS = 1e-9
MAX_DRAWS = 1000  # proposals tried per step before the step is counted as a rejected one
_SEARCH = FusedSearchConfig()  # the search options' defaults (config.py), read by AnnealParams


@dataclass
class AnnealParams:
    """One seed's parameters: the search's options (defaults: :class:`FusedSearchConfig`'s, the
    budget resolved) and the phases' own."""
    seed: int = _SEARCH.seed
    time_limit_s: float | None = _SEARCH.time_limit_s
    max_steps: int | None = _SEARCH.step_budget
    phase1_frac: float = 0.5
    t0_rel: float = 1.0    # start temperature / mean action time
    t1_rel: float = 0.02   # final temperature / mean action time
    q_critical: float = 0.8
    phase1_cycle_steps: int | None = 20_000  # cooling cycle of phase 1 under long step budgets (None: one) ...
    phase1_cycle_sweeps: float = 25.0  # ... and at least this many steps per action (docs/FUSED_SEARCH.md)
    front_try_frac: float = 0.125  # share of phase 1's budget for each lower-memory start tried
    makespan_slack_frac: float = _SEARCH.makespan_slack_frac  # the memory phase may return (1 + this) x phase 1's best
    slack_polish_frac: float = 0.125  # with a slack: share kept to shorten its result (TimeForMemory)
    slack_at_target_frac: float = 0.375  # with a slack: share of the memory phase run at phase 1's makespan
    memory_phase: bool = _SEARCH.memory_phase
    memory: MemoryParams = field(default_factory=MemoryParams)
    memory_cap_steps: tuple[float, ...] = DEFAULT_MEMORY_CAP_STEPS  # by seed (anneal_seeds)
    memory_makespan_weights: tuple[float, ...] = DEFAULT_MEMORY_MAKESPAN_WEIGHTS  # by seed


@dataclass
class AnnealOutcome:
    seqs: list[list[int]]
    makespan: float
    peak_memory: float
    steps: int
    steps_makespan: int
    steps_memory: int
    seed: int
    elapsed_s: float
    start: str = ""                  # label of the seed's starting order
    phase1_makespan: float = 0.0     # makespan of phase 1's best order (the memory phase's target)
    phase1_peak_memory: float = 0.0  # peak of phase 1's best order (the memory phase's start)
    memory_levels: int = 0           # how many times the memory phase lowered the peak
    origin: str = ""                 # the start phase 1's result came from, then each phase ("a > b")
    phase1_tries: int = 0            # lower-memory starts tried after the first run of phase 1


@dataclass(frozen=True)
class Budget:
    """Trial moves and wall-clock seconds a part of the search may use (None: no bound in that
    unit); parts are cut from the whole by :meth:`scaled` and :meth:`less`."""
    steps: int | None
    seconds: float | None

    def scaled(self, frac: float, whole=int) -> Budget:
        """``frac`` of this budget, its steps made whole by ``whole``."""
        return Budget(None if self.steps is None else whole(self.steps * frac),
                      None if self.seconds is None else self.seconds * frac)

    def less(self, steps: int | None = 0, seconds: float | None = 0.0) -> Budget:
        """What is left after ``steps`` trial moves and ``seconds`` (None counts as 0)."""
        return Budget(None if self.steps is None else self.steps - (steps or 0),
                      None if self.seconds is None else self.seconds - (seconds or 0.0))

    @property
    def used_up(self) -> bool:
        return any(left is not None and left <= 0 for left in (self.steps, self.seconds))


@dataclass(frozen=True)
class Candidate:
    """An order a phase returns: per-rank action ids, makespan, peak, ``origin`` (the start's label,
    then each phase that produced it), trial moves spent and memory levels lowered."""
    seqs: list[list[int]]
    makespan: float
    peak: float
    origin: tuple[str, ...]
    steps: int = 0
    levels: int = 0
    grown: bool = False  # grown from a shorter order (grow.py): phase 1 keeps it, in one cooling


class SearchContext:
    """What every phase of one seed's search reads (schedule, chain tails, bound, cap, random stream,
    parameters, temperatures, action classes) and its budget: phases get shares of the whole
    (``total``) or of what is left (:meth:`left`), and what they return is booked (:meth:`spend`)."""

    def __init__(self, model: SimModel, lower_bound: float, mem_cap: float | None, p: AnnealParams):
        self.model, self.lower_bound, self.mem_cap, self.p = model, lower_bound, mem_cap, p
        self.rng, self.tails, self.cls = random.Random(p.seed), chain_tails(model), loop.action_classes(model)
        mean_dur = sum(model.dur) / max(len(model.dur), 1) or 1.0
        self.temps = (p.t0_rel * mean_dur, p.t1_rel * mean_dur)
        self.total, self.used, self.t_begin = Budget(p.max_steps, p.time_limit_s), 0, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_begin

    def left(self) -> Budget:
        return self.total.less(self.used, self.elapsed())

    def spend(self, found: Candidate) -> Candidate:
        self.used += found.steps
        return found

    def state(self, seqs: Sequence[Sequence[int]], cap: float | None = None) -> OrderState:
        return OrderState(self.model, seqs, self.mem_cap if cap is None else cap, self.tails)

    def candidate(self, seqs: Sequence[Sequence[int]], origin: tuple[str, ...], steps=0, levels=0) -> Candidate:
        state = self.state(seqs)
        return Candidate([list(s) for s in seqs], state.makespan(), state.max_peak(), origin, steps, levels)


class MakespanPhase:
    """Phase 1's annealing: the makespan towards ``goal`` (the loop's MAKESPAN objective) under the
    search's cap, and with ``peak`` under a hard cap there too. A step budget longer than a cycle,
    ``phase1_cycle_steps`` or ``phase1_cycle_sweeps`` steps per action if more, is spent in cooling
    cycles of that length, each a fresh try from the start; the best over all is returned."""
    name = "makespan"

    def __init__(self, goal: float, peak: float | None = None):
        self.goal, self.peak = goal, peak

    def run(self, ctx: SearchContext, start: Candidate, budget: Budget) -> Candidate:
        p, (t0, t1), cycle, goal = ctx.p, ctx.temps, ctx.p.phase1_cycle_steps, self.goal
        cycle = None if cycle is None else max(cycle, round(p.phase1_cycle_sweeps * ctx.model.num_actions))
        cap = None if self.peak is None else self.peak if ctx.mem_cap is None else min(self.peak, ctx.mem_cap)
        state = ctx.state(start.seqs, None if cap is None else cap + _EPS * max(1.0, cap))
        cycling = cycle is not None and budget.steps is not None and budget.steps > cycle
        rung = cycle if cycling else 2**62 if budget.steps is None else max(1, budget.steps)
        first, best, best_seqs, step = state.snapshot(), state.makespan(), None, 0
        rs, t_start = loop.mt_state(ctx.rng), time.perf_counter()
        while True:
            params = loop.LoopParams(loop.MAKESPAN, t0, t1, rung, MAX_DRAWS, q_critical=p.q_critical,
                                     tol=goal + _EPS * max(1.0, abs(goal)))
            run = loop.Loop(state, ctx.cls, params, rs, best_makespan=best, step=step)
            out = run.run(budget.steps, None if budget.seconds is None else
                          budget.seconds - (time.perf_counter() - t_start), time_cools=not cycling)
            step, found = run.step, run.best_seqs()
            if found is not None:
                best, best_seqs = float(run.state.best_makespan), found
            if out != loop.CYCLE_END:
                break
            state = ctx.state(first, state.mem_cap)  # cooled down above the bound: another try
        loop.mt_restore(ctx.rng, rs)
        seqs = best_seqs or first
        return Candidate(seqs, best, ctx.state(seqs).max_peak(), start.origin + (self.name,), step)


class LowerMemoryStarts:
    """Phase 1, second part: each of ``capped_starts`` (highest peak first) that holds less than the
    best is annealed under a hard cap at its peak with ``front_try_frac`` of phase 1's budget and
    replaces the best if it reaches its makespan (docs/FUSED_SEARCH.md, phase 1). ``tries``: how many ran."""

    def __init__(self, capped_starts: Sequence[Candidate]):
        self.capped_starts, self.tries = capped_starts, 0

    def run(self, ctx: SearchContext, best: Candidate, budget: Budget) -> Candidate:
        each = budget.scaled(ctx.p.front_try_frac, lambda steps: max(1, int(steps)))
        used, t_start = 0, time.perf_counter()
        for start in self.capped_starts:
            if start.peak >= best.peak - _EPS * max(1.0, best.peak):
                continue
            if budget.less(used, time.perf_counter() - t_start).used_up:
                break
            left = None if budget.steps is None else min(each.steps, budget.steps - used)
            found = MakespanPhase(best.makespan, start.peak).run(  # stops once it matches the best's makespan
                ctx, start, Budget(left, each.seconds))
            used, self.tries = used + found.steps, self.tries + 1
            if found.makespan <= best.makespan + _EPS * max(1.0, abs(best.makespan)):
                best = replace(found, makespan=min(best.makespan, found.makespan))
        return replace(best, steps=used)


class MemoryPhase:
    """Phase 2: from an order, the lowest peak at makespan <= ``target`` (the search's best order,
    or the start if it kept none); whether it replaces its start is the caller's choice."""
    name = "memory"

    def __init__(self, target: float):
        self.target = target

    def run(self, ctx: SearchContext, start: Candidate, budget: Budget) -> Candidate:
        search = MemorySearch(ctx.model, ctx.tails, self.target, ctx.mem_cap, ctx.rng, ctx.p.memory)
        steps = search.run(start.seqs, budget.steps, budget.seconds).steps
        if search.best_seqs is None:
            return replace(start, steps=steps, levels=0)
        return Candidate(search.best_seqs, search.best_makespan, search.best_peak, start.origin + (self.name,), steps,
                         search.levels_total)


class TimeForMemory:
    """The memory phase's second part under a makespan slack (docs/FUSED_SEARCH.md, "Time for memory"):
    from ``start`` (phase 1's order), the lowest peak at makespan <= ``(1 + makespan_slack_frac) x
    makespan``, kept only if below the best's, then annealed back towards ``makespan`` under a hard cap."""
    name = "time for memory"

    def __init__(self, start: Candidate, makespan: float):
        self.start, self.makespan = start, makespan

    def run(self, ctx: SearchContext, best: Candidate, budget: Budget, polish: Budget) -> Candidate:
        """``budget`` for the search, ``polish`` (plus the steps the search left) for the
        shortening; the returned candidate's steps are both parts'."""
        found = MemoryPhase(self.makespan * (1.0 + ctx.p.makespan_slack_frac)).run(ctx, self.start, budget)
        if found.peak >= best.peak - _EPS:
            return replace(best, steps=found.steps, levels=0)
        out = ctx.candidate(found.seqs, self.start.origin + (self.name,), found.steps, found.levels)
        left = None if budget.steps is None else budget.steps + polish.steps - found.steps
        if out.makespan > self.makespan + _EPS * max(1.0, self.makespan) and (left is None or left > 0):
            shorter = MakespanPhase(self.makespan, out.peak).run(ctx, out, Budget(left, polish.seconds))
            if shorter.makespan < out.makespan - _EPS * max(1.0, out.makespan):
                return replace(shorter, origin=out.origin, steps=out.steps + shorter.steps, levels=out.levels)
            return replace(out, steps=out.steps + shorter.steps)
        return out


@dataclass
class PhaseOne:
    """A seed between its rounds (:func:`anneal_seeds`): phase 1's result and the seed's state."""
    phase1: Candidate
    label: str
    steps: int
    elapsed_s: float
    rng_state: tuple
    tries: int


def makespan_round(model: SimModel, seqs: Sequence[Sequence[int]], lower_bound: float, mem_cap: float | None,
                   p: AnnealParams, capped_starts: Sequence[Candidate] = (), label: str = "") -> PhaseOne:
    """Phase 1 of one seed from the encoded orders ``seqs`` (one list of action ids per rank, the
    start called ``label``; ``capped_starts``: :class:`LowerMemoryStarts`)."""
    ctx = SearchContext(model, lower_bound, mem_cap, p)
    best, tries = ctx.candidate(seqs, (label,)), 0
    if any(len(s) > 1 for s in best.seqs):
        first = ctx.total.scaled(p.phase1_frac if p.memory_phase else 1.0, round)
        best = ctx.spend(MakespanPhase(lower_bound).run(ctx, best, first))
        fronts = LowerMemoryStarts(capped_starts)
        best = ctx.spend(fronts.run(ctx, best, first.less(ctx.used, ctx.elapsed())))
        best, tries = ctx.candidate(best.seqs, best.origin), fronts.tries  # timed in full: phase 2's target
    return PhaseOne(best, label, ctx.used, ctx.elapsed(), ctx.rng.getstate(), tries)


def memory_round(model: SimModel, lower_bound: float, mem_cap: float | None, p: AnnealParams,
                 one: PhaseOne) -> AnnealOutcome:
    """Phase 2 of the seed :func:`makespan_round` left as ``one``, its random stream, budget and
    clock going on from there (waiting for other seeds between the rounds costs it nothing)."""
    ctx = SearchContext(model, lower_bound, mem_cap, p)
    ctx.rng.setstate(one.rng_state)
    ctx.used, ctx.t_begin = one.steps, time.perf_counter() - one.elapsed_s
    best = phase1 = one.phase1
    steps_1, slack = ctx.used, p.makespan_slack_frac > 0
    if p.memory_phase and any(len(s) > 1 for s in best.seqs):
        left = ctx.left()
        # with a slack, this first part (at phase 1's makespan) gets only a share of the budget
        found = ctx.spend(MemoryPhase(phase1.makespan).run(ctx, phase1, left.scaled(p.slack_at_target_frac
                                                                                     if slack else 1.0)))
        if found.peak < phase1.peak - _EPS:
            best = ctx.candidate(found.seqs, found.origin, levels=found.levels)
        if slack:
            polish = left.scaled(p.slack_polish_frac)
            traded = ctx.spend(TimeForMemory(phase1, phase1.makespan).run(
                ctx, best, ctx.left().less(polish.steps, polish.seconds), polish))
            best = replace(ctx.candidate(traded.seqs, traded.origin), levels=best.levels + traded.levels)
    return AnnealOutcome(best.seqs, best.makespan, best.peak, ctx.used, steps_1, ctx.used - steps_1, p.seed,
                         ctx.elapsed(), one.label, phase1_makespan=phase1.makespan, phase1_peak_memory=phase1.peak,
                         memory_levels=best.levels, origin=" > ".join(best.origin), phase1_tries=one.tries)


def anneal_orders(model: SimModel, seqs: Sequence[Sequence[int]], lower_bound: float, mem_cap: float | None = None,
                  params: AnnealParams | None = None, capped_starts: Sequence[Candidate] = (),
                  label: str = "") -> AnnealOutcome:
    """Anneal one seed through both phases (:func:`makespan_round`, then :func:`memory_round`)."""
    p = params or AnnealParams()
    return memory_round(model, lower_bound, mem_cap, p,
                        makespan_round(model, seqs, lower_bound, mem_cap, p, capped_starts, label))


def share_makespan(ones: Sequence[PhaseOne]) -> list[PhaseOne]:
    """A seed whose phase 1 ended above the shortest makespan takes the order of the seed with the
    lowest peak there (keeping its own random stream, cap step and budget): a longer schedule cannot
    be the result (docs/FUSED_SEARCH.md, "One makespan for every seed")."""
    shortest = min(o.phase1.makespan for o in ones)
    tol = 1e-9 * max(1.0, abs(shortest))
    lead = min((o for o in ones if o.phase1.makespan <= shortest + tol), key=lambda o: o.phase1.peak)
    return [o if o.phase1.makespan <= shortest + tol else replace(o, phase1=lead.phase1, label=lead.label)
            for o in ones]


def anneal_seeds(model: SimModel, starts: Sequence[Candidate], lower_bound: float, mem_cap: float | None,
                 seeds: Sequence[int], params: AnnealParams, num_workers: int = 1,
                 capped_starts: Sequence[Candidate] = ()) -> tuple[AnnealOutcome, list[AnnealOutcome]]:
    """Anneal every seed, the ``k``-th seed from ``starts[k % len(starts)]`` (labelled candidates;
    ``num_workers`` processes when > 1), each with the same labelled ``capped_starts`` for phase
    1's lower-memory tries (a ``grown`` start: none, and phase 1 in one cooling: docs/FUSED_SEARCH.md,
    "Grown from half") and its memory phase's cap step and makespan weight the ``k``-th of
    ``memory_cap_steps`` and ``memory_makespan_weights`` (cycling; docs/FUSED_SEARCH.md), in two
    rounds: every seed's phase 1, then every seed's phase 2 at the shortest makespan of the first
    (:func:`share_makespan`). Returns (best, all) (:func:`best_outcome`). The candidates are shared,
    not copied: no phase changes the orders it is given (``OrderState`` works on its own copy)."""
    caps, weights = params.memory_cap_steps, params.memory_makespan_weights
    ps = [replace(params, seed=seed, memory=replace(params.memory, cap_step=caps[k % len(caps)],
                                                    makespan_weight=weights[k % len(weights)]),
                  phase1_cycle_steps=None if starts[k % len(starts)].grown else params.phase1_cycle_steps)
          for k, seed in enumerate(seeds)]
    firsts = [(model, (s := starts[k % len(starts)]).seqs, lower_bound, mem_cap, p, () if s.grown else capped_starts,
               s.origin[-1]) for k, p in enumerate(ps)]
    workers = max(1, min(num_workers, len(ps), os.cpu_count() or 1))

    def rounds(starmap):
        ones = starmap(makespan_round, firsts)
        ones = share_makespan(ones) if params.memory_phase else ones
        return starmap(memory_round, [(model, lower_bound, mem_cap, p, one) for p, one in zip(ps, ones)])

    if workers == 1:
        outcomes = rounds(lambda fn, args: [fn(*a) for a in args])
    else:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(workers) as pool:
            outcomes = rounds(lambda fn, args: pool.starmap(fn, args, chunksize=1))
    return best_outcome(outcomes, params.makespan_slack_frac), outcomes


def best_outcome(outcomes: Sequence[AnnealOutcome], makespan_slack_frac: float = 0.0) -> AnnealOutcome:
    """Lowest peak memory among the outcomes no longer than the memory phase's target, the shortest
    phase-1 makespan (times within a relative 1e-9 count as equal: timing passes differ in the last
    bits), then lowest makespan, then lowest seed: the memory phase keeps the makespan at most its
    target and lowers the peak, so a seed that also happened to shorten the schedule a little does
    not outrank one that holds less. With ``makespan_slack_frac`` > 0 the target is that fraction
    above the shortest makespan any seed reached (in either phase)."""
    target = min(o.phase1_makespan for o in outcomes)
    if makespan_slack_frac > 0:
        target = min(target, *(o.makespan for o in outcomes)) * (1.0 + makespan_slack_frac)
    tol = 1e-9 * max(1.0, abs(target))
    eligible = [o for o in outcomes if o.makespan <= target + tol]
    return min(eligible, key=lambda o: (o.peak_memory, o.makespan, o.seed))
