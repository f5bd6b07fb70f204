"""The fused search's annealing loop (RLHFuse section 5), objective MAKESPAN: its generator is
Python's, compiled and interpreted runs take the same steps, the best order it reports is what
``simulate`` times, a hard cap holds at every step, and cooling cycles end where they should.
(The MEMORY objective is tested through ``MemorySearch`` in test_intra_memory.py.)"""
import random

import numpy as np
import pytest

from harness.schedule import sim_model, simulate
from systems.rlhfuse.intra import OrderState, fused_costs, fused_pipes, greedy_schedule, loop
from systems.rlhfuse.intra import kernel


def _setup(n1=8, n2=4, m=8, p2p=0.1):
    pipes = fused_pipes(n1, n2, m, m)
    costs = fused_costs(pipes, 1.0, 0.6, mem1=1.0, mem2=0.5, p2p=p2p)
    start = greedy_schedule(pipes, costs, policy="larger")
    model = sim_model(start, costs)
    return pipes, costs, start, model, [model.encode(start.order[r], r) for r in start.ranks]


def _makespan_loop(model, seqs, rng, cap=None, rung=2**62, compiled=None, step=0, tol=0.0):
    mean = sum(model.dur) / model.num_actions
    params = loop.LoopParams(loop.MAKESPAN, 1.0 * mean, 0.02 * mean, rung, 1000, q_critical=0.8, tol=tol)
    return loop.Loop(OrderState(model, seqs, cap), loop.action_classes(model), params, loop.mt_state(rng),
                     best_makespan=OrderState(model, seqs).makespan(), step=step, compiled=compiled)


@pytest.mark.parametrize("form", ["compiled", "interpreted"])
def test_generator_gives_the_numbers_of_pythons_random(form):
    """MT19937 in the loop: random() and randrange(n) as random.Random gives them (n at the edges
    of powers of two, where the rejection loop decides), and the stream goes on in the Random."""
    uniform, below = loop._uniform, loop._below
    if form == "interpreted":
        uniform, below = kernel.interpreted(uniform), kernel.interpreted(below)
    ref = random.Random(11)
    ref.random()  # a state in the middle of a block of 624 words
    rs = loop.mt_state(ref)
    sizes = [1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 1000, 2**31 - 2, 2**31 - 1, 2**32 - 1] * 60
    ours = [(uniform(rs), below(rs, n)) for n in sizes]
    theirs_rng = random.Random(11)
    theirs_rng.random()
    assert ours == [(theirs_rng.random(), theirs_rng.randrange(n)) for n in sizes]
    loop.mt_restore(ref, rs)
    assert [ref.random() for _ in range(5)] == [theirs_rng.random() for _ in range(5)]


@pytest.mark.skipif(not kernel.AVAILABLE, reason="numba is not installed: nothing compiled to compare")
@pytest.mark.parametrize("capped", [False, True])
def test_makespan_objective_compiled_and_interpreted_step_for_step(capped):
    pipes, costs, start, model, seqs = _setup()
    cap = simulate(start, costs).max_peak_memory if capped else None
    runs = []
    for compiled in (True, False):
        rng = random.Random(3)
        run = _makespan_loop(model, seqs, rng, cap, compiled=compiled)
        trace = np.full((800, 3), np.nan)
        out = run.run(800, trace=trace)
        runs.append((run.compiled, out, run.step, trace, run.best_seqs(), float(run.state.best_makespan),
                     run.walk.rng.tolist()))
    (c_flag, *compiled), (p_flag, *interpreted) = runs
    assert c_flag and not p_flag
    assert np.array_equal(compiled[2], interpreted[2], equal_nan=True)
    assert compiled[:2] + compiled[3:] == interpreted[:2] + interpreted[3:]


@pytest.mark.parametrize("capped", [False, True])
def test_makespan_objective_best_is_what_simulate_times_and_cap_holds(capped):
    """The best order's recorded makespan is simulate's; it is no longer than the start; with a
    hard cap (the start's peak) every step's order holds at most the cap."""
    pipes, costs, start, model, seqs = _setup(4, 4, 6, 0.05)
    sim = simulate(start, costs)
    cap = sim.max_peak_memory if capped else None
    run = _makespan_loop(model, seqs, random.Random(1), cap)
    trace = np.full((3000, 3), np.nan)
    assert run.run(3000, trace=trace) == loop.STOPPED and run.step == 3000
    best = run.best_seqs()
    assert best is not None, "3000 steps from the greedy start found nothing shorter"
    decoded = {r: [model.actions[v] for v in s] for r, s in zip(start.ranks, best)}
    timed = simulate(type(start)(pipes, decoded), costs)
    assert timed.makespan == pytest.approx(run.state.best_makespan, rel=1e-12)
    assert timed.makespan < sim.makespan
    assert np.nanmin(trace[:, 0]) >= timed.makespan - 1e-9
    if capped:
        assert np.nanmax(trace[:, 2]) <= cap + 1e-9 and timed.max_peak_memory <= cap + 1e-9


