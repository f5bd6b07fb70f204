"""Memory phase of the fused-schedule search (RLHFuse section 5: minimise the peak memory with the
makespan fixed): trial moves agree with simulate, the phase never lengthens the schedule, never
exceeds a given memory cap, and is deterministic for a seed and step budget."""
import random

import numpy as np
import pytest

from harness.schedule import Schedule, ScheduleError, sim_model, simulate, validate
from systems.rlhfuse.intra import (FusedSearchConfig, MemorySearch, OrderState, fused_costs, fused_pipes,
                                   greedy_schedule, lower_bound, search_fused_schedule, serial_schedule)
from systems.rlhfuse.intra.anneal import AnnealParams, Candidate, anneal_orders
from systems.rlhfuse.intra import kernel
from systems.rlhfuse.intra.incremental import chain_tails
from systems.rlhfuse.intra.memory import MemoryParams


def _setup(n1=4, n2=4, m1=6, m2=6, p2p=0.0, policy="larger"):
    pipes = fused_pipes(n1, n2, m1, m2)
    costs = fused_costs(pipes, 1.0, 0.6, mem1=1.0, mem2=0.5, p2p=p2p)
    start = greedy_schedule(pipes, costs, policy=policy)
    model = sim_model(start, costs)
    seqs = [model.encode(start.order[r], r) for r in start.ranks]
    return pipes, costs, start, model, seqs


def _decode(model, ranks, seqs, pipes):
    return Schedule(pipes, {r: [model.actions[v] for v in s] for r, s in zip(ranks, seqs)})


def test_trial_moves_report_what_simulate_would_and_reject_exactly_the_deadlocks():
    pipes, costs, start, model, seqs = _setup(4, 2, 3, 4, p2p=0.1)
    state = OrderState(model, seqs)
    rng = random.Random(5)
    checked = rejected = 0
    while checked < 150:
        r = rng.randrange(len(state.seqs))
        n = len(state.seqs[r])
        i, j = rng.randrange(n), rng.randrange(n)
        if i == j:
            continue
        trial = [list(s) for s in state.seqs]
        trial[r].insert(j, trial[r].pop(i))
        try:
            res = simulate(_decode(model, start.ranks, trial, pipes), costs)
        except ScheduleError:
            res = None
        out = state.try_move(r, i, j)
        if res is None:
            assert out is None
            rejected += 1
            continue
        assert out == pytest.approx((res.makespan, res.max_peak_memory))
        state.commit() if rng.random() < 0.5 else state.revert()
        checked += 1
    assert rejected > 0


def _memory_search(model, seqs, target, cap, seed, steps):
    search = MemorySearch(model, chain_tails(model), target, cap, random.Random(seed))
    search.run(seqs, steps)
    return search


def test_memory_search_keeps_makespan_lowers_peak_and_is_deterministic():
    pipes, costs, start, model, seqs = _setup()
    lb = lower_bound(pipes, costs)
    phase1 = anneal_orders(model, seqs, lb, None, AnnealParams(seed=0, time_limit_s=None,
                                                                max_steps=3000, memory_phase=False))
    a = _memory_search(model, phase1.seqs, phase1.makespan, None, 1, 3000)
    b = _memory_search(model, phase1.seqs, phase1.makespan, None, 1, 3000)
    assert a.best_seqs == b.best_seqs and a.best_peak == b.best_peak
    sched = _decode(model, start.ranks, a.best_seqs, pipes)
    validate(sched)
    res = simulate(sched, costs)
    assert res.makespan <= phase1.makespan + 1e-9
    assert res.max_peak_memory == pytest.approx(a.best_peak)
    assert a.best_peak < phase1.peak_memory  # the greedy start floods the ranks with forwards


