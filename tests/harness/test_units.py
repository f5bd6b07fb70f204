"""Execution units of a plan (harness/core/units.py): what both backends start as one piece of work,
and the order they are listed in."""
import pytest

from harness.errors import PlanError
from harness.core.units import execution_units
from harness.core.plan import (Allocation, GenerationPolicy, ParallelStrategy, Plan, Task, TaskKind, TrainingStage)
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.workflow import PPO_TASKS
from harness.schedule import PipeSpec, build

FULL = Allocation((0, 1, 2, 3), ParallelStrategy(dp=2, tp=2))


def fused_stage() -> TrainingStage:
    pipes = [PipeSpec("A", 1, 1, (0,), "actor"), PipeSpec("C", 1, 1, (0,), "critic")]
    return TrainingStage(("update_actor", "update_critic"), build("1f1b", pipes), num_minibatches=2,
                         micro_batch_size=2)


def ppo_plan(ctx, **kw) -> Plan:
    allocations = {n: FULL for n in PPO_TASKS}
    allocations.update(kw.pop("allocations", {}))
    plan = assemble_ppo_plan(ctx, "test", allocations, GenerationPolicy(), **kw)
    plan.validate(4)
    return plan


def test_plain_plan_is_one_unit_per_task_in_topological_order(tiny_ctx):
    plan = ppo_plan(tiny_ctx, allocations={"gen": Allocation((0, 1, 2, 3), ParallelStrategy(tp=4))})
    units = execution_units(plan)
    assert [u.names for u in units] == [(n,) for n in plan.topological_order()]
    assert [u.label for u in units] == ["realloc_actor_gen", "gen", "ref", "reward", "values",
                                        "update_actor", "update_critic"]
    assert [u.kind for u in units] == [TaskKind.WEIGHT_MOVEMENT, TaskKind.GENERATE, TaskKind.INFERENCE,
                                       TaskKind.INFERENCE, TaskKind.INFERENCE, TaskKind.TRAIN, TaskKind.TRAIN]
    for u in units:
        assert u.stream_from is None
        assert (u.stage is not None) == (u.kind == TaskKind.TRAIN)
        if u.stage is not None:
            assert u.stage.tasks == u.names and not u.stage.fused
        assert u.devices == [0, 1, 2, 3]


def test_fused_stage_and_streaming_inference_are_one_unit_each(tiny_ctx):
    stage = fused_stage()
    plan = ppo_plan(tiny_ctx, training=[stage], stream_inference=True)
    units = execution_units(plan)
    assert [(u.kind, u.names) for u in units] == [
        (TaskKind.GENERATE, ("gen",)),
        (TaskKind.INFERENCE, ("ref", "reward", "values")),
        (TaskKind.TRAIN, ("update_actor", "update_critic")),
    ]
    inference, train = units[1], units[2]
    assert inference.stream_from == "gen" and inference.stage is None
    assert train.stage is stage and train.stream_from is None
    assert train.label == "update_actor+update_critic"


def test_unit_devices_are_the_union_of_its_tasks_meshes():
    stage = fused_stage()
    plan = Plan("t", [
        Task("update_actor", "train", "actor", Allocation((0, 1), ParallelStrategy(dp=2))),
        Task("update_critic", "train", "critic", Allocation((3, 2), ParallelStrategy(dp=2))),
    ], training=[stage])
    (unit,) = execution_units(plan)
    assert unit.devices == [0, 1, 2, 3]


def test_inference_without_stream_edges_stays_separate(tiny_ctx):
    plan = ppo_plan(tiny_ctx, training=[fused_stage()])
    assert [u.names for u in execution_units(plan)] == [
        ("gen",), ("ref",), ("reward",), ("values",), ("update_actor", "update_critic")]


def test_train_task_outside_any_stage_is_rejected(tiny_ctx):
    plan = ppo_plan(tiny_ctx, training=[])
    with pytest.raises(PlanError, match="update_actor.*not part of any training stage"):
        execution_units(plan)


def _grouped_member_depends_on_a_later_task() -> Plan:
    """Streaming ``values`` waits for a critic realloc task listed (and so topologically ordered)
    after ``ref``, the first member of the streaming group."""
    a = lambda *d: Allocation(d, ParallelStrategy(dp=len(d)))  # noqa: E731
    return Plan("t", [
        Task("gen", "generate", "actor", a(0, 1), ("prompts",), ("responses",)),
        Task("ref", "inference", "ref", a(0, 1), ("responses",), ("ref_logprobs",), "gen"),
        Task("realloc_critic_values", "weight_movement", "critic", a(2, 3), ("critic_weights",),
             ("critic_weights@values",)),
        Task("values", "inference", "critic", a(2, 3), ("responses", "critic_weights@values"), ("values",), "gen"),
    ])


def _stage_member_depends_on_a_later_task() -> Plan:
    """``update_critic`` waits for ``values``, which comes after ``update_actor``, the stage's first task."""
    a = lambda *d: Allocation(d, ParallelStrategy(dp=len(d)))  # noqa: E731
    return Plan("t", [
        Task("gen", "generate", "actor", a(0, 1), ("prompts",), ("responses",)),
        Task("update_actor", "train", "actor", a(0, 1), ("responses",), ("new_actor_weights",)),
        Task("values", "inference", "critic", a(2, 3), ("responses",), ("values",)),
        Task("update_critic", "train", "critic", a(2, 3), ("values",), ("new_critic_weights",)),
    ], training=[fused_stage()])


@pytest.mark.parametrize("make", [_grouped_member_depends_on_a_later_task, _stage_member_depends_on_a_later_task])
def test_units_come_after_every_task_they_depend_on(make):
    plan = make()
    plan.validate(4)
    deps = plan.dependencies()
    done: set[str] = set()
    for unit in execution_units(plan):
        outside = {d for n in unit.names for d in deps[n]} - set(unit.names)
        assert outside <= done, f"unit {unit.label} runs before {sorted(outside - done)}"
        done.update(unit.names)


@pytest.mark.parametrize("fused,stream", [(False, False), (True, False), (False, True), (True, True)])
def test_units_partition_the_plan_into_tasks_of_one_kind(tiny_ctx, fused, stream):
    """Every task is in exactly one unit, a unit's tasks are of its kind, a fused stage is one unit
    and the consumers of a stream one unit; every unit comes after the units it reads from."""
    plan = ppo_plan(tiny_ctx, allocations={"gen": Allocation((0, 1, 2, 3), ParallelStrategy(dp=4)),
                                      "values": Allocation((0, 1, 2, 3), ParallelStrategy(tp=4))},
                    training=[fused_stage()] if fused else None, stream_inference=stream)
    units = execution_units(plan)
    ran = [n for unit in units for n in unit.names]
    assert sorted(ran) == sorted(t.name for t in plan.tasks) and len(ran) == len(set(ran))
    for unit in units:
        assert {plan.task(n).kind for n in unit.names} == {unit.kind}, unit.label
        assert (unit.stage is not None) == (unit.kind == TaskKind.TRAIN)
        assert {plan.task(n).stream_from for n in unit.names} == {unit.stream_from}
    by_task = {n: unit for unit in units for n in unit.names}
    assert (by_task["update_actor"] is by_task["update_critic"]) == fused
    consumers = [t.name for t in plan.tasks if t.stream_from == "gen"]
    assert len({id(by_task[n]) for n in consumers}) == (1 if stream else 0)
    deps, seen = plan.dependencies(), set()
    for unit in units:
        assert {d for n in unit.names for d in deps[n]} - set(unit.names) <= seen, unit.label
        seen.update(unit.names)
