"""The PPO plan assembler: the resharding rule and the plans it assembles on a real context."""
import pytest

from harness.errors import PlanError
from harness.core.plan import (Allocation, Feature, GenerationPolicy, MovementKind, ParallelStrategy, ResidentState,
                          TaskKind, WeightMovement)
from harness.planning.assembler import assemble_ppo_plan, needs_movement
from harness.planning.workflow import PPO_TASKS

N = 4
FULL = tuple(range(N))


def A(mesh=FULL, dp=1, tp=1, pp=1, zero=0) -> Allocation:
    return Allocation(tuple(mesh), ParallelStrategy(dp=dp, tp=tp, pp=pp, zero_stage=zero))


# tiny workload: mini-batch 4, micro-batch 2, so training layouts need dp in {1, 2}
SHARED = A(dp=2, tp=2)


def allocs(**over) -> dict[str, Allocation]:
    out = {name: SHARED for name in PPO_TASKS}
    out.update(over)
    return out


def assemble(tiny_ctx, allocations, **kw):
    plan = assemble_ppo_plan(tiny_ctx, "test", allocations, GenerationPolicy(), **kw)
    plan.validate(N)
    return plan


def movement_tasks(plan):
    return [t.name for t in plan.tasks_of(TaskKind.WEIGHT_MOVEMENT)]


# ---- needs_movement ------------------------------------------------------------------------------
@pytest.mark.parametrize("source,target,expected", [
    (A(dp=2, tp=2), A(dp=2, tp=2), False),  # same mesh and layout
    (A(dp=2, tp=2), A(dp=1, tp=4), True),  # different tp
    (A(dp=2, tp=2), A(dp=2, pp=2), True),  # different tp and pp
    (A(dp=4), A(dp=2, pp=2), True),  # different dp and pp
    (A(dp=2, tp=2), A((3, 2, 1, 0), dp=2, tp=2), True),  # same devices, other order
    (A((0, 1), dp=2), A((2, 3), dp=2), True),  # different mesh
    (A(dp=2, tp=2, zero=3), A(dp=2, tp=2, zero=0), True),  # ZeRO-3 shards must be gathered
    (A(dp=2, tp=2, zero=3), A(dp=2, tp=2, zero=1), True),
    (A(dp=2, tp=2, zero=3), A(dp=2, tp=2, zero=3), False),  # identical ZeRO-3 allocation
    (A(dp=2, tp=2, zero=1), A(dp=2, tp=2, zero=0), False),  # ZeRO-1 holds full weights
    (A(dp=2, tp=2, zero=2), A(dp=2, tp=2, zero=0), False),
    (A(dp=2, tp=2, zero=0), A(dp=2, tp=2, zero=3), False),  # unsharded source, sharded consumer
])
def test_needs_movement_truth_table(source, target, expected):
    assert needs_movement(source, target) is expected


# ---- assemble_ppo_plan ---------------------------------------------------------------------------
def test_one_shared_allocation_moves_nothing(tiny_ctx):
    plan = assemble(tiny_ctx, allocs(update_actor=A(dp=2, tp=2, zero=1), update_critic=A(dp=2, tp=2, zero=1)))
    assert [t.name for t in plan.tasks] == list(PPO_TASKS)
    assert movement_tasks(plan) == [] and plan.weight_movements == []
    assert "actor_weights" in plan.task("gen").reads
    assert "critic_weights" in plan.task("values").reads
    assert plan.dependencies()["gen"] == []
    assert plan.features() == []
    assert plan.stream_edges() == []
    assert plan.resident == [ResidentState("actor", "update_actor", "train"),
                             ResidentState("critic", "update_critic", "train"),
                             ResidentState("ref", "ref", "weights"), ResidentState("reward", "reward", "weights")]
    # default training: each training task its own single-pipe stage
    assert [st.tasks for st in plan.training] == [("update_actor",), ("update_critic",)]
    assert not any(st.fused for st in plan.training)
    assert plan.global_batch_size == tiny_ctx.workload.global_batch_size
    assert plan.mini_batch_size == tiny_ctx.workload.mini_batch_size


def test_other_generation_layout_adds_a_realloc_task(tiny_ctx):
    gen = A(dp=1, tp=4)
    plan = assemble(tiny_ctx, allocs(gen=gen))
    assert movement_tasks(plan) == ["realloc_actor_gen"]
    task = plan.task("realloc_actor_gen")
    assert task.model == "actor" and task.allocation == gen
    assert task.reads == ("actor_weights",) and task.writes == ("actor_weights@gen",)
    assert plan.dependencies()["gen"] == ["realloc_actor_gen"]
    assert "actor_weights@gen" in plan.task("gen").reads and "actor_weights" not in plan.task("gen").reads
    assert plan.weight_movements == [WeightMovement("realloc_actor_gen", "actor", SHARED, gen, MovementKind.REALLOC)]
    assert plan.movement_of("realloc_actor_gen").kind == MovementKind.REALLOC
    order = plan.topological_order()
    assert order.index("realloc_actor_gen") < order.index("gen")


