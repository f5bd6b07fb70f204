"""validate(): accepts every builder output, rejects broken schedules with grid + explanation."""
import pytest

from harness.schedule import (
    Action, PipeSpec, Schedule, ScheduleError, build, find_deadlock, lower,
    sequential_actor_critic, validate,
)

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]


def _order(rows):
    return {r: [Action.parse(t) for t in tokens.split()] for r, tokens in rows.items()}


def _pipe(p=2, m=2, name="A", reverse=False):
    ranks = tuple(reversed(range(p))) if reverse else tuple(range(p))
    return PipeSpec(name, p, m, ranks)


@pytest.mark.parametrize("p,m", GRID)
def test_accepts_builder_outputs(p, m):
    actor, critic = _pipe(p, m, "A"), _pipe(p, m, "C", reverse=True)
    schedules = [build(kind, [actor]) for kind in ("1f1b", "gpipe")]
    schedules += [build("sequential", [actor, critic]), sequential_actor_critic(critic, actor)]
    for schedule in schedules:
        validate(schedule)
        validate(lower(schedule))
    validate(build("forward_only", [actor, critic]), require_backward=False)


def test_gpipe_with_several_stages_per_rank_is_valid():
    validate(build("gpipe", [PipeSpec("A", 4, 3, (0, 1, 0, 1))]))
    with pytest.raises(ValueError, match="one stage per rank"):
        build("1f1b", [PipeSpec("A", 4, 3, (0, 1, 0, 1))])


def _assert_has_grid(message, token):
    assert "rank x step grid" in message
    assert token in message


def test_rejects_deadlock():
    # rank 0 runs B of mb 0 before F of mb 1; rank 1 runs mb 1 first: each waits on the other.
    schedule = Schedule({"A": _pipe()}, _order({0: "A0F0 A0B0 A0F1 A0B1", 1: "A1F1 A1B1 A1F0 A1B0"}))
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "A0B0 waits for A1B0" in msg and "A1F1 waits for A0F1" in msg
    _assert_has_grid(msg, "[A1F1]")
    assert find_deadlock(schedule) == {0: 1, 1: 0}


def test_rejects_self_deadlock_b_before_f():
    schedule = Schedule({"A": _pipe(1, 1)}, _order({0: "A0B0 A0F0"}))
    with pytest.raises(ScheduleError, match="A0B0 waits for A0F0"):
        validate(schedule)


def test_rejects_duplicate():
    schedule = build("1f1b", [_pipe()])
    schedule.order[1].append(Action("A", 1, "F", 0))
    with pytest.raises(ScheduleError, match="A1F0 appears 2 times") as err:
        validate(schedule)
    _assert_has_grid(str(err.value), "A1B1")


def test_rejects_missing():
    schedule = build("1f1b", [_pipe()])
    schedule.order[0].remove(Action("A", 0, "B", 1))
    with pytest.raises(ScheduleError, match="A0B1 is missing") as err:
        validate(schedule)
    _assert_has_grid(str(err.value), "A0F1")


def test_rejects_wrong_rank():
    schedule = build("1f1b", [_pipe()])
    schedule.order[0].remove(Action("A", 0, "F", 1))
    schedule.order[1].insert(0, Action("A", 0, "F", 1))
    with pytest.raises(ScheduleError, match="stage 0 of pipe A lives on rank 0, not rank 1") as err:
        validate(schedule)
    _assert_has_grid(str(err.value), "A0F1")


@pytest.mark.parametrize("token,reason", [
    ("X0F0", "unknown pipe"), ("A5F0", "stage 5 out of range"), ("A0F7", "micro-batch 7 out of range"),
    ("A0W0", "split backward"),
])
def test_rejects_out_of_range(token, reason):
    schedule = build("1f1b", [_pipe()])
    schedule.order[0].append(Action.parse(token))
    with pytest.raises(ScheduleError, match=reason):
        validate(schedule)


def test_partial_backward_still_required_without_require_backward():
    schedule = build("1f1b", [_pipe()])
    schedule.order[0].remove(Action("A", 0, "B", 0))
    with pytest.raises(ScheduleError, match="A0B0 is missing"):
        validate(schedule, require_backward=False)


def test_rejects_broken_lowered_schedules():
    lowered = lower(build("1f1b", [_pipe()]))
    missing_recv = Schedule(lowered.pipes, {r: list(a) for r, a in lowered.order.items()})
    missing_recv.order[1].remove(Action("A", 1, "RF", 0, peer=0))
    with pytest.raises(ScheduleError, match="lacks A1RF0>0"):
        validate(missing_recv)
    wrong_peer = Schedule(lowered.pipes, {r: list(a) for r, a in lowered.order.items()})
    i = wrong_peer.order[0].index(Action("A", 0, "SF", 0, peer=1))
    wrong_peer.order[0][i] = Action("A", 0, "SF", 0, peer=5)
    with pytest.raises(ScheduleError, match="peer should be rank 1"):
        validate(wrong_peer)
    late_recv = Schedule(lowered.pipes, {r: list(a) for r, a in lowered.order.items()})
    recv = Action("A", 1, "RF", 0, peer=0)
    late_recv.order[1].remove(recv)
    late_recv.order[1].append(recv)
    with pytest.raises(ScheduleError, match="A1F0 waits for A1RF0>0"):
        validate(late_recv)
