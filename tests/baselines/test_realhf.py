"""ReaLHF-style reallocation: search space, determinism, never worse than the start, offloading."""
import pytest

from baselines.realhf import mesh_options, strategy_options
from harness.planning.memory import check_plan_memory
from harness.testing import plan_for

SMALL = ["model=7b", "cluster.num_nodes=2"]


def test_mesh_options_are_aligned_node_slices_or_whole_node_ranges():
    meshes = mesh_options(num_nodes=2, gpus_per_node=8)
    # per node: 8 singles + 4 pairs + 2 quads = 14, x 2 nodes; whole-node ranges: [0], [1], [0,1]
    assert len(meshes) == 2 * 14 + 3
    for mesh in meshes:
        assert list(mesh) == list(range(mesh[0], mesh[0] + len(mesh)))
        if len(mesh) < 8:
            assert mesh[0] % len(mesh) == 0 and mesh[0] // 8 == mesh[-1] // 8
        else:
            assert len(mesh) % 8 == 0 and mesh[0] % 8 == 0


def _eager_mesh_options(num_nodes, gpus_per_node):
    """The search space written out in full, in the order the lazy sequence promises."""
    sizes = [d for d in range(1, gpus_per_node) if gpus_per_node % d == 0]
    slices = [tuple(range(n * gpus_per_node + o, n * gpus_per_node + o + size))
              for n in range(num_nodes) for size in sizes for o in range(0, gpus_per_node, size)]
    ranges = [tuple(range(a * gpus_per_node, b * gpus_per_node))
              for a in range(num_nodes) for b in range(a + 1, num_nodes + 1)]
    return slices + ranges


@pytest.mark.parametrize("num_nodes,gpus_per_node", [(1, 8), (2, 8), (5, 8), (3, 6), (4, 1), (7, 4)])
def test_mesh_options_are_made_on_demand_in_the_same_order(num_nodes, gpus_per_node):
    import random

    eager = _eager_mesh_options(num_nodes, gpus_per_node)
    lazy = mesh_options(num_nodes, gpus_per_node)
    assert len(lazy) == len(eager) and list(lazy) == eager and lazy[-1] == eager[-1] and lazy[1:4] == eager[1:4]
    with pytest.raises(IndexError):
        lazy[len(eager)]
    a, b = random.Random(5), random.Random(5)  # the annealing draws the same meshes as from a list
    assert [a.choice(lazy) for _ in range(40)] == [b.choice(eager) for _ in range(40)]


def test_mesh_options_at_4096_gpus_are_not_built():
    meshes = mesh_options(512, 8)
    assert len(meshes) == 512 * 14 + 512 * 513 // 2
    assert meshes[len(meshes) - 1] == tuple(range(511 * 8, 4096)) and meshes[512 * 14] == tuple(range(8))


def test_strategy_options_fill_the_mesh():
    opts = strategy_options(16, 8, num_layers=32, train=True, mini_batch=64, micro_batch=1, zero_stage=1)
    assert all(s.size == 16 and s.tp <= 8 and s.pp <= 32 and 64 % s.dp == 0 for s in opts)
    assert {(s.dp, s.tp, s.pp) for s in opts} >= {(16, 1, 1), (2, 8, 1), (1, 8, 2)}


def test_heuristic_layout():
    plan, ctx, _ = plan_for(["+system=realhf_heuristic", "model=13b"])
    for name in ("gen", "ref", "reward", "values", "update_actor", "update_critic"):
        s = plan.task(name).allocation.strategy
        assert (s.tp, s.pp, s.dp) == (8, 32, 1) and len(plan.task(name).allocation.mesh) == 256


def test_search_is_deterministic_and_never_worse_than_its_start():
    overrides = ["+system=realhf", *SMALL, "system.max_steps=40", "system.seed=3"]
    a, _, _ = plan_for(overrides)
    b, _, _ = plan_for(overrides)
    assert a.to_json() == b.to_json()
    assert a.notes["search/verified_step_s"] <= a.notes["search/start_verified_step_s"] + 1e-12
    assert a.notes["search/best_estimate_s"] <= a.notes["search/start_estimate_s"]
    assert a.notes["search/steps"] == 40


