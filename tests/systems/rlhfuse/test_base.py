"""RLHFuse-Base: the per-task search is exhaustive over feasible layouts and honours pinned ones."""
import pytest

from harness.errors import PlanError
from harness.testing import plan_for
from harness.planning.strategies import candidate_strategies, parse_layout


def test_candidates_cover_every_factorisation():
    cands = list(candidate_strategies(16, 8, num_layers=32))
    assert {(c.dp, c.tp, c.pp) for c in cands} == {
        (16 // (t * p), t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8, 16) if 16 % (t * p) == 0}
    assert all(c.size == 16 for c in cands)


def test_search_picks_the_fastest_estimate():
    """The chosen layout's estimate is <= every other feasible candidate's (recorded in notes)."""
    from harness.planning.estimate import inference_s, representative_batch
    from harness.core.plan import Allocation, Task

    plan, ctx, _ = plan_for(["+system=rlhfuse_base", "model=7b", "cluster.num_nodes=1"])
    batch = representative_batch(ctx)
    chosen = plan.task("ref").allocation.strategy
    mesh = tuple(range(ctx.num_devices))
    best = inference_s(ctx, Task("ref", "inference", "ref", Allocation(mesh, chosen)), batch)
    for cand in candidate_strategies(8, 8, 32):
        assert inference_s(ctx, Task("ref", "inference", "ref", Allocation(mesh, cand)), batch) >= best - 1e-12


def test_pinned_layout_is_used_and_checked():
    plan, _, _ = plan_for(["+system=rlhfuse_base", "model=7b", "cluster.num_nodes=1",
                           "system.layouts.gen=dp2tp4pp1"])
    s = plan.task("gen").allocation.strategy
    assert (s.dp, s.tp, s.pp) == (2, 4, 1)
    with pytest.raises(PlanError, match="tp=16"):
        plan_for(["+system=rlhfuse_base", "model=7b", "cluster.num_nodes=2", "system.layouts.gen=dp1tp16pp1"])
    with pytest.raises(PlanError, match="uses 16 devices, the cluster has 8"):
        plan_for(["+system=rlhfuse_base", "model=7b", "cluster.num_nodes=1", "system.layouts.gen=dp2tp8pp1"])
    with pytest.raises(PlanError, match="dp<D>tp<T>pp<P>"):
        parse_layout("tp8", 0, "gen")