def test_memory_search_never_exceeds_a_cap():
    """Every order the memory phase steps through holds at most the cap (its trace records the
    peak of the order each step starts from), and so does its result."""
    pipes, costs, start, model, seqs = _setup(4, 2, 4, 8)
    cap = simulate(serial_schedule(pipes), costs).max_peak_memory
    low = greedy_schedule(pipes, costs, cap, policy="fifo", window=1.0)
    low_seqs = [model.encode(low.order[r], r) for r in low.ranks]
    target = simulate(low, costs).makespan
    search = MemorySearch(model, chain_tails(model), target, cap, random.Random(3))
    search.trace = np.full((2000, 3), np.nan)
    search.run(low_seqs, 2000)
    peaks = search.trace[:, 2]
    assert not np.isnan(peaks).any() and len(set(search.trace[:, 0])) > 1  # every step ran, orders changed
    assert peaks.max() <= cap + 1e-9
    assert search.best_peak <= cap + 1e-9
    res = simulate(_decode(model, low.ranks, search.best_seqs, pipes), costs)
    assert res.makespan <= target + 1e-9 and res.max_peak_memory <= cap + 1e-9


@pytest.mark.parametrize("stages,m,cap", [((4, 4), 8, None), ((8, 4), 8, None), ((4, 2), 6, "serial")])
def test_two_phases_never_lengthen_and_respect_the_cap(stages, m, cap):
    pipes = fused_pipes(*stages, m, m)
    costs = fused_costs(pipes, 1.0, 0.5, mem1=1.0, mem2=0.6)
    mem_cap = simulate(serial_schedule(pipes), costs).max_peak_memory if cap else None
    res = search_fused_schedule(pipes, costs, mem_cap=mem_cap, config=FusedSearchConfig(max_steps=4000))
    validate(res.schedule)
    assert res.valid
    assert res.makespan <= res.phase1_makespan * (1 + 1e-9)
    assert res.peak_memory <= res.phase1_peak_memory + 1e-9
    assert res.peak_memory_vs_serial == pytest.approx(res.peak_memory / res.serial_peak_memory)
    assert res.makespan_vs_lower_bound == pytest.approx(res.makespan / res.lower_bound)
    if mem_cap is not None:
        assert res.peak_memory <= mem_cap + 1e-9


def test_same_seed_and_steps_give_the_same_schedule_with_any_worker_count():
    pipes = fused_pipes(8, 4, 8, 8)
    costs = fused_costs(pipes, 1.0, 0.9, mem1=1.0, mem2=1.1)
    runs = [search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=3, max_steps=2500, num_seeds=2,
                                                                         num_workers=w))
            for w in (1, 1, 2)]
    assert runs[0].schedule.order == runs[1].schedule.order == runs[2].schedule.order
    assert runs[0].best_seed == runs[2].best_seed
    assert (runs[0].makespan, runs[0].peak_memory) == (runs[2].makespan, runs[2].peak_memory)


def test_default_budget_is_steps(monkeypatch):
    from systems.rlhfuse.intra import config as search_config
    monkeypatch.setattr(search_config, "DEFAULT_MAX_STEPS", 300)
    pipes = fused_pipes(2, 2, 2, 2)
    res = search_fused_schedule(pipes, fused_costs(pipes, 1.0, 1.0))
    assert res.config.time_limit_s is None and res.config.max_steps == 300 and res.steps <= 300


