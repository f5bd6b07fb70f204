"""The exact (CP-SAT) refinement of fused schedules: against brute force over every order of a
small fused layout, soundness of the bounds it proves, never worse than its start, and
determinism of the search with it. The makespan slack (memory for time) is checked against the
same brute force, in the refinement and in the whole search."""
import itertools

import pytest

from harness.schedule import Schedule, ScheduleError, sim_model, simulate, validate
from systems.rlhfuse.intra import (FusedSearchConfig, fused_costs, fused_pipes, greedy_schedule,
                                   search_fused_schedule)
from systems.rlhfuse.intra.exact import refine

REL = 1e-9


def _valid_rank_orders(model, ids):
    """Every order of one rank's actions in which each backward follows its own forward."""
    forward_of = {}
    for a in ids:
        if model.mem_delta[a] < 0:
            forward_of[a] = model.dep_a[a]
    for perm in itertools.permutations(ids):
        pos = {a: i for i, a in enumerate(perm)}
        if all(pos[f] < pos[b] for b, f in forward_of.items() if f in pos):
            yield list(perm)


def _all_schedules(pipes, costs):
    """(order per rank as action ids, makespan, peak) of every order that does not deadlock."""
    base = greedy_schedule(pipes, costs)
    model = sim_model(base, costs)
    ranks = base.ranks
    per_rank = [list(_valid_rank_orders(model, [model.encode(base.order[r], r)][0])) for r in ranks]
    out = []
    for combo in itertools.product(*per_rank):
        sched = Schedule(dict(pipes), {r: [model.actions[a] for a in seq] for r, seq in zip(ranks, combo)})
        try:
            sim = simulate(sched, costs, record_times=False)
        except ScheduleError:
            continue
        out.append(([list(s) for s in combo], sim.makespan, sim.max_peak_memory))
    return model, out


CASES = [dict(fwd1=1.0, fwd2=0.7, mem1=1.0, mem2=1.6, p2p=0.1),
         dict(fwd1=1.0, fwd2=1.3, mem1=2.0, mem2=1.0, p2p=0.0)]


def _small_layout(case):
    """2 ranks: a 2-stage model with 2 micro-batches one way, two 1-stage pipes the other way;
    (pipes, costs, model, every order with its makespan and peak)."""
    pipes = fused_pipes(2, 1, 2, 1)
    costs = fused_costs(pipes, case["fwd1"], case["fwd2"], mem1=case["mem1"], mem2=case["mem2"],
                        p2p=case["p2p"])
    return (pipes, costs, *_all_schedules(pipes, costs))


@pytest.mark.parametrize("case", CASES)
def test_exact_refinement_matches_brute_force(case):
    pipes, costs, model, every = _small_layout(case)
    assert len(every) > 100
    best_makespan = min(mk for _, mk, _ in every)
    # makespan: from the longest order, the solver finds the shortest and proves it
    worst = max(every, key=lambda e: (e[1], e[2]))
    out = refine(model, worst[0], "makespan", budget=30.0, seed=0)
    assert out.status == "OPTIMAL" and out.improved
    assert out.makespan == pytest.approx(best_makespan, rel=REL)
    assert out.bound <= best_makespan * (1 + REL)          # sound
    assert out.bound >= best_makespan * (1 - 1e-6)         # and tight (to the integer rounding)
    # memory: from the highest-peak order at each makespan level, the least peak at that makespan
    for level in sorted({round(mk, 9) for _, mk, _ in every})[:4]:
        at_level = [e for e in every if e[1] <= level * (1 + REL)]
        least = min(pk for _, _, pk in at_level)
        start = max((e for e in every if abs(e[1] - level) <= level * REL), key=lambda e: e[2])
        out = refine(model, start[0], "memory", budget=30.0, seed=0)
        assert out.status == "OPTIMAL"
        assert out.makespan <= start[1] * (1 + REL)
        assert out.peak_memory == pytest.approx(least, rel=1e-9)
        assert out.improved == (least < start[2] * (1 - REL))
        assert least * (1 - 0.011) <= out.bound <= least * (1 + REL)  # sound; memory rounds to 0.1% of an activation
    # under a cap at each peak level: the shortest schedule within it (the cap's implied
    # precedences and the first-in first-out rule cut off no schedule that fits)
    for cap in sorted({round(pk, 9) for _, _, pk in every})[:4]:
        fits = [e for e in every if e[2] <= cap * (1 + REL)]
        shortest = min(mk for _, mk, _ in fits)
        out = refine(model, worst[0], "makespan", budget=30.0, mem_cap=cap, seed=0)
        assert out.status == "OPTIMAL"
        assert out.peak_memory <= cap * (1 + REL)
        assert out.makespan == pytest.approx(shortest, rel=REL)
        assert out.bound <= shortest * (1 + REL)


