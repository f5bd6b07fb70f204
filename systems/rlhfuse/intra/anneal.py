"""Simulated annealing over per-rank orders of a fused pipeline schedule (RLHFuse, NSDI'25,
arXiv 2409.13221, section 5).

This module owns the search loop; the incremental timing it scores with lives in
:mod:`systems.rlhfuse.intra.incremental` and always agrees with ``harness.schedule.simulate``.

- **Neighbourhood** (as in the paper): swap two adjacent actions on one rank. A proposal that
  would deadlock or break the activation-memory cap is discarded and another one drawn, so every
  step evaluates a valid schedule. With probability ``q_critical`` the swap is drawn from the
  ends of the blocks of a critical path (see ``OrderState.critical_swaps``: only those swaps can
  shorten the path), otherwise uniformly over all adjacent pairs. Uniform swaps alone barely
  move a schedule of thousands of actions: on 16+16 stages x 16+16 micro-batches they left the
  makespan where the greedy start had it after 30 000 steps; mixing in critical swaps reaches the
  lower bound in seconds.
- **Phase 1** (makespan): energy = makespan; Metropolis acceptance ``exp(-dE / T)`` with geometric
  cooling from ``T0`` to ``T1`` (both relative to the mean action time) over the phase's step or
  time budget, whichever runs out first. The uniform number ``u`` of the acceptance test is drawn
  *before* the move is timed, so the move is accepted iff its makespan is at most
  ``current - T ln u`` (the same law as Metropolis), and re-timing stops as soon as it proves the
  makespan will exceed that threshold. Stops early when the makespan reaches the lower bound.
- **Phase 2** (memory): from the best phase-1 order, energy = the largest per-rank peak of
  in-flight activation memory (plus a tiny share of the mean per-rank peak, so that moves
  lowering a non-maximal rank are not blind), accepting only moves whose makespan does not exceed
  phase 1's best (re-timing aborts past it). With probability ``q_memory`` the swap is one that
  can lower a peak: the action at a peak position of a rank at the largest peak with its
  successor. Stops early at the trivial memory bound (the largest single activation) or after
  ``memory_stall_steps`` steps without a lower peak.
- **Budget**: phase 1 may use ``phase1_frac`` of ``max_steps`` / ``time_limit_s``; phase 2 gets
  the rest, including whatever phase 1 left unused.
- **Determinism**: all randomness comes from ``random.Random(seed)``; with ``max_steps`` and no
  time limit the result is a pure function of the inputs. :func:`anneal_seeds` runs several seeds
  (in worker processes when ``num_workers > 1``), seed ``k`` from the ``k``-th of the given
  starting orders (cycling), and keeps the best by (makespan, peak memory, seed), which stays
  deterministic given (starts, seeds, max_steps).
"""
from __future__ import annotations

import math
import multiprocessing
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from harness.schedule import SimModel
from systems.rlhfuse.intra.incremental import OrderState, chain_tails

_EPS = 1e-9
MAX_DRAWS = 1000  # proposals tried per step before the step is counted as a rejected one


@dataclass
class AnnealParams:
    seed: int = 0
    time_limit_s: float | None = 60.0
    max_steps: int | None = None
    phase1_frac: float = 0.8
    t0_rel: float = 1.0    # start temperature / mean action time
    t1_rel: float = 0.02   # final temperature / mean action time
    q_critical: float = 0.8
    memory_phase: bool = True
    q_memory: float = 0.5
    memory_stall_steps: int | None = 20_000  # end phase 2 after this many steps without gain


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
    start_index: int = 0


class _Budget:
    """Step and wall-clock budget of one phase; ``frac()`` is the share used so far."""

    def __init__(self, steps: int | None, seconds: float | None):
        self.steps, self.seconds, self.t_start = steps, seconds, time.perf_counter()

    def frac(self, step: int) -> float:
        f = 0.0
        if self.steps is not None:
            f = step / self.steps if self.steps > 0 else 1.0
        if self.seconds is not None:
            f = max(f, (time.perf_counter() - self.t_start) / self.seconds if self.seconds > 0 else 1.0)
        return f


