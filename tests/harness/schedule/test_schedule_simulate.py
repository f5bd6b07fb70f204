"""Closed forms and hand-computed cases for the schedule builders + simulate."""
import math

import pytest

from harness.schedule import (
    Action, PipeCosts, PipeSpec, Schedule, ScheduleError, build, forward_only, gpipe,
    one_f_one_b, sequential_actor_critic, simulate, validate,
)
from harness.schedule import list_order_peak_memory, lower

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]
UNIT_COSTS = [(1.0, 2.0), (1.0, 1.0)]


def _pipe(p, m, name="A", reverse=False):
    ranks = tuple(reversed(range(p))) if reverse else tuple(range(p))
    return PipeSpec(name, p, m, ranks)


@pytest.mark.parametrize("p,m", GRID)
def test_1f1b_and_gpipe_closed_forms(p, m):
    pipe = _pipe(p, m)
    for kind in ("1f1b", "gpipe"):
        schedule = build(kind, [pipe])
        validate(schedule)
        for f, b in UNIT_COSTS:
            res = simulate(schedule, {"A": PipeCosts.uniform(p, f, b)})
            assert res.makespan == pytest.approx((m + p - 1) * (f + b))
            assert all(busy == pytest.approx(m * (f + b)) for busy in res.busy.values())
            assert res.bubble_frac == pytest.approx((p - 1) / (m + p - 1))
            assert sum(res.idle.values()) == pytest.approx(p * res.makespan - p * m * (f + b))


@pytest.mark.parametrize("p,m", GRID)
def test_peak_activation_memory(p, m):
    pipe = _pipe(p, m)
    costs = {"A": PipeCosts.uniform(p, 1.0, 2.0, activation=1.0)}
    res = simulate(Schedule({"A": pipe}, one_f_one_b(pipe)), costs)
    assert res.peak_memory == {s: min(p - s, m) for s in range(p)}
    res = simulate(Schedule({"A": pipe}, gpipe(pipe)), costs)
    assert res.peak_memory == {s: m for s in range(p)}
    assert res.max_peak_memory == m


def _uneven_costs(pipes, seed):
    import random

    rng = random.Random(seed)
    return {p.name: PipeCosts((1.0,) * p.num_stages, (2.0,) * p.num_stages,
                              tuple(rng.choice([0.1, 0.3, 1 / 3, 2.7, 1e-3]) for _ in range(p.num_stages)))
            for p in pipes}


@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 4), (3, 7), (8, 16)])
def test_list_order_peak_memory_is_simulates_peak(p, m):
    """The memory check's untimed count equals the timed pass's peak, bit for bit, on every
    builder, lowered schedules (send/recv count nothing) and forward-only pipes."""
    actor, critic = _pipe(p, m, "A"), _pipe(p, m, "C", reverse=True)
    schedules = [build(kind, [actor]) for kind in ("1f1b", "gpipe")]
    schedules += [sequential_actor_critic(actor, critic), lower(build("1f1b", [actor])),
                  Schedule({"A": actor}, forward_only(actor))]
    for seed, schedule in enumerate(schedules):
        costs = _uneven_costs(schedule.pipes.values(), seed)
        assert list_order_peak_memory(schedule, costs) == simulate(schedule, costs).peak_memory


def test_list_order_peak_memory_of_fused_schedules():
    from systems.rlhfuse.intra import FusedSearchConfig, fused_costs, fused_pipes, search_fused_schedule

    pipes = fused_pipes(4, 2, 4, 4)
    for seed in range(3):
        schedule = search_fused_schedule(pipes, fused_costs(pipes, 1.0, 0.5), config=FusedSearchConfig(max_steps=50,
                                                                                                       seed=seed)).schedule
        costs = _uneven_costs(schedule.pipes.values(), seed)
        assert list_order_peak_memory(schedule, costs) == simulate(schedule, costs).peak_memory


def test_list_order_peak_memory_answers_from_its_memo_only_for_the_same_actions_and_activations():
    """The memory check's memo (keyed on each rank's actions by identity and the activations) gives
    the timed pass's peak again for a schedule built again from the same shared actions, and a fresh
    count for an edited list, for new action objects and for other activations."""
    pipe = _pipe(4, 6)
    costs = _uneven_costs([pipe], 0)
    first = list_order_peak_memory(build("1f1b", [pipe]), costs)
    again = build("1f1b", [pipe])
    assert list_order_peak_memory(again, costs) == first == simulate(again, costs).peak_memory
    edited = build("1f1b", [pipe])
    edited.order[0] = [a for a in edited.order[0] if not (a.kind == "B" and a.mb == 0)] + \
                      [a for a in edited.order[0] if a.kind == "B" and a.mb == 0]  # frees micro-batch 0 last
    assert list_order_peak_memory(edited, costs) == simulate(edited, costs).peak_memory
    assert list_order_peak_memory(edited, costs)[0] > first[0]
    copied = Schedule({"A": pipe}, {r: [Action(a.pipe, a.stage, a.kind, a.mb) for a in seq]
                                    for r, seq in build("1f1b", [pipe]).order.items()})
    assert list_order_peak_memory(copied, costs) == first
    doubled = {"A": PipeCosts(costs["A"].fwd, costs["A"].bwd, tuple(2 * a for a in costs["A"].activation))}
    assert list_order_peak_memory(again, doubled) == simulate(again, doubled).peak_memory != first


