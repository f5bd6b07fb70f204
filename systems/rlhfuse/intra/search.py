"""Fused actor+critic schedule search, end to end (RLHFuse, NSDI'25, arXiv 2409.13221, section 5).

This module owns :func:`search_fused_schedule`: given the fused pipes and their costs it builds
the serial 1F1B baseline and the greedy schedule, anneals from the better of the two (makespan
first, then adjacent-swap memory reduction), and reports the result against the lower bound.
Everything is scored by ``harness.schedule.simulate``; the returned schedule is checked with
``harness.schedule.validate``.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from harness.schedule import (PipeCosts, PipeSpec, Schedule, ScheduleError, sim_model, simulate,
                              validate)
from systems.rlhfuse.intra.anneal import AnnealParams, anneal_seeds
from systems.rlhfuse.intra.bounds import LowerBound, lower_bound_terms
from systems.rlhfuse.intra.greedy import greedy_schedule
from systems.rlhfuse.intra.pipes import serial_schedule


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
    bound_terms: dict[str, float] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=list)
    best_seed: int = 0

    @property
    def gap_to_lower_bound_frac(self) -> float:
        """``makespan / lower_bound - 1`` (0 when the bound is reached)."""
        return self.makespan / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    def summary(self) -> dict:
        """JSON-able numbers (no schedule)."""
        return {
            "makespan": self.makespan, "lower_bound": self.lower_bound,
            "gap_to_lower_bound_frac": self.gap_to_lower_bound_frac,
            "serial_makespan": self.serial_makespan, "greedy_makespan": self.greedy_makespan,
            "speedup_vs_serial": self.serial_makespan / self.makespan if self.makespan > 0 else 1.0,
            "peak_memory": self.peak_memory, "serial_peak_memory": self.serial_peak_memory,
            "greedy_peak_memory": self.greedy_peak_memory, "bubble_frac": self.bubble_frac,
            "search_s": self.search_s, "valid": self.valid, "steps": self.steps,
            "best_seed": self.best_seed, "lower_bound_terms": dict(self.bound_terms),
        }


def _encode(schedule: Schedule, costs: Mapping[str, PipeCosts]) -> list[list[int]]:
    model = sim_model(schedule, costs)
    return [model.encode(schedule.order.get(r, []), r) for r in schedule.ranks]


def search_fused_schedule(pipes: Mapping[str, PipeSpec], costs: Mapping[str, PipeCosts],
                          mem_cap: float | None = None, seed: int = 0,
                          time_limit_s: float | None = 60.0, max_steps: int | None = None,
                          num_workers: int = 1, num_seeds: int | None = None,
                          memory_phase: bool = True) -> FusedResult:
    """Search a fused schedule. ``num_seeds`` independent seeds ``seed, seed+1, ...`` (default:
    ``num_workers``) each get the full ``time_limit_s`` / ``max_steps`` budget and run
    ``num_workers`` at a time; the best wins (makespan, then peak memory, then lower seed).
    Raises ValueError if ``mem_cap`` is below the serial schedule's peak memory."""
    t_begin = time.perf_counter()
    pipes = dict(pipes)
    bound: LowerBound = lower_bound_terms(pipes, costs)
    serial = serial_schedule(pipes)
    serial_sim = simulate(serial, costs, record_times=False)
    if mem_cap is not None and mem_cap < serial_sim.max_peak_memory - 1e-9:
        raise ValueError(f"memory cap {mem_cap:g} is below the peak in-flight activation memory "
                         f"{serial_sim.max_peak_memory:g} that even the serial 1F1B schedule needs")
    try:
        greedy = greedy_schedule(pipes, costs, mem_cap)
        greedy_sim = simulate(greedy, costs, record_times=False)
    except ScheduleError:  # not for fused layouts (see greedy's safety rule); keep going
        greedy, greedy_sim = serial, serial_sim
    start, start_sim = (greedy, greedy_sim) if (greedy_sim.makespan, greedy_sim.max_peak_memory) <= \
        (serial_sim.makespan, serial_sim.max_peak_memory) else (serial, serial_sim)
    model = sim_model(start, costs)
    seeds = [seed + k for k in range(num_seeds or max(1, num_workers))]
    params = AnnealParams(seed=seed, time_limit_s=time_limit_s, max_steps=max_steps,
                          memory_phase=memory_phase)
    best, _ = anneal_seeds(model, _encode(start, costs), bound.value, mem_cap, seeds, params,
                           num_workers)
    ranks = start.ranks
    schedule = Schedule(pipes, {r: [model.actions[v] for v in seq] for r, seq in zip(ranks, best.seqs)})
    if (best.makespan, best.peak_memory) > (start_sim.makespan, start_sim.max_peak_memory):
        schedule = start  # cannot happen (the annealer keeps its best), but never return worse
    result = simulate(schedule, costs, record_times=False)
    try:
        validate(schedule)
        valid = True
    except ScheduleError:
        valid = False
    if mem_cap is not None and result.max_peak_memory > mem_cap + 1e-9:
        valid = False
    return FusedResult(
        schedule=schedule, makespan=result.makespan, lower_bound=bound.value,
        serial_makespan=serial_sim.makespan, greedy_makespan=greedy_sim.makespan,
        peak_memory=result.max_peak_memory, serial_peak_memory=serial_sim.max_peak_memory,
        bubble_frac=result.bubble_frac, search_s=time.perf_counter() - t_begin, valid=valid,
        steps=best.steps, greedy_peak_memory=greedy_sim.max_peak_memory,
        bound_terms=bound.terms(), seeds=seeds, best_seed=best.seed)
