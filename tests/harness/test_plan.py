"""Plan IR: JSON round trip, derived dependencies, structural checks."""
import pytest

from harness.errors import PlanError
from harness.core.plan import Allocation, ParallelStrategy, Plan, Task
from harness.testing import plan_for


def test_allocation_rejects_mismatched_strategy():
    with pytest.raises(PlanError, match="dp\\*tp\\*pp = 8"):
        Allocation(tuple(range(4)), ParallelStrategy(dp=2, tp=4, pp=1))


def test_allocation_device_order_is_tp_fastest():
    alloc = Allocation(tuple(range(16)), ParallelStrategy(dp=2, tp=4, pp=2))
    assert alloc.stage_devices(0, 0) == (0, 1, 2, 3)
    assert alloc.stage_devices(0, 1) == (4, 5, 6, 7)
    assert alloc.stage_devices(1, 0) == (8, 9, 10, 11)
    assert alloc.replica_devices(1) == tuple(range(8, 16))


@pytest.mark.parametrize("system", ["deepspeed_chat", "rlhfuse_base"])
def test_plan_json_round_trip(system):
    plan, _, _ = plan_for([f"+system={system}", "model=7b", "cluster.num_nodes=1"])
    again = Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    assert again.dependencies() == plan.dependencies()


def test_dependencies_follow_data_keys():
    plan, _, _ = plan_for(["+system=deepspeed_chat", "model=7b", "cluster.num_nodes=1"])
    deps = plan.dependencies()
    assert deps["gen"] == ["realloc_actor_gen"]
    assert deps["ref"] == ["gen"] and deps["reward"] == ["gen"]
    assert deps["update_actor"] == ["gen", "ref", "reward", "values"]
    # the critic's returns use the KL-penalised rewards: it waits for ref too
    assert deps["update_critic"] == ["gen", "ref", "reward", "values"]
    order = plan.topological_order()
    assert order.index("gen") < order.index("values") < order.index("update_critic")


def test_cycle_and_bad_devices_are_rejected():
    alloc = Allocation((0,), ParallelStrategy())
    plan = Plan("x", [Task("a", "inference", "ref", alloc, ("k2",), ("k1",)),
                      Task("b", "inference", "reward", alloc, ("k1",), ("k2",))])
    with pytest.raises(PlanError, match="cycle"):
        plan.validate(num_devices=1)
    plan = Plan("x", [Task("a", "inference", "ref", Allocation((5,), ParallelStrategy()))])
    with pytest.raises(PlanError, match="devices \\[5\\]"):
        plan.validate(num_devices=4)