@pytest.mark.parametrize("p,m", [(1, 1), (3, 5), (8, 16)])
def test_forward_only(p, m):
    pipe = _pipe(p, m)
    schedule = Schedule({"A": pipe}, forward_only(pipe))
    validate(schedule, require_backward=False)
    with pytest.raises(ScheduleError, match="missing"):
        validate(schedule)
    res = simulate(schedule, {"A": PipeCosts.uniform(p, 1.0, 2.0, activation=0.5)})
    assert res.makespan == pytest.approx(m + p - 1)
    assert res.peak_memory == {s: 0.5 * m for s in range(p)}


def test_heterogeneous_two_stage_1f1b():
    # fwd=(1,2), bwd=(2,4), M=2, p2p=0. rank0 = [F0 F1 B0 B1], rank1 = [F0 B0 F1 B1]
    # r0: S0F0 0-1, S0F1 1-2
    # r1: S1F0 1-3 (waits S0F0), S1B0 3-7, S1F1 7-9, S1B1 9-13
    # r0: S0B0 7-9 (waits S1B0), S0B1 13-15 (waits S1B1)  -> makespan 15
    pipe = _pipe(2, 2)
    res = simulate(build("1f1b", [pipe]), {"A": PipeCosts((1, 2), (2, 4), (1, 1))})
    assert res.makespan == 15
    assert res.busy == {0: 6, 1: 12}
    assert res.idle == {0: 9, 1: 3}
    assert res.peak_memory == {0: 2, 1: 1}
    assert res.start[Action("A", 1, "F", 1)] == 7 and res.end[Action("A", 0, "B", 1)] == 15


def test_p2p_cost_hand_computed():
    # P=2, M=1, F=1, B=2, p2p=0.5: F0 0-1, +0.5, F1 1.5-2.5, B1 2.5-4.5, +0.5, B0 5-7
    pipe = _pipe(2, 1)
    res = simulate(build("1f1b", [pipe]), {"A": PipeCosts.uniform(2, 1.0, 2.0, p2p=0.5)})
    assert res.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_record_times_false_matches():
    pipe = _pipe(4, 8)
    schedule = build("1f1b", [pipe])
    costs = {"A": PipeCosts((1, 2, 1, 3), (2, 3, 2, 5), (1, 2, 3, 4), 0.25)}
    full, fast = simulate(schedule, costs), simulate(schedule, costs, record_times=False)
    assert (fast.makespan, fast.busy, fast.peak_memory) == (full.makespan, full.busy, full.peak_memory)
    assert fast.start == {} and fast.end == {}
    assert len(full.start) == len(schedule.actions())
    assert max(full.end.values()) == full.makespan
    for rank, actions in schedule.order.items():  # no overlap on a rank
        for prev, nxt in zip(actions, actions[1:]):
            assert full.end[prev] <= full.start[nxt]


@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 4), (4, 9), (8, 16)])
def test_sequential_actor_critic_bounds(p, m):
    actor, critic = _pipe(p, m, "A"), _pipe(p, m, "C", reverse=True)
    schedule = sequential_actor_critic(actor, critic)
    validate(schedule)
    costs = {"A": PipeCosts.uniform(p, 1.0, 2.0), "C": PipeCosts.uniform(p, 1.0, 2.0)}
    single = (m + p - 1) * 3.0
    res = simulate(schedule, costs)
    assert single <= res.makespan <= 2 * single
    assert schedule == build("sequential", [actor, critic])


def test_sequential_actor_critic_exact_p2_m2():
    # Actor (r0 = stage 0, r1 = stage 1), F=1, B=2: r0 [F0 F1 B0 B1], r1 [F0 B0 F1 B1]
    #   r0: A0F0 0-1, A0F1 1-2, A0B0 4-6, A0B1 7-9 ; r1: A1F0 1-2, A1B0 2-4, A1F1 4-5, A1B1 5-7
    # Critic reversed (stage 0 on r1, stage 1 on r0), appended on each rank:
    #   r1 free at 7: C0F0 7-8, C0F1 8-9
    #   r0 free at 9: C1F0 9-10, C1B0 10-12, C1F1 12-13, C1B1 13-15
    #   r1: C0B0 12-14 (waits C1B0), C0B1 15-17 (waits C1B1)
    # makespan 17 < 9 + 9: rank 1 starts critic work while rank 0 still finishes the actor.
    actor, critic = _pipe(2, 2, "A"), _pipe(2, 2, "C", reverse=True)
    costs = {"A": PipeCosts.uniform(2, 1.0, 2.0), "C": PipeCosts.uniform(2, 1.0, 2.0)}
    res = simulate(sequential_actor_critic(actor, critic), costs)
    assert res.makespan == 17
    assert res.start[Action("C", 0, "F", 0)] == 7
    assert res.busy == {0: 12, 1: 12}


def test_simulate_rejects_deadlock_duplicate_and_misplaced():
    pipe = _pipe(2, 2)
    costs = {"A": PipeCosts.uniform(2, 1.0)}
    tokens = {0: "A0F0 A0B0 A0F1 A0B1", 1: "A1F1 A1B1 A1F0 A1B0"}
    order = {r: [Action.parse(t) for t in ts.split()] for r, ts in tokens.items()}
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(Schedule({"A": pipe}, order), costs)
    assert "[A0B0]" in str(err.value) and "A1F1" in str(err.value)
    dup = build("1f1b", [pipe])
    dup.order[0].append(Action("A", 0, "F", 0))
    with pytest.raises(ScheduleError, match="more than once"):
        simulate(dup, costs)
    wrong = build("1f1b", [pipe])
    wrong.order[1].insert(0, wrong.order[0].pop(0))
    with pytest.raises(ScheduleError, match="lives on rank 0"):
        simulate(wrong, costs)


def test_bubble_frac_empty():
    res = simulate(Schedule({}, {}), {})
    assert res.makespan == 0 and res.bubble_frac == 0 and not math.isnan(res.max_peak_memory)