def test_cooling_cycle_ends_at_its_rung_and_a_goal_ends_the_run():
    pipes, costs, start, model, seqs = _setup(4, 2, 4, 0.0)
    run = _makespan_loop(model, seqs, random.Random(0), rung=50, step=120)
    assert run.run(1000) == loop.CYCLE_END and run.step == 170
    reached = _makespan_loop(model, seqs, random.Random(0), tol=OrderState(model, seqs).makespan())  # at the goal
    assert reached.run(1000) == loop.DONE and reached.step == 0


@pytest.mark.parametrize("cap_step", [0.5, 0.005])
def test_memory_ladder_puts_the_next_cap_cap_step_activations_below_the_best_peak(cap_step):
    """MEMORY objective: an order at its own makespan is feasible at its own peak, so the loop
    records it at once and works on a cap ``cap_step`` smallest activations below it."""
    pipes, costs, start, model, seqs = _setup(4, 4, 6, 0.0)
    state = OrderState(model, seqs)
    peak, unit = state.max_peak(), min(d for d in model.mem_delta if d > 0)
    params = loop.LoopParams(loop.MEMORY, 2.0, 0.02, 10_000, 256, q_memory=0.5, q_critical=0.25, q_move=0.8,
                             max_shift=8, cap_step=cap_step, accept_tol=1e-9, target=state.makespan(), mem_unit=unit,
                             tol=state.makespan() * (1 + 1e-9), floor=max(model.mem_delta))
    run = loop.Loop(state, loop.action_classes(model), params, np.array([1, 1], dtype=np.int64))
    assert run.run(0) == loop.STOPPED
    assert run.best_seqs() == seqs and run.state.best_peak == peak
    assert run.state.cap == pytest.approx(peak - cap_step * unit, abs=1e-12)


@pytest.mark.parametrize("form", ["compiled", "interpreted"])
def test_memory_ladder_records_every_lower_peak_at_the_target_even_above_the_cap(form):
    """MEMORY objective: the record and the cap are apart. With the cap 12 smallest activations
    below the best (below anything the walk reaches), every lower peak at the target makespan is
    still recorded: the best is the least peak the walk visited there. (Before 2026-11-27 only
    orders under the cap were; this walk then records nothing.)"""
    pipes, costs, start, model, seqs = _setup(4, 4, 6, 0.0)
    state = OrderState(model, seqs)
    first, target, unit = state.max_peak(), state.makespan(), min(d for d in model.mem_delta if d > 0)
    tol, steps = target * (1 + 1e-9), 3000
    trace = np.zeros((steps, 3))
    params = loop.LoopParams(loop.MEMORY, 2.0, 0.02, 500, 256, q_memory=0.5, q_critical=0.25, q_move=0.8,
                             max_shift=8, cap_step=12.0, accept_tol=1e-9, target=target, mem_unit=unit, tol=tol,
                             floor=max(model.mem_delta))
    run = loop.Loop(state, loop.action_classes(model), params, np.array([5, 7], dtype=np.int64),
                    compiled=form == "compiled")
    run.run(steps, trace=trace)
    visited = [peak for makespan, _, peak in trace[:run.step] if makespan <= tol]
    visited += [state.max_peak()] if state.makespan() <= tol else []
    best = run.state.best_peak
    assert best < first - 1e-9 and run.state.levels >= 1
    assert best == pytest.approx(min(visited), abs=1e-12)
    assert min(visited) > run.state.cap + 1e-9  # never under the cap: recorded above it
    again = OrderState(model, run.best_seqs())
    assert again.max_peak() == pytest.approx(best, abs=1e-12) and again.makespan() <= tol


def test_commit_and_revert_need_a_pending_trial():
    pipes, costs, start, model, seqs = _setup(4, 2, 4, 0.0)
    state = OrderState(model, seqs)
    with pytest.raises(RuntimeError, match="no trial move to commit"):
        state.commit()
    assert any(state.try_swap(r, i) is not None for r in range(len(seqs)) for i in range(len(seqs[r]) - 1))
    state.revert()
    with pytest.raises(RuntimeError, match="no trial move to revert"):
        state.revert()
    assert state.seqs == seqs