def test_refinement_keeps_the_annealing_plan_or_improves_its_estimate():
    base = ["+system=realhf", *SMALL, "system.max_steps=40", "system.seed=3"]
    annealed, _, _ = plan_for([*base, "system.num_refine_rounds=0"])
    refined, _, _ = plan_for(base)
    assert "search/refine_evaluations" not in annealed.notes
    assert refined.notes["search/steps"] == annealed.notes["search/steps"] == 40
    assert refined.notes["search/refine_evaluations"] > 0
    assert refined.notes["search/best_estimate_s"] <= annealed.notes["search/best_estimate_s"]
    if refined.notes["search/refine_improvements"] == 0:
        assert refined.to_dict()["tasks"] == annealed.to_dict()["tasks"]
    else:
        assert refined.notes["search/best_estimate_s"] < annealed.notes["search/best_estimate_s"]


def test_search_plans_use_sub_meshes_and_fit():
    plan, ctx, _ = plan_for(["+system=realhf", *SMALL, "system.max_steps=60"])
    plan.validate(ctx.num_devices)
    check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    for t in plan.tasks:
        assert set(t.allocation.mesh) <= set(range(ctx.num_devices))


def test_offloaded_ref_and_reward_pay_a_load():
    from harness.backends.sim import SimBackend
    from harness.core.workload import make_batch

    plan, ctx, run = plan_for(["+system=realhf_heuristic", *SMALL, "system.offload_ref_reward=true"])
    assert plan.offloaded == ["ref", "reward"]
    backend = SimBackend(run.backend, ctx)
    trace = backend.run_iteration(plan, 0, make_batch(run.workload, run.seed, 0))
    loads = [s for s in trace.spans if s.kind == "load"]
    assert {s.task for s in loads} == {"ref", "reward"}
    s = plan.task("ref").allocation.strategy
    expected = ctx.cost_model.host_transfer_s(ctx.cost_model.weights_gb(ctx.models.ref, s.tp, s.pp) * 1e9)
    assert loads[0].duration_s == pytest.approx(expected)


def test_task_times_do_not_change_when_a_mesh_moves_by_whole_nodes():
    """ReaLHF's evaluator keys training and inference times on meshes moved to node 0
    (``node_relative``): the cost model picks links by node membership only, so a mesh moved by
    whole nodes trains and infers in the same time, bit for bit."""
    from baselines.realhf import node_relative
    from harness.core.plan import Allocation, ParallelStrategy, Task
    from harness.planning.estimate import inference_s, representative_batch, training_s
    from harness.planning.workflow import single_pipe_stage
    from harness.testing import context

    ctx = context(["+system=realhf", "model=13b", "cluster.num_nodes=4", "workload.global_batch_size=64",
                   "workload.mini_batch_size=16"])
    batch, w, per_node = representative_batch(ctx), ctx.workload, ctx.cluster.gpus_per_node
    for strategy, first in [(ParallelStrategy(2, 2, 4, 1), 8), (ParallelStrategy(1, 4, 2, 1), 12)]:
        mesh = tuple(range(first, first + strategy.size))
        moved = Allocation(tuple(d + per_node for d in mesh), strategy)
        here = Allocation(mesh, strategy)
        assert node_relative(moved, per_node) == node_relative(here, per_node)
        for a in (here, moved):
            assert node_relative(a, per_node).mesh[0] == first % per_node
        stage = single_pipe_stage("update_actor", "actor", strategy, w.mini_batch_size, w.micro_batch_size,
                                  w.global_batch_size)
        times = [(training_s(ctx, Task("update_actor", "train", "actor", a), stage, w.mini_batch_size, batch),
                  inference_s(ctx, Task("ref", "inference", "ref", a), batch)) for a in (here, moved)]
        assert times[0] == times[1]
