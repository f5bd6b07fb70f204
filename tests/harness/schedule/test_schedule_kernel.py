"""The compiled list-scheduling pass and ``SimModel``'s Python pass (used below
``COMPILED_MIN_ACTIONS``) against a sweep-until-fixed-point oracle and against each other, on
random per-rank orders (valid, deadlocking and with repeated actions)."""
import random

import numpy as np
import pytest

from harness.compiled import AVAILABLE, interpreted
from harness.schedule import PipeCosts, PipeSpec
from harness.schedule.kernel import OK, list_schedule
from harness.schedule.simulate import SimModel, _EncodeError


def _model(seed):
    rng = random.Random(seed)
    pipes, costs = [], []
    for k in range(rng.randint(1, 3)):
        stages, mbs = rng.randint(1, 4), rng.randint(1, 5)
        ranks = tuple(rng.sample(range(4), stages)) if rng.random() < 0.5 else tuple(range(stages))
        pipes.append(PipeSpec("abc"[k], stages, mbs, ranks))
        costs.append(PipeCosts(tuple(rng.choice([0.5, 1.0, 1 / 3, 2.25]) for _ in range(stages)),
                               tuple(rng.choice([1.0, 2.0, 0.7]) for _ in range(stages)),
                               tuple(rng.choice([0.1, 1.0, 1 / 3]) for _ in range(stages)),
                               rng.choice([0.0, 0.05, 0.3])))
    return SimModel(pipes, costs)


def _orders(model, rng):
    """Each rank's actions in a random order that respects each pipe's own dependencies most of the
    time (so most orders run); sometimes an action repeated."""
    per_rank = {}
    for v, home in enumerate(model.home):
        per_rank.setdefault(home, []).append(v)
    seqs = []
    for r in range(max(model.home) + 1):
        seq = list(per_rank.get(r, []))
        if rng.random() < 0.5:
            rng.shuffle(seq)
        else:  # a topological-ish order: forwards mostly before their backwards
            seq.sort(key=lambda v: (v + rng.random() * 6))
        seqs.append(seq)
    if rng.random() < 0.1:
        r = rng.randrange(len(seqs))
        if seqs[r]:
            seqs[r].insert(rng.randrange(len(seqs[r]) + 1), rng.choice(seqs[r]))
    return seqs


def _oracle(model, seqs):
    """Sweep the ranks in turn, each as far as its dependencies allow, until nothing moves."""
    n = model.num_actions
    end, start = [-1.0] * n, [0.0] * n
    pos, clock = [0] * len(seqs), [0.0] * len(seqs)
    mem, peak = [0.0] * len(seqs), [0.0] * len(seqs)
    moved = True
    while moved:
        moved = False
        for r, seq in enumerate(seqs):
            while pos[r] < len(seq):
                a = seq[pos[r]]
                deps = [(model.dep_a[a], model.lat_a[a]), (model.dep_b[a], model.lat_b[a])]
                if any(d >= 0 and end[d] < 0 for d, _ in deps):
                    break
                if end[a] >= 0:
                    return "duplicate", a
                st = max([clock[r]] + [end[d] + lat for d, lat in deps if d >= 0])
                start[a], end[a] = st, st + model.dur[a]
                clock[r] = end[a]
                mem[r] += model.mem_delta[a]
                peak[r] = max(peak[r], mem[r])
                pos[r] += 1
                moved = True
    return end, start, clock, peak, pos


def _run(fn, model, seqs):
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    flat = np.array([v for s in seqs for v in s], dtype=np.int64)
    arrays = [np.array(x, dtype=np.int64 if k < 2 else np.float64)
              for k, x in enumerate((model.dep_a, model.dep_b, model.lat_a, model.lat_b, model.dur, model.mem_delta))]
    out = [np.empty(model.num_actions), np.empty(model.num_actions), np.empty(len(seqs)), np.empty(len(seqs)),
           np.empty(len(seqs), dtype=np.int64)]
    status = fn(flat, offsets, *arrays, *out)
    return status, [o.tolist() for o in out]


@pytest.mark.parametrize("seed", range(60))
def test_list_schedule_equals_oracle_and_interpreted(seed):
    rng = random.Random(seed)
    model = _model(seed)
    for _ in range(10):
        seqs = _orders(model, rng)
        expected = _oracle(model, seqs)
        status, got = _run(list_schedule, model, seqs)
        if expected[0] == "duplicate":
            assert status == expected[1]
            with pytest.raises(_EncodeError, match="appears more than once"):
                model._run_interpreted(seqs, True)
            continue
        assert status == OK
        end, start, clock, peak, pos = expected
        assert got[4] == pos
        assert got[0] == end  # bit-identical: the same additions and maxima
        ran = [a for r, s in enumerate(seqs) for a in s[:pos[r]]]
        assert [got[1][a] for a in ran] == [start[a] for a in ran]
        assert got[2] == clock and got[3] == peak
        if AVAILABLE:
            assert _run(interpreted(list_schedule), model, seqs) == (status, got)
        py_end, py_start, py_clock, py_peak, py_pos = model._run_interpreted(seqs, True)
        assert (py_end, py_clock, py_peak, py_pos) == (end, clock, peak, pos)
        assert [py_start[a] for a in ran] == [start[a] for a in ran]


