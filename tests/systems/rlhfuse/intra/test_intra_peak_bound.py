"""The closed-form lower bound on the peak activation memory (bounds.peak_lower_bound): never above
the peak of any schedule no longer than the makespan it is given, on every greedy, serial and
annealed schedule of a grid of shapes with uneven costs and hops; exact on the shapes where it is
a closed form."""
import random

import pytest

from harness.schedule import PipeCosts, simulate
from systems.rlhfuse.intra import (FusedSearchConfig, fused_costs, fused_pipes, greedy_schedule,
                                   search_fused_schedule, serial_schedule)
from systems.rlhfuse.intra.bounds import peak_lower_bound
from systems.rlhfuse.intra.greedy import POLICIES


def _uneven(pipes, seed):
    rng = random.Random(seed)
    return {name: PipeCosts(tuple(rng.uniform(0.5, 2.0) for _ in range(p.num_stages)),
                            tuple(rng.uniform(1.0, 4.0) for _ in range(p.num_stages)),
                            tuple(rng.uniform(0.2, 3.0) for _ in range(p.num_stages)), rng.choice([0.0, 0.3]))
            for name, p in pipes.items()}


@pytest.mark.parametrize("stages,m", [((2, 2), 2), ((4, 2), 4), ((4, 4), 3), ((8, 4), 8)])
def test_no_schedule_holds_less_than_the_bound_at_its_makespan(stages, m):
    pipes = fused_pipes(*stages, m, m)
    for seed in range(3):
        costs = _uneven(pipes, seed)
        schedules = [serial_schedule(pipes)]
        for policy in POLICIES:
            try:
                schedules.append(greedy_schedule(pipes, costs, policy=policy))
            except Exception:  # a policy that does not apply to this layout
                continue
        schedules.append(search_fused_schedule(pipes, costs, None, FusedSearchConfig(seed=seed, max_steps=400)).schedule)
        for schedule in schedules:
            sim = simulate(schedule, costs, record_times=False)
            bound = peak_lower_bound(pipes, costs, sim.makespan)
            assert 0 < bound <= sim.max_peak_memory * (1 + 1e-12)
            # a longer schedule may hold less: the bound only falls as the makespan grows
            assert peak_lower_bound(pipes, costs, 2 * sim.makespan) <= bound


def test_the_bound_is_a_single_activation_without_pipelining():
    pipes = fused_pipes(1, 1, 4, 4)
    costs = fused_costs(pipes, 1.0, 1.0, mem1=2.0, mem2=0.5)
    assert peak_lower_bound(pipes, costs, 100.0) == 2.0  # one stage: nothing waits between F and B


def test_search_reports_the_higher_of_its_bounds():
    pipes = fused_pipes(4, 4, 8, 8)
    costs = fused_costs(pipes, 1.0, 1.0, mem1=1.0, mem2=1.0)
    res = search_fused_schedule(pipes, costs, None, FusedSearchConfig(max_steps=500))
    assert res.peak_lower_bound == pytest.approx(peak_lower_bound(pipes, costs, res.makespan))
    assert res.peak_bound == 0.0 and res.peak_lower_bound <= res.peak_memory
    assert res.summary()["peak_lower_bound_vs_serial"] == pytest.approx(res.peak_lower_bound / res.serial_peak_memory)