def test_phase1_takes_a_lower_memory_start_only_when_it_reaches_the_same_makespan():
    """The lower-memory cascade of phase 1: a capped start already at phase 1's makespan with less
    memory replaces phase 1's order (the memory phase then starts from it); one that cannot reach
    that makespan within its budget does not."""
    pipes, costs, start, model, seqs = _setup(4, 4, 6, 6, policy="critical_path")
    tails = chain_tails(model)
    plain = anneal_orders(model, seqs, lower_bound(pipes, costs), None,
                          AnnealParams(seed=1, time_limit_s=None, max_steps=3000, memory_phase=False))
    search = MemorySearch(model, tails, plain.makespan, None, random.Random(0))
    search.run(plain.seqs, 3000)
    assert search.best_seqs is not None and search.best_peak < plain.peak_memory
    low_seqs, low_peak = search.best_seqs, search.best_peak
    serial = serial_schedule(pipes)
    serial_seqs = [model.encode(serial.order[r], r) for r in start.ranks]
    serial_sim = simulate(serial, costs)
    assert serial_sim.makespan > plain.makespan and serial_sim.max_peak_memory < plain.peak_memory
    capped = [Candidate(serial_seqs, serial_sim.makespan, serial_sim.max_peak_memory, ("serial",)),
              Candidate(low_seqs, plain.makespan, low_peak, ("low",))]
    params = AnnealParams(seed=1, time_limit_s=None, max_steps=3000, memory_phase=False,
                          front_try_frac=1e-3)  # 3 steps for the serial order: it cannot get there
    out = anneal_orders(model, seqs, lower_bound(pipes, costs), None, params, capped_starts=capped, label="own")
    assert out.origin.startswith("low > makespan") and out.phase1_tries == 2 and out.start == "own"
    assert out.makespan == pytest.approx(plain.makespan) and out.peak_memory == pytest.approx(low_peak)
    res = simulate(_decode(model, start.ranks, out.seqs, pipes), costs)
    assert res.makespan == pytest.approx(plain.makespan) and res.max_peak_memory == pytest.approx(low_peak)
    # no lower-memory start at the makespan: phase 1's own order stays
    out = anneal_orders(model, seqs, lower_bound(pipes, costs), None, params, capped_starts=capped[:1], label="own")
    assert out.origin.startswith("own > makespan") and out.peak_memory == pytest.approx(plain.peak_memory)


def test_slack_part_keeps_only_lower_peaks_and_shortens_them():
    """The memory phase's part under a makespan slack: from an order at phase 1's makespan it keeps
    an order only if it holds less, within the slack, and anneals it back towards that makespan
    under a hard cap at its peak, tagging it with its origin; with no step budget it returns its
    input."""
    from systems.rlhfuse.intra.anneal import Budget, SearchContext, TimeForMemory

    pipes, costs, start, model, seqs = _setup(4, 4, 6, 6, policy="critical_path")
    before = OrderState(model, seqs, None, chain_tails(model))
    for slack in (0.02, 0.2):
        ctx = SearchContext(model, 0.0, None, AnnealParams(makespan_slack_frac=slack))
        own = ctx.candidate(seqs, ("own", "makespan"))
        out = TimeForMemory(own, own.makespan).run(ctx, own, Budget(3000, None), Budget(1000, None))
        after = simulate(_decode(model, start.ranks, out.seqs, pipes), costs)
        assert 0 < out.steps <= 4000 and out.levels > 0 and out.origin == ("own", "makespan", "time for memory")
        assert after.max_peak_memory == pytest.approx(out.peak) and after.makespan == pytest.approx(out.makespan)
        assert after.max_peak_memory < before.max_peak() - 1e-9
        assert after.makespan <= before.makespan() * (1 + slack) * (1 + 1e-9)
    ctx = SearchContext(model, 0.0, None, AnnealParams(makespan_slack_frac=0.2))
    own = ctx.candidate(seqs, ("own",))
    same = TimeForMemory(own, own.makespan).run(ctx, own, Budget(0, None), Budget(0, None))
    assert same.seqs == seqs and same.steps == 0 and same.levels == 0 and same.origin == ("own",)


@pytest.mark.parametrize("slack", [0.01, 0.1])
def test_slack_search_stays_within_its_slack_and_is_deterministic(slack):
    pipes = fused_pipes(8, 4, 8, 8)
    costs = fused_costs(pipes, 1.0, 0.9, mem1=1.0, mem2=1.1)
    runs = [search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=3, max_steps=3000, num_seeds=2,
                                                                         num_workers=w,
                                                                         makespan_slack_frac=slack)) for w in (1, 2)]
    assert runs[0].schedule.order == runs[1].schedule.order
    res = runs[0]
    assert res.valid and res.config.makespan_slack_frac == slack
    assert res.makespan <= res.phase1_makespan * (1 + slack) * (1 + 1e-9)
    assert res.peak_memory <= res.phase1_peak_memory * (1 + 1e-9)