def test_some_random_orders_deadlock_and_some_repeat():
    """The generator above covers all three outcomes (so the test above checks each)."""
    outcomes = set()
    for seed in range(60):
        rng = random.Random(seed)
        model = _model(seed)
        for _ in range(10):
            seqs = _orders(model, rng)
            expected = _oracle(model, seqs)
            if expected[0] == "duplicate":
                outcomes.add("duplicate")
            else:
                outcomes.add("deadlock" if any(p < len(s) for p, s in zip(expected[4], seqs)) else "runs")
    assert outcomes == {"duplicate", "deadlock", "runs"}


@pytest.mark.parametrize("seed", range(8))
def test_simulate_gives_the_same_result_on_either_tier(monkeypatch, seed):
    """``SimModel.run`` times in Python below ``COMPILE_AFTER_ACTIONS`` and compiled above: the
    same ``simulate`` result, and the same error for a repeated action, either way."""
    import importlib

    from harness.schedule import ScheduleError, build, simulate
    sim_module = importlib.import_module("harness.schedule.simulate")  # the package exports the function

    rng = random.Random(seed)
    pipes = [PipeSpec("a", 4, rng.randint(1, 6), (0, 1, 2, 3))]
    costs = {"a": PipeCosts(tuple(rng.choice([0.5, 1.0, 1 / 3]) for _ in range(4)), (1.0, 2.0, 0.7, 1.1),
                            (0.1, 1.0, 1 / 3, 0.2), 0.05)}
    schedule = build(rng.choice(["1f1b", "gpipe"]), pipes)
    results = []
    for after in (10**12, 0):
        monkeypatch.setattr(sim_module, "COMPILE_AFTER_ACTIONS", after)
        res = simulate(schedule, costs)
        results.append((res.makespan, res.busy, res.peak_memory, res.start, res.end))
    assert results[0] == results[1]
    order = dict(schedule.order)
    order[0] = list(order[0]) + [order[0][0]]
    bad = type(schedule)(schedule.pipes, order)
    for after in (10**12, 0):
        monkeypatch.setattr(sim_module, "COMPILE_AFTER_ACTIONS", after)
        with pytest.raises(ScheduleError, match="appears more than once"):
            simulate(bad, costs)


@pytest.mark.parametrize("seed", range(6))
def test_simulate_makespans_is_each_simulations_makespan_on_either_tier(monkeypatch, seed):
    """Planners' estimates time a stage's mini-batches with ``simulate_makespans``: the same
    makespans as ``simulate`` under each mini-batch's costs, bit for bit, on either tier, and the
    same deadlock error."""
    import importlib

    from harness.schedule import Action, ScheduleError, build, simulate, simulate_makespans
    sim_module = importlib.import_module("harness.schedule.simulate")

    rng = random.Random(seed)
    pipes = [PipeSpec("a", 4, rng.randint(1, 6), (0, 1, 2, 3)), PipeSpec("c", 2, rng.randint(1, 4), (3, 1))]
    costs_each = [{p.name: PipeCosts(tuple(rng.uniform(0.1, 2.0) for _ in range(p.num_stages)),
                                     tuple(rng.uniform(0.1, 3.0) for _ in range(p.num_stages)),
                                     tuple(rng.uniform(0.0, 1.0) for _ in range(p.num_stages)), rng.uniform(0, 0.2))
                   for p in pipes} for _ in range(rng.randint(1, 5))]
    schedule = build(rng.choice(["1f1b", "gpipe"]), pipes[:1])
    schedule = type(schedule)({p.name: p for p in pipes}, {
        r: list(schedule.order.get(r, [])) + list(build("1f1b", pipes[1:]).order.get(r, [])) for r in range(4)})
    for after in (10**12, 0):
        monkeypatch.setattr(sim_module, "COMPILE_AFTER_ACTIONS", after)
        assert simulate_makespans(schedule, costs_each) == [simulate(schedule, c).makespan for c in costs_each]
    stuck = type(schedule)({"a": pipes[0]}, {0: [Action("a", 0, "B", 0), Action("a", 0, "F", 0)],
                                             1: [], 2: [], 3: []})
    for after in (10**12, 0):
        monkeypatch.setattr(sim_module, "COMPILE_AFTER_ACTIONS", after)
        with pytest.raises(ScheduleError, match="deadlock"):
            simulate_makespans(stuck, costs_each[:1])


@pytest.mark.skipif(not AVAILABLE, reason="numba is not installed: nothing compiled")
def test_a_process_is_warm_once_a_kernel_ran():
    """``harness.compiled.warm`` (which lets ``SimModel.run`` switch to its kernel at once) is true
    after any compiled kernel has run in this process."""
    from harness import compiled

    model = _model(0)
    seqs = _orders(model, random.Random(0))
    _run(list_schedule, model, seqs)
    assert list_schedule.signatures and compiled.warm()