def test_other_values_layout_adds_a_critic_realloc_task(tiny_ctx):
    values = A(dp=4)
    plan = assemble(tiny_ctx, allocs(values=values))
    assert movement_tasks(plan) == ["realloc_critic_values"]
    assert plan.dependencies()["values"] == ["gen", "realloc_critic_values"]
    assert "critic_weights@values" in plan.task("values").reads and "critic_weights" not in plan.task("values").reads
    assert plan.movement_of("realloc_critic_values") == WeightMovement(
        "realloc_critic_values", "critic", SHARED, values, MovementKind.REALLOC)


@pytest.mark.parametrize("gen", [SHARED, A((2, 3), dp=2)])
def test_param_sync_always_moves_and_keeps_a_shadow_copy(tiny_ctx, gen):
    train = A((0, 1), dp=2) if gen.mesh == (2, 3) else SHARED
    allocations = allocs(gen=gen, update_actor=train)
    if gen.mesh == (2, 3):  # a separate generation pool
        allocations.update(ref=A((0, 1), dp=2), reward=A((0, 1), dp=2), values=A((0, 1), dp=2),
                           update_critic=A((0, 1), dp=2))
    plan = assemble(tiny_ctx, allocations, actor_sync=MovementKind.PARAM_SYNC)
    assert movement_tasks(plan) == ["param_sync"]
    assert plan.task("param_sync").allocation == gen
    assert plan.weight_movements == [WeightMovement("param_sync", "actor", train, gen, MovementKind.PARAM_SYNC)]
    assert plan.dependencies()["gen"] == ["param_sync"]
    assert ResidentState("actor", "gen", "weights") in plan.resident
    assert len(plan.resident) == 5


def test_streaming_inference_fetches_the_critic_per_replica(tiny_ctx):
    values = A(dp=4)
    plan = assemble(tiny_ctx, allocs(values=values, ref=values, reward=values), stream_inference=True)
    assert sorted(plan.stream_edges()) == [("gen", "ref"), ("gen", "reward"), ("gen", "values")]
    for name in ("ref", "reward", "values"):
        assert plan.task(name).stream_from == "gen"
    assert plan.task("gen").stream_from is None
    assert movement_tasks(plan) == []
    assert plan.weight_movements == [WeightMovement("values", "critic", SHARED, values, MovementKind.PER_REPLICA)]
    assert plan.movement_of("values").kind == MovementKind.PER_REPLICA
    # no task prepares the critic's weights: values reads them as they are
    assert "critic_weights" in plan.task("values").reads
    assert plan.dependencies()["values"] == ["gen"]
    assert set(plan.features()) == {Feature.STREAMING, Feature.PER_REPLICA_MOVEMENT}


def test_streaming_with_the_critic_in_place_moves_nothing(tiny_ctx):
    plan = assemble(tiny_ctx, allocs(), stream_inference=True)
    assert plan.weight_movements == [] and movement_tasks(plan) == []
    assert plan.features() == [Feature.STREAMING]


def test_streaming_still_reallocates_the_actor_as_a_task(tiny_ctx):
    plan = assemble(tiny_ctx, allocs(gen=A(dp=4), values=A(dp=4)), stream_inference=True)
    assert movement_tasks(plan) == ["realloc_actor_gen"]
    kinds = {m.task: m.kind for m in plan.weight_movements}
    assert kinds == {"realloc_actor_gen": MovementKind.REALLOC, "values": MovementKind.PER_REPLICA}


def test_offloaded_models_are_not_resident(tiny_ctx):
    plan = assemble(tiny_ctx, allocs(), offloaded=("ref", "reward"))
    assert plan.offloaded == ["ref", "reward"]
    assert {r.model for r in plan.resident} == {"actor", "critic"}
    assert Feature.OFFLOAD in plan.features()
    plan = assemble(tiny_ctx, allocs(), offloaded=("reward",))
    assert [r.model.value for r in plan.resident] == ["actor", "critic", "ref"]


def test_passed_training_stages_and_batch_sizes_are_kept(tiny_ctx):
    plan = assemble(tiny_ctx, allocs(), training=[], mini_batch_size=2, notes={"k": 1})
    assert plan.training == [] and plan.mini_batch_size == 2 and plan.notes == {"k": 1}


@pytest.mark.parametrize("missing", list(PPO_TASKS))
def test_missing_allocation_raises(tiny_ctx, missing):
    allocations = allocs()
    del allocations[missing]
    with pytest.raises(PlanError, match=missing):
        assemble_ppo_plan(tiny_ctx, "test", allocations, GenerationPolicy())


def test_actor_cannot_reach_generation_per_replica(tiny_ctx):
    with pytest.raises(PlanError, match="per replica"):
        assemble_ppo_plan(tiny_ctx, "test", allocs(), GenerationPolicy(), actor_sync=MovementKind.PER_REPLICA)