@pytest.mark.skipif(not kernel.AVAILABLE, reason="numba is not installed: nothing compiled to compare")
@pytest.mark.parametrize("stages,m,p2p", [((4, 4), 6, 0.0), ((8, 4), 8, 0.1), ((4, 2), 5, 0.05)])
def test_compiled_and_python_passes_give_the_same_search(monkeypatch, stages, m, p2p):
    """The numba kernels (re-timing, critical path) compiled against interpreted: the same trial
    results move by move, and the same two-phase search result from the same seed."""
    pipes = fused_pipes(*stages, m, m)
    costs = fused_costs(pipes, 1.0, 0.7, mem1=1.0, mem2=0.6, p2p=p2p)
    start = greedy_schedule(pipes, costs, policy="critical_path")
    model = sim_model(start, costs)
    seqs = [model.encode(start.order[r], r) for r in start.ranks]
    fast, slow = OrderState(model, seqs, compiled=True), OrderState(model, seqs, compiled=False)
    assert fast.compiled and not slow.compiled
    rng = random.Random(7)
    for _ in range(400):
        r = rng.randrange(len(seqs))
        i, j = rng.randrange(len(seqs[r])), rng.randrange(len(seqs[r]))
        threshold = fast.makespan() * (1.0 + rng.random() * 0.05) if rng.random() < 0.5 else float("inf")
        outs = [s.try_move(r, i, j, threshold) for s in (fast, slow)]
        assert outs[0] == outs[1]
        if outs[0] is None:
            continue
        if outs[0][0] != float("inf") and rng.random() < 0.7:
            fast.commit(), slow.commit()
            assert fast.start == slow.start and fast.end == slow.end
        else:
            fast.revert(), slow.revert()
        assert fast.seqs == slow.seqs
        seed = rng.randrange(1000)
        assert fast.critical_swaps(random.Random(seed)) == slow.critical_swaps(random.Random(seed))
    results = {}
    for compiled in (True, False):
        monkeypatch.setattr(kernel, "AVAILABLE", compiled)
        results[compiled] = search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=2, max_steps=3000))
    assert results[True].schedule.order == results[False].schedule.order
    assert results[True].peak_memory == results[False].peak_memory


def test_memory_move_reach_reaches_the_memory_phase_only_and_is_deterministic():
    pipes = fused_pipes(8, 4, 8, 8)
    costs = fused_costs(pipes, 1.0, 0.9, mem1=1.0, mem2=1.1)
    runs = {reach: search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=1, max_steps=2000,
                                                                                memory_move_reach=reach))
            for reach in (1, 8, 64)}
    assert {reach: res.config.memory_move_reach for reach, res in runs.items()} == {1: 1, 8: 8, 64: 64}
    # The makespan phase never reads the reach: same seed, same phase-1 outcome whatever it is ...
    assert len({(res.phase1_makespan, res.phase1_peak_memory) for res in runs.values()}) == 1
    # ... and the memory phase does: the same seed and budget end in different orders and peaks.
    assert len({(res.peak_memory, repr(res.schedule.order)) for res in runs.values()}) > 1
    assert all(res.valid for res in runs.values())
    parallel = [search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=1, max_steps=2000, num_seeds=2,
                                                                             num_workers=w, memory_move_reach=64))
                for w in (1, 2)]
    assert parallel[0].schedule.order == parallel[1].schedule.order
    assert search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=1,
                                                                        max_steps=200)).config.memory_move_reach == 8


@pytest.mark.parametrize("reach", [0, -3, 2.5])
def test_memory_move_reach_must_be_a_positive_integer(reach):
    pipes = fused_pipes(4, 2, 4, 4)
    with pytest.raises(ValueError, match="memory_move_reach must be an integer >= 1"):
        search_fused_schedule(pipes, fused_costs(pipes, 1.0, 0.5), config=FusedSearchConfig(max_steps=10,
                                                                                            memory_move_reach=reach))