@pytest.mark.parametrize("case", CASES)
def test_makespan_slack_gives_the_least_peak_within_it(case):
    # the least peak of any schedule within (1 + slack) x the optimal makespan, at the first few
    # makespan levels: from the refinement (proven) and from the search, annealing alone or refined
    pipes, costs, model, every = _small_layout(case)
    best_makespan = min(mk for _, mk, _ in every)
    fastest = max((e for e in every if e[1] <= best_makespan * (1 + REL)), key=lambda e: e[2])
    levels = sorted({round(mk, 9) for _, mk, _ in every})[:4]
    trades = 0
    for level in levels:
        least = min(pk for _, mk, pk in every if mk <= level * (1 + REL))
        out = refine(model, fastest[0], "memory", budget=30.0, seed=0, max_makespan=level)
        assert out.status == "OPTIMAL"
        assert out.makespan <= level * (1 + REL)
        assert out.peak_memory == pytest.approx(least, rel=1e-9)
        slack = level / best_makespan - 1.0
        if slack <= 0:
            continue
        trades += least < min(pk for _, mk, pk in every if mk <= best_makespan * (1 + REL)) * (1 - REL)
        # the whole search with the refinement: the shortest makespan proven, then the least peak
        # within the slack above it, proven
        res = search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=0, max_steps=3000,
                                                                           makespan_slack_frac=slack,
                                                                           exact_effort=5.0))
        assert res.valid and res.config.makespan_slack_frac == slack
        assert res.makespan_bound == pytest.approx(best_makespan, rel=1e-6)
        assert res.makespan <= level * (1 + REL)
        assert res.peak_memory == pytest.approx(least, rel=1e-9)
        assert least * (1 - 0.011) <= res.peak_bound <= least * (1 + REL)
        # annealing alone (which stops above the optimum on this layout): within the slack above
        # its own makespan phase, never above its peak
        alone = search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=0, max_steps=3000,
                                                                             makespan_slack_frac=slack))
        assert alone.valid
        assert alone.makespan <= alone.phase1_makespan * (1 + slack) * (1 + REL)
        assert alone.peak_memory <= alone.phase1_peak_memory * (1 + REL)
    if case == CASES[0]:
        assert trades > 0  # on this layout a longer makespan holds less: the check is not vacuous
    with pytest.raises(ValueError, match="below the given order"):
        refine(model, fastest[0], "memory", budget=1.0, max_makespan=best_makespan * 0.9)
    with pytest.raises(ValueError, match="max_makespan applies"):
        refine(model, fastest[0], "makespan", budget=1.0, max_makespan=best_makespan)
    with pytest.raises(ValueError, match="makespan_slack_frac"):
        search_fused_schedule(pipes, costs, config=FusedSearchConfig(max_steps=10, makespan_slack_frac=-0.1))


def test_refinement_is_never_worse_and_respects_the_cap():
    pipes = fused_pipes(4, 2, 4, 4)
    costs = fused_costs(pipes, 1.0, 0.6, mem1=1.0, mem2=0.7, p2p=0.05)
    start = greedy_schedule(pipes, costs)
    model = sim_model(start, costs)
    seqs = [model.encode(start.order[r], r) for r in start.ranks]
    before = simulate(start, costs, record_times=False)
    for objective in ("makespan", "memory"):
        for cap in (None, before.max_peak_memory):
            out = refine(model, seqs, objective, budget=0.3, mem_cap=cap, seed=3)
            sched = Schedule(dict(pipes), {r: [model.actions[a] for a in s]
                                           for r, s in zip(start.ranks, out.seqs)})
            validate(sched)
            sim = simulate(sched, costs, record_times=False)
            assert sim.makespan == pytest.approx(out.makespan, rel=REL)
            assert sim.max_peak_memory == pytest.approx(out.peak_memory, rel=REL)
            assert out.makespan <= before.makespan * (1 + REL)
            if objective == "memory":
                assert out.peak_memory <= before.max_peak_memory * (1 + REL)
                assert out.bound <= out.peak_memory * (1 + REL)
            else:
                assert out.bound <= out.makespan * (1 + REL)
            if cap is not None:
                assert out.peak_memory <= cap * (1 + REL)


