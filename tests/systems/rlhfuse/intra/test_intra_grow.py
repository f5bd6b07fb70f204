"""A long fused order grown from a short one (systems.rlhfuse.intra.grow): the grown order runs
every action of the long schedule on its own rank, first-in first-out, without deadlock, and
holds exactly the short order's peak (a balanced segment frees what it holds); the search starts
seed 0 from it when every pipe has ``grow_min_microbatches`` and with enough budget, and not otherwise,
deterministically."""
import random

import pytest

from harness.schedule import PipeCosts, Schedule, sim_model, simulate, validate
from systems.rlhfuse.intra import FusedSearchConfig, fused_pipes, search_fused_schedule
from systems.rlhfuse.intra.grow import grow_order
from systems.rlhfuse.intra import search
from systems.rlhfuse.intra.search import _encode


def _uneven(pipes, seed):
    rng = random.Random(seed)
    stages = {p.num_stages for p in pipes.values()}
    fwd = {s: tuple(rng.uniform(0.5, 2.0) for _ in range(s)) for s in stages}
    return {name: PipeCosts(fwd[p.num_stages], tuple(2 * f for f in fwd[p.num_stages]),
                            tuple(rng.uniform(0.2, 3.0) for _ in range(p.num_stages)), 0.1)
            for name, p in pipes.items()}


@pytest.mark.parametrize("stages,m_small,m_large", [((4, 2), 4, 12), ((4, 4), 6, 12), ((2, 4), 3, 9)])
def test_grown_order_is_a_valid_schedule_with_the_short_orders_peak(stages, m_small, m_large):
    small_pipes, large_pipes = fused_pipes(*stages, m_small, m_small), fused_pipes(*stages, m_large, m_large)
    costs = _uneven(small_pipes, 1)
    short = search_fused_schedule(small_pipes, costs, None, FusedSearchConfig(max_steps=3000))
    large_model = sim_model(Schedule(large_pipes, {}), costs)
    seqs = grow_order(sim_model(short.schedule, costs), _encode(short.schedule, costs), large_model)
    assert seqs is not None
    schedule = Schedule(large_pipes, {r: [large_model.actions[a] for a in seq] for r, seq in enumerate(seqs)})
    validate(schedule)  # every action once, on its stage's rank
    sim = simulate(schedule, costs, record_times=False)  # raises on deadlock
    assert sim.max_peak_memory == pytest.approx(short.peak_memory, rel=1e-12)
    for seq in seqs:  # first-in first-out per (pipe, kind, stage)
        for cls in {(x.pipe, x.kind, x.stage) for x in map(large_model.actions.__getitem__, seq)}:
            mbs = [x.mb for x in map(large_model.actions.__getitem__, seq) if (x.pipe, x.kind, x.stage) == cls]
            assert mbs == sorted(mbs)


STEPS = 30_000  # a quarter is 7 500 steps, above GROW_MIN_SWEEPS (100) x the half's 64 actions


def test_search_starts_seed_0_grown_from_half_at_and_above_the_threshold(monkeypatch):
    pipes = fused_pipes(4, 2, 8, 8)
    costs = _uneven(pipes, 2)
    config = FusedSearchConfig(max_steps=STEPS, num_workers=1, num_seeds=2, grow_min_microbatches=8)
    grown = search_fused_schedule(pipes, costs, None, config)
    assert grown.valid
    one = FusedSearchConfig(max_steps=STEPS, grow_min_microbatches=8)
    monkeypatch.setattr(search, "GROW_MAX_GAP", float("inf"))  # whatever its makespan
    assert search_fused_schedule(pipes, costs, None, one).origin.startswith("grown > makespan")  # seed 0's start
    small_budget = FusedSearchConfig(max_steps=25_000, grow_min_microbatches=8)  # a quarter below 100 x 64
    assert "grown" not in search_fused_schedule(pipes, costs, None, small_budget).origin
    monkeypatch.setattr(search, "GROW_MAX_GAP", -1.0)  # never close enough to the bound
    assert "grown" not in search_fused_schedule(pipes, costs, None, one).origin
    monkeypatch.undo()
    plain = search_fused_schedule(pipes, costs, None, FusedSearchConfig(max_steps=STEPS, num_seeds=2,
                                                                        grow_min_microbatches=9))
    assert "grown" not in plain.origin
    off = search_fused_schedule(pipes, costs, None, FusedSearchConfig(max_steps=STEPS, num_seeds=2,
                                                                      grow_min_microbatches=0))
    assert (off.makespan, off.peak_memory, off.origin) == (plain.makespan, plain.peak_memory, plain.origin)
    twice = search_fused_schedule(pipes, costs, None, FusedSearchConfig(max_steps=STEPS, num_workers=2, num_seeds=2,
                                                                        grow_min_microbatches=8))
    assert twice.schedule.order == grown.schedule.order  # 1 and 2 workers: the same schedule


def test_only_a_layout_whose_every_pipe_reaches_the_threshold_grows(monkeypatch):
    """4/2 stages: one actor pipe of 8 micro-batches beside two critic pipes of 4 (Table 3's 8/4 and
    16/8 shapes): a threshold of 8 is met by the actor pipe only, so no seed starts grown; at 4
    every pipe meets it and seed 0 does (docs/FUSED_SEARCH.md, "Every pipe, not one")."""
    pipes = fused_pipes(4, 2, 8, 4)
    assert sorted(p.num_mbs for p in pipes.values()) == [4, 4, 8]
    costs = _uneven(pipes, 3)
    monkeypatch.setattr(search, "GROW_MAX_GAP", float("inf"))  # kept whatever its makespan, when grown
    assert "grown" not in search_fused_schedule(pipes, costs, None, FusedSearchConfig(
        max_steps=STEPS, grow_min_microbatches=8)).origin
    assert search_fused_schedule(pipes, costs, None, FusedSearchConfig(
        max_steps=STEPS, grow_min_microbatches=4)).origin.startswith("grown > makespan")


def test_half_is_searched_with_its_own_makespan_weights_and_the_long_row_with_the_seeds(monkeypatch):
    pipes = fused_pipes(4, 2, 8, 8)
    costs = _uneven(pipes, 2)
    searched, annealed = [], []
    inner_search, inner_anneal = search.search_fused_schedule, search.anneal_seeds
    monkeypatch.setattr(search, "search_fused_schedule", lambda *a: searched.append(a[3]) or inner_search(*a))
    monkeypatch.setattr(search, "anneal_seeds", lambda *a: annealed.append(a[5]) or inner_anneal(*a))
    config = FusedSearchConfig(max_steps=STEPS, num_seeds=2, grow_min_microbatches=8,
                               memory_makespan_weights=[8.0, 8.0], grow_makespan_weights=[8.0, 1.0])
    inner_search(pipes, costs, None, config)
    assert [c.memory_makespan_weights for c in searched] == [[8.0, 1.0]]  # the half's search, inner call
    assert [p.memory_makespan_weights for p in annealed] == [(8.0, 1.0), (8.0, 8.0)]  # half's seeds, then the row's


def test_grow_options_out_of_range_are_refused():
    with pytest.raises(ValueError, match="grow_min_microbatches"):
        FusedSearchConfig(grow_min_microbatches=-1).check()
    with pytest.raises(ValueError, match="grow_makespan_weights"):
        FusedSearchConfig(grow_makespan_weights=[]).check()