class _Proposer:
    """Draws valid adjacent swaps: with probability ``q`` a targeted one (``critical``: the ends
    of a critical path's rank blocks; ``memory``: a swap that lowers a peak of the rank with the
    largest peak, i.e. the action at a peak position with the next one), else a uniform one."""

    def __init__(self, state: OrderState, rng: random.Random, q: float, target: str = "critical"):
        self.state, self.rng, self.q, self.target = state, rng, q, target
        self.ranks = [r for r, s in enumerate(state.seqs) if len(s) > 1]
        self.targeted: list[tuple[int, int]] | None = None

    def changed(self) -> None:
        self.targeted = None

    def _targets(self) -> list[tuple[int, int]]:
        state = self.state
        if self.target == "critical":
            return state.critical_swaps(self.rng)
        top = state.max_peak()
        return [(r, k) for r, pk in enumerate(state.peak) if pk >= top - _EPS
                for k, held in enumerate(state.prefix[r][:-1]) if held >= top - _EPS]

    def propose(self, threshold: float):
        state, rng, seqs = self.state, self.rng, self.state.seqs
        for _ in range(MAX_DRAWS):
            if rng.random() < self.q:
                if self.targeted is None:
                    self.targeted = self._targets()
                if not self.targeted:
                    continue
                r, i = self.targeted[rng.randrange(len(self.targeted))]
            else:
                r = self.ranks[rng.randrange(len(self.ranks))]
                i = rng.randrange(len(seqs[r]) - 1)
            out = state.try_swap(r, i, threshold)
            if out is not None:
                return out
        return None


def _phase_makespan(state: OrderState, rng: random.Random, budget: _Budget, lower_bound: float,
                    temps: tuple[float, float], q: float) -> tuple[list[list[int]], float, int]:
    t0, t1 = temps
    proposer = _Proposer(state, rng, q)
    cur = state.makespan()
    best, best_seqs, step = cur, state.snapshot(), 0
    target = lower_bound + _EPS * max(1.0, abs(lower_bound))
    while best > target:
        frac = budget.frac(step)
        if frac >= 1.0:
            break
        step += 1
        temp = t0 * (t1 / t0) ** frac
        threshold = cur - temp * math.log(1.0 - rng.random())  # accept iff makespan <= this
        out = proposer.propose(threshold)
        if out is None:
            continue
        new = out[0]
        if new <= threshold:
            state.commit()
            proposer.changed()
            cur = new
            if new < best - _EPS:
                best, best_seqs = new, state.snapshot()
        else:
            state.revert()
    return best_seqs, best, step


def _mem_energy(state: OrderState, max_peak: float, r: int | None = None, rank_peak: float = 0.0) -> float:
    peaks = state.peak
    total = sum(peaks) if r is None else sum(peaks) - peaks[r] + rank_peak
    return max_peak + 1e-3 * total / max(len(peaks), 1)


def _phase_memory(state: OrderState, rng: random.Random, budget: _Budget, makespan_cap: float,
                  temps: tuple[float, float], floor: float, q: float, stall_steps: int | None):
    t0, t1 = temps
    proposer = _Proposer(state, rng, q, target="memory")
    cur = _mem_energy(state, state.max_peak())
    best_peak, best_seqs, step, best_step = state.max_peak(), state.snapshot(), 0, 0
    limit = makespan_cap + _EPS
    while best_peak > floor + _EPS:
        frac = budget.frac(step)
        if frac >= 1.0 or (stall_steps is not None and step - best_step >= stall_steps):
            break
        step += 1
        out = proposer.propose(limit)
        if out is None:
            continue
        new_makespan, new_peak = out
        if new_makespan > limit:
            state.revert()
            continue
        r, rank_peak = state.pending_rank_peak()
        energy = _mem_energy(state, new_peak, r, rank_peak)
        delta = energy - cur
        if delta <= 0 or rng.random() < math.exp(-delta / (t0 * (t1 / t0) ** frac)):
            state.commit()
            proposer.changed()
            cur = energy
            if new_peak < best_peak - _EPS:
                best_peak, best_seqs, best_step = new_peak, state.snapshot(), step
        else:
            state.revert()
    return best_seqs, best_peak, step