@pytest.mark.skipif(not kernel.AVAILABLE, reason="numba is not installed: nothing compiled to compare")
@pytest.mark.parametrize("stages,m,p2p,capped", [((4, 4), 6, 0.0, False), ((8, 4), 8, 0.1, True),
                                                  ((4, 2), 5, 0.05, False)])
def test_memory_kernel_compiled_and_interpreted_step_for_step(stages, m, p2p, capped):
    """The memory phase's kernel compiled and interpreted: the same makespan, area above the cap
    and peak at every step, the same best order, and two runs sharing the best peak."""
    pipes, costs, start, model, seqs = _setup(*stages, m, m, p2p=p2p)
    lb = lower_bound(pipes, costs)
    phase1 = anneal_orders(model, seqs, lb, None, AnnealParams(seed=0, time_limit_s=None, max_steps=1500,
                                                                memory_phase=False))
    cap = simulate(serial_schedule(pipes), costs).max_peak_memory * 1.5 if capped else None
    low = greedy_schedule(pipes, costs, cap, policy="fifo", window=1.0)
    searches = []
    for compiled in (True, False):
        search = MemorySearch(model, chain_tails(model), phase1.makespan, cap, random.Random(5), compiled=compiled)
        search.trace = np.full((1500, 3), np.nan)
        first = search.run(phase1.seqs if not capped else [model.encode(low.order[r], r) for r in low.ranks], 1500)
        trace = search.trace.copy()
        second = search.run(phase1.seqs, 700)
        searches.append((search.compiled, trace, search.trace[:700].copy(), first, second, search.best_seqs))
    (c_flag, c_trace, c_trace2, c_first, c_second, c_best), (p_flag, p_trace, p_trace2, p_first, p_second, p_best) = searches
    assert c_flag and not p_flag
    steps = c_first.steps
    assert steps > 0 and np.array_equal(c_trace[:steps], p_trace[:steps])
    assert np.array_equal(c_trace2, p_trace2, equal_nan=True)
    assert (c_first, c_second, c_best) == (p_first, p_second, p_best)


def test_memory_search_under_a_time_limit_takes_the_same_steps_in_slices():
    """A time limit runs the kernel in slices of steps with the clock read between them: with a
    limit that never runs out, the same steps and result as one call."""
    pipes, costs, start, model, seqs = _setup()
    lb = lower_bound(pipes, costs)
    phase1 = anneal_orders(model, seqs, lb, None, AnnealParams(seed=0, time_limit_s=None, max_steps=1500,
                                                                memory_phase=False))
    outs = []
    for seconds in (None, 1e9):
        search = MemorySearch(model, chain_tails(model), phase1.makespan, None, random.Random(2))
        outs.append(search.run(phase1.seqs, 1000, seconds))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_makespan_weight_keeps_the_walk_near_the_target_makespan(seed):
    """The memory energy prices each mean action time above the target makespan at
    ``makespan_weight`` activations above the cap: with the weight 16 instead of 1, the walk
    (its trace: the makespan each step starts from) spends more of its steps at the target and
    is less far above it on average; either way its result keeps the target."""
    pipes, costs, start, model, seqs = _setup(8, 4, 8, 8)
    phase1 = anneal_orders(model, seqs, lower_bound(pipes, costs), None,
                           AnnealParams(seed=0, time_limit_s=None, max_steps=1500, memory_phase=False))
    target, mean = phase1.makespan, sum(model.dur) / model.num_actions
    walks = []
    for weight in (1.0, 16.0):
        search = MemorySearch(model, chain_tails(model), target, None, random.Random(seed),
                              MemoryParams(makespan_weight=weight))
        search.trace = np.full((3000, 3), np.nan)
        search.run(phase1.seqs, 3000)
        makespans = search.trace[:, 0]
        assert not np.isnan(makespans).any()
        assert OrderState(model, search.best_seqs).makespan() <= target * (1 + 1e-9)
        walks.append((np.mean(makespans <= target * (1 + 1e-9)), np.mean(np.maximum(makespans - target, 0)) / mean))
    (at_1, excess_1), (at_16, excess_16) = walks
    assert at_16 > at_1 + 0.3 and excess_16 < excess_1 / 4
