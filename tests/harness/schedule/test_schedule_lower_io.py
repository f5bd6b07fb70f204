"""lower(): matched sends/recvs, unchanged makespan; IO round trips and Chrome trace."""
import json
from collections import Counter

import pytest

from harness.schedule import (
    Action, PipeCosts, PipeSpec, Schedule, ascii_grid, build, find_deadlock, from_csv,
    from_csv_string, lower, schedule_from_dict, schedule_to_dict, sequential_actor_critic,
    simulate, strip_comm, to_chrome_trace_events, to_csv, to_csv_string,
)
from harness.schedule.lower import comm_partner


def _schedules(p, m):
    actor = PipeSpec("A", p, m, tuple(range(p)))
    critic = PipeSpec("C", p, m, tuple(reversed(range(p))))
    return [build("1f1b", [actor]), build("gpipe", [actor]), sequential_actor_critic(actor, critic),
            build("gpipe", [PipeSpec("A", 2 * p, m, tuple(range(p)) * 2)])]


def _costs(p, p2p=0.0):
    return {"A": PipeCosts.uniform(2 * p, 1.0, 2.0, p2p=p2p), "C": PipeCosts.uniform(p, 0.5, 1.5, p2p=p2p)}


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 7) for m in (1, 2, 3, 5, 8)])
def test_lower_matches_and_keeps_makespan(p, m):
    for schedule in _schedules(p, m):
        lowered = lower(schedule)
        assert strip_comm(lowered) == schedule
        assert lower(lowered) == lowered
        assert find_deadlock(lowered) is None
        comm = [(r, a) for r, acts in lowered.order.items() for a in acts if not a.is_compute]
        placed = Counter(comm)
        assert all(n == 1 for n in placed.values())
        for rank, action in comm:
            peer, partner = comm_partner(action, rank)
            assert placed[(peer, partner)] == 1
            assert (partner.pipe, partner.mb, partner.peer) == (action.pipe, action.mb, rank)
        sends = sum(a.kind in ("SF", "SB") for _, a in comm)
        assert 2 * sends == len(comm)
        for p2p in (0.0, 0.3):
            costs = _costs(p, p2p)
            assert simulate(lowered, costs).makespan == simulate(schedule, costs).makespan


def test_lower_places_comm_next_to_compute():
    lowered = lower(build("1f1b", [PipeSpec("A", 2, 1, (0, 1))]))
    assert [a.token() for a in lowered.order[0]] == ["A0F0", "A0SF0>1", "A0RB0>1", "A0B0"]
    assert [a.token() for a in lowered.order[1]] == ["A1RF0>0", "A1F0", "A1B0", "A1SB0>0"]
    # P=2, M=1, F=1, B=2, p2p=0.5: 1 + 0.5 + 1 + 2 + 0.5 + 2 = 7
    assert simulate(lowered, {"A": PipeCosts.uniform(2, 1.0, 2.0, p2p=0.5)}).makespan == 7


def test_no_comm_when_neighbours_share_a_rank():
    lowered = lower(build("gpipe", [PipeSpec("A", 2, 2, (0, 0))]))
    assert all(a.is_compute for a in lowered.actions())


@pytest.mark.parametrize("token", ["A2F0", "C0B13", "actor3F1", "A2SF0>3", "C1RB4>0", "A0W2"])
def test_token_round_trip(token):
    assert Action.parse(token).token() == token
    action = Action.parse(token)
    assert Action.parse(action.token()) == action


def test_csv_and_dict_round_trip(tmp_path):
    for schedule in _schedules(3, 4):
        for s in (schedule, lower(schedule)):
            assert from_csv_string(to_csv_string(s), s.pipes) == s
            assert from_csv_string(to_csv_string(s), list(s.pipes.values())) == s
            path = tmp_path / "schedule.csv"
            to_csv(s, str(path))
            assert from_csv(str(path), s.pipes) == s
            assert schedule_from_dict(json.loads(json.dumps(schedule_to_dict(s)))) == s
    text = to_csv_string(build("1f1b", [PipeSpec("A", 2, 1, (0, 1))]))
    assert text.splitlines() == ["rank,0,1", "0,A0F0,A0B0", "1,A1F0,A1B0"]


def test_ragged_csv_rows_and_empty_rank():
    pipes = {"A": PipeSpec("A", 1, 2, (0,))}
    schedule = Schedule(pipes, {0: [Action("A", 0, "F", 0), Action("A", 0, "F", 1)], 1: []})
    text = to_csv_string(schedule)
    assert text.splitlines()[2] == "1,,"
    assert from_csv_string(text, pipes) == schedule


def test_ascii_grid_and_chrome_trace():
    schedule = sequential_actor_critic(PipeSpec("A", 2, 2, (0, 1)), PipeSpec("C", 2, 2, (1, 0)))
    costs = {"A": PipeCosts.uniform(2, 1.0, 2.0), "C": PipeCosts.uniform(2, 1.0, 2.0)}
    res = simulate(schedule, costs)
    grid = ascii_grid(schedule, res)
    lines = grid.splitlines()
    assert lines[1].startswith("r0 |") and "A0F0" in lines[1] and "C0B1" in lines[2]
    assert "makespan=17" in lines[-1]
    events = to_chrome_trace_events(schedule, res, pid_offset=10, time_scale_us=1.0)
    json.dumps(events)
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(schedule.actions())
    first = next(e for e in spans if e["name"] == "C0F0")
    assert (first["ts"], first["dur"], first["pid"]) == (7.0, 1.0, 11)
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"pipe A", "pipe C"}
    with pytest.raises(ValueError, match="record_times"):
        to_chrome_trace_events(schedule, simulate(schedule, costs, record_times=False))