def test_bad_arguments_are_refused():
    pipes = fused_pipes(2, 2, 2, 2)
    costs = fused_costs(pipes, 1.0, 1.0)
    start = greedy_schedule(pipes, costs)
    model = sim_model(start, costs)
    seqs = [model.encode(start.order[r], r) for r in start.ranks]
    with pytest.raises(ValueError, match="objective"):
        refine(model, seqs, "latency", budget=1.0)
    with pytest.raises(ValueError, match="budget"):
        refine(model, seqs, "memory", budget=0.0)
    with pytest.raises(ValueError, match="exact_effort"):
        search_fused_schedule(pipes, costs, config=FusedSearchConfig(max_steps=10, exact_effort=-1.0))
    with pytest.raises(ValueError, match="exact_workers"):
        search_fused_schedule(pipes, costs, config=FusedSearchConfig(max_steps=10, exact_effort=1.0, exact_workers=0))


def test_search_with_exact_refinement_is_deterministic_and_no_worse():
    pipes = fused_pipes(4, 2, 6, 6)
    costs = fused_costs(pipes, 1.0, 0.55, mem1=1.0, mem2=0.8, p2p=0.03)
    plain = search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=1, max_steps=600))
    runs = [search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=1, max_steps=600, exact_effort=0.4,
                                                                         exact_workers=2, num_workers=w, num_seeds=1))
            for w in (1, 1, 2)]
    for r in runs:
        assert r.valid
        assert r.exact.annealed_makespan == pytest.approx(plain.makespan, rel=REL)
        assert r.exact.annealed_peak_memory == pytest.approx(plain.peak_memory, rel=REL)
        assert r.makespan <= plain.makespan * (1 + REL)
        assert r.makespan > plain.makespan * (1 - REL) or r.exact.makespan_status != ""
        assert r.peak_memory <= plain.peak_memory * (1 + REL) or r.makespan < plain.makespan * (1 - REL)
        assert r.lower_bound <= r.makespan_bound <= r.makespan * (1 + REL)
        assert r.peak_bound <= r.peak_memory * (1 + REL)
        assert r.exact.memory_status in ("OPTIMAL", "FEASIBLE")
        sim = simulate(r.schedule, costs, record_times=False)
        assert sim.makespan == pytest.approx(r.makespan, rel=REL)
    # the same seed, steps, effort and solver threads give the same schedule, whatever the number
    # of annealing worker processes
    assert runs[0].schedule.order == runs[1].schedule.order == runs[2].schedule.order


def test_the_refinement_runs_only_where_no_pipe_has_more_than_exact_max_microbatches():
    pipes = fused_pipes(4, 2, 6, 3)  # actor pipe of 6 micro-batches, critic pipes of 3
    costs = fused_costs(pipes, 1.0, 0.55, mem1=1.0, mem2=0.8, p2p=0.03)
    plain = search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=1, max_steps=600))
    ran, skipped = (search_fused_schedule(pipes, costs, config=FusedSearchConfig(
        seed=1, max_steps=600, exact_effort=0.4, exact_max_microbatches=limit)) for limit in (6, 5))
    assert ran.config.exact_effort == 0.4 and ran.exact.memory_status in ("OPTIMAL", "FEASIBLE")
    assert ran.exact.annealed_peak_memory == pytest.approx(plain.peak_memory, rel=REL)
    # one pipe above the limit: annealing only, exactly as without the refinement, and the result says so
    assert skipped.config.exact_effort == 0.0 and skipped.exact.memory_status == ""
    assert skipped.schedule.order == plain.schedule.order and skipped.peak_memory == plain.peak_memory
    assert skipped.peak_bound == 0.0 and skipped.makespan_bound == plain.makespan_bound
    with pytest.raises(ValueError, match="exact_max_microbatches"):
        FusedSearchConfig(exact_max_microbatches=-1).check()