def anneal_orders(model: SimModel, seqs: Sequence[Sequence[int]], lower_bound: float,
           mem_cap: float | None = None, params: AnnealParams | None = None) -> AnnealOutcome:
    """Anneal one seed from the encoded orders ``seqs`` (one list of action ids per rank)."""
    p = params or AnnealParams()
    t_begin = time.perf_counter()
    rng = random.Random(p.seed)
    tails = chain_tails(model)
    state = OrderState(model, seqs, mem_cap, tails)
    if not any(len(s) > 1 for s in state.seqs):
        return AnnealOutcome(state.snapshot(), state.makespan(), state.max_peak(), 0, 0, 0, p.seed, 0.0)
    mean_dur = sum(model.dur) / max(len(model.dur), 1) or 1.0
    temps = (p.t0_rel * mean_dur, p.t1_rel * mean_dur)
    frac1 = p.phase1_frac if p.memory_phase else 1.0
    steps1 = None if p.max_steps is None else int(round(p.max_steps * frac1))
    secs1 = None if p.time_limit_s is None else p.time_limit_s * frac1
    best_seqs, best, steps_1 = _phase_makespan(state, rng, _Budget(steps1, secs1), lower_bound,
                                               temps, p.q_critical)
    steps_2 = 0
    if p.memory_phase:
        state = OrderState(model, best_seqs, mem_cap, tails)
        left_steps = None if p.max_steps is None else p.max_steps - steps_1
        left_s = None if p.time_limit_s is None else p.time_limit_s - (time.perf_counter() - t_begin)
        floor = max(max(model.mem_delta, default=0.0), 0.0)
        mem_temps = (p.t0_rel * max(floor, _EPS), p.t1_rel * max(floor, _EPS))
        best_seqs, _, steps_2 = _phase_memory(state, rng, _Budget(left_steps, left_s), best,
                                              mem_temps, floor, p.q_memory, p.memory_stall_steps)
    final = OrderState(model, best_seqs, mem_cap, tails)
    return AnnealOutcome(best_seqs, final.makespan(), final.max_peak(), steps_1 + steps_2, steps_1,
                         steps_2, p.seed, time.perf_counter() - t_begin)


def _worker(args) -> AnnealOutcome:
    model, seqs, lower_bound, mem_cap, params, start_index = args
    out = anneal_orders(model, seqs, lower_bound, mem_cap, params)
    out.start_index = start_index
    return out


def anneal_seeds(model: SimModel, starts: Sequence[Sequence[Sequence[int]]], lower_bound: float,
                 mem_cap: float | None, seeds: Sequence[int], params: AnnealParams,
                 num_workers: int = 1) -> tuple[AnnealOutcome, list[AnnealOutcome]]:
    """Anneal every seed, the ``k``-th seed from ``starts[k % len(starts)]`` (``num_workers``
    processes when > 1); returns (best, all). Best = lowest makespan, then lowest peak memory,
    then lowest seed."""
    jobs = [(model, [list(s) for s in starts[k % len(starts)]], lower_bound, mem_cap,
             AnnealParams(**{**params.__dict__, "seed": seed}), k % len(starts))
            for k, seed in enumerate(seeds)]
    workers = max(1, min(num_workers, len(jobs), os.cpu_count() or 1))
    if workers == 1:
        outcomes = [_worker(job) for job in jobs]
    else:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(workers) as pool:
            outcomes = pool.map(_worker, jobs, chunksize=1)
    best = min(outcomes, key=lambda o: (o.makespan, o.peak_memory, o.seed))
    return best, outcomes
