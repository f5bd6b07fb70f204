"""Two-phase simulated annealing over per-rank orders of a fused pipeline schedule (RLHFuse,
NSDI'25, arXiv 2409.13221, section 5: minimise the latency, then, with the latency fixed, the peak
memory).

This module owns the phases of one seed's search (:class:`SeedSearch`) and the fan-out over
seeds; both phases run the one annealing loop of :mod:`systems.rlhfuse.intra.loop` (its timing,
:mod:`systems.rlhfuse.intra.incremental`, always agrees with ``harness.schedule.simulate``), the
memory phase through :mod:`systems.rlhfuse.intra.memory`.

- **Phase 1** (makespan, the loop's MAKESPAN objective): the paper's neighbourhood, swaps of two
  adjacent actions on one rank, drawn with probability ``q_critical`` from the ends of the blocks
  of a critical path (only those can shorten it; uniform swaps alone barely move a schedule of
  thousands of actions: docs/FUSED_SEARCH.md), else uniformly; Metropolis acceptance with
  geometric cooling from ``T0`` to ``T1`` (relative to the mean action time) over the phase's
  step or time budget; a step budget longer than ``phase1_cycle_steps`` is spent in cooling
  cycles of that length, each a fresh try from the starting order. Stops early at the lower
  bound. Then the lower-memory starts (:meth:`SeedSearch.lower_memory_starts`).
- **Phase 2** (memory, :class:`~systems.rlhfuse.intra.memory.MemorySearch`): with the makespan
  fixed at phase 1's best ``T``, lower the peak activation memory under a cap of increasing
  tightness, starting from phase 1's best order. Every schedule it keeps has makespan <= ``T``,
  so the memory phase never lengthens the schedule.
- **Budget**: phase 1 may use ``phase1_frac`` of ``max_steps`` / ``time_limit_s``; phase 2 gets
  the rest, including whatever phase 1 left unused (phase 1 stops at the lower bound). A step is
  one trial move that was timed.
- **Determinism**: all randomness comes from ``random.Random(seed)``; with ``max_steps`` and no
  time limit the result is a pure function of the inputs. :func:`anneal_seeds` runs several seeds
  (in worker processes when ``num_workers > 1``), seed ``k`` from the ``k``-th of the given
  starting orders (cycling), and keeps the best by (makespan, peak memory, seed), which stays
  deterministic given (starts, seeds, max_steps) whatever the number of workers.
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
from systems.rlhfuse.intra.memory import DEFAULT_MEMORY_CAP_STEPS, MemoryParams, MemorySearch

_EPS = 1e-9
MAX_DRAWS = 1000  # proposals tried per step before the step is counted as a rejected one


@dataclass
class AnnealParams:
    seed: int = 0
    time_limit_s: float | None = 60.0
    max_steps: int | None = None
    phase1_frac: float = 0.5
    t0_rel: float = 1.0    # start temperature / mean action time
    t1_rel: float = 0.02   # final temperature / mean action time
    q_critical: float = 0.8
    phase1_cycle_steps: int | None = 20_000  # cooling cycle of phase 1 under long step budgets
    front_try_frac: float = 0.125  # share of phase 1's budget for each lower-memory start tried
    makespan_slack_frac: float = 0.0  # the memory phase may return up to (1 + this) x phase 1's best
    slack_polish_frac: float = 0.125  # with a slack: share kept to shorten its result (trade_time_for_memory)
    slack_at_target_frac: float = 0.375  # with a slack: share of the memory phase run at phase 1's makespan
    memory_phase: bool = True
    memory: MemoryParams = field(default_factory=MemoryParams)
    memory_cap_steps: tuple[float, ...] = DEFAULT_MEMORY_CAP_STEPS  # by seed (anneal_seeds)


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
    memory_start: str = ""           # "makespan phase": the memory phase's result was kept; "": phase 1's
    phase1_start: str = ""           # the start whose run gave phase 1's result (own, or a lower-memory one)
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

    def spent(self, steps: int, seconds: float) -> bool:
        """Is the budget used up after ``steps`` trial moves and ``seconds``?"""
        return (self.steps is not None and steps >= self.steps) or (self.seconds is not None and
                                                                     seconds >= self.seconds)


class SeedSearch:
    """One seed's search, its phases as methods over what they all read: the encoded schedule
    (``model``), its chain tails, the cap, the seed's random stream, the parameters, the
    temperatures and the action classes."""

    def __init__(self, model: SimModel, lower_bound: float, mem_cap: float | None, p: AnnealParams):
        self.model, self.lower_bound, self.mem_cap, self.p = model, lower_bound, mem_cap, p
        self.rng = random.Random(p.seed)
        self.tails = chain_tails(model)
        mean_dur = sum(model.dur) / max(len(model.dur), 1) or 1.0
        self.temps = (p.t0_rel * mean_dur, p.t1_rel * mean_dur)
        self.cls = loop.action_classes(model)
        self.t_begin = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_begin

    def state(self, seqs: Sequence[Sequence[int]], cap: float | None = None) -> OrderState:
        return OrderState(self.model, seqs, self.mem_cap if cap is None else cap, self.tails)

    def makespan_phase(self, state: OrderState, budget: Budget, goal: float) -> tuple[list[list[int]], float, int]:
        """Anneal the makespan of ``state`` towards ``goal`` (the loop's MAKESPAN objective). With a
        step budget longer than ``phase1_cycle_steps``, cooling runs in cycles of that many steps,
        each a fresh try from the starting order (a long budget then buys more tries, not a slower
        cooling that wanders hot for most of it); the best over all is kept. Returns (best order,
        its makespan, steps)."""
        p, (t0, t1), cycle = self.p, self.temps, self.p.phase1_cycle_steps
        cycling = cycle is not None and budget.steps is not None and budget.steps > cycle
        rung = cycle if cycling else 2**62 if budget.steps is None else max(1, budget.steps)
        first, best, best_seqs, step = state.snapshot(), state.makespan(), None, 0
        rs, t_start = loop.mt_state(self.rng), time.perf_counter()
        while True:
            run = loop.Loop(state, self.cls, loop.MAKESPAN, rs, (t0, t1, 0.0, p.q_critical, 0.0, 0.0, 0.0),
                            (1, rung, MAX_DRAWS),
                            {loop.F_TOL: goal + _EPS * max(1.0, abs(goal)), loop.F_BEST_MAKESPAN: best}, step)
            out = run.run(budget.steps, None if budget.seconds is None else
                          budget.seconds - (time.perf_counter() - t_start), time_cools=not cycling)
            step, found = run.step, run.best_seqs()
            if found is not None:
                best, best_seqs = float(run.fs[loop.F_BEST_MAKESPAN]), found
            if out != loop.CYCLE_END:
                break
            state = self.state(first, state.mem_cap)  # cooled down above the bound: another try
        loop.mt_restore(self.rng, rs)
        return best_seqs or first, best, step

    def memory_phase(self, target: float, seqs: Sequence[Sequence[int]], budget: Budget) -> tuple[MemorySearch, int]:
        """Run the memory search from ``seqs`` at makespan ``target``; returns (search, steps used)."""
        search = MemorySearch(self.model, self.tails, target, self.mem_cap, self.rng, self.p.memory)
        return search, search.run(seqs, budget.steps, budget.seconds).steps

    def under_peak(self, seqs: Sequence[Sequence[int]], peak: float, goal: float, budget: Budget
                   ) -> tuple[list[list[int]], float, int]:
        """Anneal the makespan of ``seqs`` towards ``goal`` under a hard cap at ``peak`` (and the
        cap): a shorter order that holds no more. Returns (best order, its makespan, steps)."""
        cap = peak if self.mem_cap is None else min(peak, self.mem_cap)
        return self.makespan_phase(self.state(seqs, cap + _EPS * max(1.0, cap)), budget, goal)

    def lower_memory_starts(self, best_seqs: list[list[int]], best: float,
                            capped_starts: Sequence[tuple[str, Sequence[Sequence[int]], float]], budget: Budget
                            ) -> tuple[list[list[int]], float, int, str, int]:
        """Phase 1, second part: from each of ``capped_starts`` (labelled orders with their peak,
        highest peak first) whose peak is below the best order's, anneal the makespan under a hard cap at
        that peak, with ``front_try_frac`` of phase 1's budget each; an order that reaches the best
        makespan so far (or beats it) replaces the best. The memory phase then starts from an order
        at the same makespan that holds less (docs/FUSED_SEARCH.md, phase 1). Returns (best order,
        its makespan, steps used, label of the start that gave it or "", tries)."""
        peak = self.state(best_seqs).max_peak()
        each = budget.scaled(self.p.front_try_frac, lambda steps: max(1, int(steps)))
        used, front, tries, t_start = 0, "", 0, time.perf_counter()
        for label, seqs, start_peak in capped_starts:
            if start_peak >= peak - _EPS * max(1.0, peak):
                continue
            if budget.spent(used, time.perf_counter() - t_start):
                break
            left = None if budget.steps is None else min(each.steps, budget.steps - used)
            # stop as soon as the best makespan so far is matched: equal makespan, less memory
            seqs_k, makespan_k, used_k = self.under_peak(seqs, start_peak, best, Budget(left, each.seconds))
            used += used_k
            tries += 1
            if makespan_k <= best + _EPS * max(1.0, abs(best)):
                best_seqs, best, front = seqs_k, min(best, makespan_k), label
                peak = self.state(seqs_k).max_peak()
        return best_seqs, best, used, front, tries

    def trade_time_for_memory(self, seqs: list[list[int]], start: list[list[int]], makespan: float,
                              budget: Budget, polish: Budget) -> tuple[list[list[int]], int, int]:
        """The memory phase's second part under a makespan slack: from ``start`` (phase 1's order)
        lower the peak with the makespan allowed up to ``(1 + makespan_slack_frac) x makespan``; an
        order found there is kept only if it holds less than ``seqs`` (the best order at phase 1's
        ``makespan``), and is then annealed back towards ``makespan`` under a hard cap at its peak
        (the slack should buy memory, not be given away at a peak the shorter schedule already
        had). It starts from phase 1's order, not from ``seqs``: the memory phase's best order at
        the makespan is usually in a basin that the looser target does not get it out of
        (docs/FUSED_SEARCH.md, "Time for memory"). ``budget`` for the search, ``polish`` (plus the
        steps the search left) for the shortening. Returns (order, steps used, levels lowered)."""
        peak = self.state(seqs).max_peak()
        search, used = self.memory_phase(makespan * (1.0 + self.p.makespan_slack_frac), start, budget)
        if search.best_seqs is None or search.best_peak >= peak - _EPS:
            return seqs, used, 0
        out = search.best_seqs
        state = self.state(out)
        longer, peak = state.makespan(), state.max_peak()
        left = None if budget.steps is None else budget.steps + polish.steps - used
        if longer > makespan + _EPS * max(1.0, makespan) and (left is None or left > 0):
            shorter_seqs, shorter, polished = self.under_peak(out, peak, makespan, Budget(left, polish.seconds))
            used += polished
            if shorter < longer - _EPS * max(1.0, longer):
                out = shorter_seqs
        return out, used, search.levels_total

    def run(self, seqs: Sequence[Sequence[int]],
            capped_starts: Sequence[tuple[str, Sequence[Sequence[int]], float]] = (), label: str = ""
            ) -> AnnealOutcome:
        """Phase 1 anneals the makespan from ``seqs`` (the start called ``label``), then tries the
        lower-memory ``capped_starts`` (``(label, order, its peak)``, highest peak first) under hard
        caps at their peaks with what is left of its budget (:meth:`lower_memory_starts`). The
        memory phase starts from phase 1's best."""
        p = self.p
        state = self.state(seqs)
        if not any(len(s) > 1 for s in state.seqs):
            return AnnealOutcome(state.snapshot(), state.makespan(), state.max_peak(), 0, 0, 0, p.seed, 0.0, label,
                                 phase1_makespan=state.makespan(), phase1_peak_memory=state.max_peak(),
                                 phase1_start=label)
        total = Budget(p.max_steps, p.time_limit_s)
        first = total.scaled(p.phase1_frac if p.memory_phase else 1.0, round)
        best_seqs, best, steps_1 = self.makespan_phase(state, first, self.lower_bound)
        front, tries = "", 0
        if capped_starts:
            best_seqs, best, used, front, tries = self.lower_memory_starts(
                best_seqs, best, capped_starts, first.less(steps_1, self.elapsed()))
            steps_1 += used
        phase1 = self.state(best_seqs)
        phase1_peak = phase1.max_peak()
        target = phase1.makespan()
        slack = p.makespan_slack_frac > 0
        steps_2, levels, memory_start = 0, 0, ""
        if p.memory_phase:
            left = total.less(steps_1, self.elapsed())
            # with a slack, this first part (at phase 1's makespan) gets only a share of the budget
            phase1_seqs = best_seqs
            search, steps_2 = self.memory_phase(target, best_seqs,
                                                left.scaled(p.slack_at_target_frac if slack else 1.0))
            if search.best_seqs is not None and search.best_peak < phase1_peak - _EPS:
                best_seqs = search.best_seqs
                levels = search.levels_total
                memory_start = "makespan phase"
            if slack:
                polish = left.scaled(p.slack_polish_frac)
                best_seqs, used, more = self.trade_time_for_memory(
                    best_seqs, phase1_seqs, target,
                    total.less(steps_1 + steps_2, self.elapsed()).less(polish.steps, polish.seconds), polish)
                steps_2 += used
                levels += more
        final = self.state(best_seqs)
        return AnnealOutcome(best_seqs, final.makespan(), final.max_peak(), steps_1 + steps_2, steps_1,
                             steps_2, p.seed, self.elapsed(), label,
                             phase1_makespan=phase1.makespan(), phase1_peak_memory=phase1_peak,
                             memory_levels=levels,
                             memory_start=memory_start, phase1_start=front or label, phase1_tries=tries)


