"""Greedy list scheduler for fused pipelines (RLHFuse section 5): valid, timed like simulate,
never deadlocked by a memory cap the serial schedule meets."""
import pytest

from harness.schedule import ScheduleError, simulate, validate
from systems.rlhfuse.intra import fused_costs, fused_pipes, greedy_schedule, model_priority, serial_schedule
from systems.rlhfuse.intra import kernel
from systems.rlhfuse.intra.greedy import POLICIES

GRID = [((n1, n2), m) for n1, n2 in [(2, 2), (4, 2), (4, 4), (8, 4)] for m in (1, 2, 4, 8)]


@pytest.mark.parametrize("stages,m", GRID)
def test_greedy_valid_over_grid(stages, m):
    pipes = fused_pipes(*stages, m, m + 1)
    costs = fused_costs(pipes, 1.0, 0.5, mem1=1.0, mem2=0.5)
    for policy in POLICIES:
        for window in (None, 1.0, 2.0):
            sched = greedy_schedule(pipes, costs, policy=policy, window=window)
            validate(sched)


def test_paper_policy_prefers_larger_model_then_backward():
    pipes = fused_pipes(2, 2, 2, 2)
    costs = fused_costs(pipes, 1.0, 2.0)  # critic per-stage work 6 > actor 3
    assert model_priority(pipes, costs) == {"A": 1, "C": 0}
    assert model_priority(pipes, fused_costs(pipes, 1.0, 1.0)) == {"A": 0, "C": 1}  # tie: model 1
    sched = greedy_schedule(pipes, costs)
    # t=0: rank 0 can only start A0F0 (critic stage 1 waits), rank 1 only C0F0 (2 units);
    # t=1: rank 0 may run A0F1 only (C1F0 arrives at 2); at t=2 the critic comes first.
    assert [a.token() for a in sched.order[0]][:3] == ["A0F0", "A0F1", "C1F0"]
    assert [a.token() for a in sched.order[1]][:2] == ["C0F0", "C0F1"]


def test_equal_models_tie_goes_to_model1():
    pipes = fused_pipes(2, 2, 1, 1)
    sched = greedy_schedule(pipes, fused_costs(pipes, 1.0, 1.0))
    # t=0: A0F0 on rank 0, C0F0 on rank 1; t=1: C1F0 and A1F0 (the only ready actions);
    # t=2 on rank 1: A1B0 is ready, C0B0 waits for C1B0 (rank 0, until 4).
    assert [a.token() for a in sched.order[1]] == ["C0F0", "A1F0", "A1B0", "C0B0"]


@pytest.mark.parametrize("stages,m", GRID)
def test_greedy_respects_memory_cap(stages, m):
    pipes = fused_pipes(*stages, m, 2 * m)
    costs = fused_costs(pipes, 1.0, 1.0, mem1=2.0, mem2=1.0)
    cap = simulate(serial_schedule(pipes), costs).max_peak_memory  # the tightest cap allowed
    for policy in POLICIES:
        sched = greedy_schedule(pipes, costs, mem_cap=cap, policy=policy)
        validate(sched)
        assert simulate(sched, costs).max_peak_memory <= cap


def test_two_plus_two_stages_cap_two_does_not_deadlock():
    """The case the safety rule exists for: without it, rank 0 fills with two actor forwards and
    rank 1 with two critic forwards, and neither model's next forward fits anywhere."""
    pipes = fused_pipes(2, 2, 4, 4)
    costs = fused_costs(pipes, 1.0, 1.0)
    for policy in POLICIES:
        sched = greedy_schedule(pipes, costs, mem_cap=2.0, policy=policy)
        validate(sched)
        assert simulate(sched, costs).max_peak_memory <= 2.0


def test_greedy_makespan_is_simulated_makespan_with_p2p():
    pipes = fused_pipes(4, 2, 3, 5)
    costs = fused_costs(pipes, 1.0, 0.7, p2p=0.25)
    sched = greedy_schedule(pipes, costs, policy="alternate")
    res = simulate(sched, costs)
    # list-scheduling: every action starts when its rank is free and its inputs have arrived
    for rank, acts in sched.order.items():
        prev_end = 0.0
        for a in acts:
            assert res.start[a] >= prev_end - 1e-9
            prev_end = res.end[a]


def test_unknown_policy_and_bad_window():
    pipes = fused_pipes(2, 2, 1, 1)
    costs = fused_costs(pipes, 1.0, 1.0)
    with pytest.raises(ValueError, match="unknown greedy policy"):
        greedy_schedule(pipes, costs, policy="random")
    with pytest.raises(ValueError, match="window"):
        greedy_schedule(pipes, costs, window=0)


def test_a_cap_below_one_activation_stops_the_greedy_with_a_schedule_error():
    """A memory cap that admits no activation on any rank: the pass cannot place anything and says
    where it stopped, as a ScheduleError that callers catching ValueError (bad input) also see."""
    pipes = fused_pipes(4, 2, 4, 4)
    costs = fused_costs(pipes, 1.0, 1.0, mem1=1.0, mem2=0.6)
    with pytest.raises(ValueError, match=r"stuck at t=0 \(memory cap 0.5\)") as refused:
        greedy_schedule(pipes, costs, mem_cap=0.5)
    assert type(refused.value) is ScheduleError


@pytest.mark.skipif(not kernel.AVAILABLE, reason="numba is not installed: nothing compiled to compare")
@pytest.mark.parametrize("stages,m,p2p", [((4, 2), 6, 0.0), ((8, 4), 8, 0.05), ((4, 4), 5, 0.1)])
def test_compiled_and_interpreted_greedy_passes_agree(monkeypatch, stages, m, p2p):
    """The greedy pass compiled against the same function interpreted: the same schedule for
    every policy, window and cap, or the same refusal."""
    pipes = fused_pipes(*stages, m, m)
    costs = fused_costs(pipes, [1.0 + 0.1 * s for s in range(stages[0])], 0.7, mem1=1.0, mem2=0.6, p2p=p2p)
    serial_peak = simulate(serial_schedule(pipes), costs, record_times=False).max_peak_memory

    def run(policy, window, cap):
        try:
            return greedy_schedule(pipes, costs, cap, policy=policy, window=window).order
        except ScheduleError:
            return "stuck"

    for policy in POLICIES:
        for window in (None, 1.0, 2.0):
            for cap in (None, serial_peak, 1.5 * serial_peak):
                monkeypatch.setattr(kernel, "AVAILABLE", True)
                compiled = run(policy, window, cap)
                monkeypatch.setattr(kernel, "AVAILABLE", False)
                assert run(policy, window, cap) == compiled, (policy, window, cap)