def anneal_orders(model: SimModel, seqs: Sequence[Sequence[int]], lower_bound: float,
                  mem_cap: float | None = None, params: AnnealParams | None = None,
                  capped_starts: Sequence[tuple[str, Sequence[Sequence[int]], float]] = (),
                  label: str = "") -> AnnealOutcome:
    """Anneal one seed from the encoded orders ``seqs`` (one list of action ids per rank):
    :meth:`SeedSearch.run`."""
    return SeedSearch(model, lower_bound, mem_cap, params or AnnealParams()).run(seqs, capped_starts, label)


def _worker(args) -> AnnealOutcome:
    model, (label, seqs), lower_bound, mem_cap, params, capped_starts = args
    return anneal_orders(model, seqs, lower_bound, mem_cap, params, capped_starts, label)


def anneal_seeds(model: SimModel, starts: Sequence[tuple[str, Sequence[Sequence[int]]]], lower_bound: float,
                 mem_cap: float | None, seeds: Sequence[int], params: AnnealParams, num_workers: int = 1,
                 capped_starts: Sequence[tuple[str, Sequence[Sequence[int]], float]] = ()
                 ) -> tuple[AnnealOutcome, list[AnnealOutcome]]:
    """Anneal every seed, the ``k``-th seed from ``starts[k % len(starts)]`` (labelled orders;
    ``num_workers`` processes when > 1), each with the same labelled ``capped_starts`` for phase
    1's lower-memory tries and its memory phase's cap step the ``k``-th of ``params.memory_cap_steps``
    (cycling; docs/FUSED_SEARCH.md, "The cap step"); returns (best, all). Best = lowest makespan,
    then lowest peak memory, then lowest seed."""
    capped = [(label, [list(s) for s in start], peak) for label, start, peak in capped_starts]
    caps = params.memory_cap_steps
    jobs = [(model, (starts[k % len(starts)][0], [list(s) for s in starts[k % len(starts)][1]]), lower_bound, mem_cap,
             replace(params, seed=seed, memory=replace(params.memory, cap_step=caps[k % len(caps)])), capped)
            for k, seed in enumerate(seeds)]
    workers = max(1, min(num_workers, len(jobs), os.cpu_count() or 1))
    if workers == 1:
        outcomes = [_worker(job) for job in jobs]
    else:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(workers) as pool:
            outcomes = pool.map(_worker, jobs, chunksize=1)
    return best_outcome(outcomes, params.makespan_slack_frac), outcomes


def best_outcome(outcomes: Sequence[AnnealOutcome], makespan_slack_frac: float = 0.0) -> AnnealOutcome:
    """Lowest makespan (makespans within a relative 1e-9 of it count as equal: different timing
    passes differ in the last bits), then lowest peak memory, then lowest seed. With
    ``makespan_slack_frac`` > 0: lowest peak memory among the outcomes within that fraction of the
    shortest makespan any seed reached (in either phase), then lowest makespan, then lowest seed."""
    shortest = min(o.makespan for o in outcomes)
    if makespan_slack_frac > 0:
        shortest = min(shortest, *(o.phase1_makespan for o in outcomes)) * (1.0 + makespan_slack_frac)
    tol = 1e-9 * max(1.0, abs(shortest))
    eligible = [o for o in outcomes if o.makespan <= shortest + tol]
    if makespan_slack_frac > 0:
        return min(eligible, key=lambda o: (o.peak_memory, o.makespan, o.seed))
    return min(eligible, key=lambda o: (o.peak_memory, o.seed))
