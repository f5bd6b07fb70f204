"""``+system=rollpacker`` (baselines/rollpacker.py): RollPacker's tail batching on the refit plan.

Oracles: colocated, synchronous and on-policy (bound 0), speculation and the parallelism planner
as configured (its rule: tests/harness/planning/test_round_tp.py); in the run
short rounds queue prompts that a long round then trains, and nothing is stale; a speculation
below 1 is refused with its key."""
import pytest

from harness.core import metrics as mk
from harness.core.plan import OffPolicyPolicy
from harness.errors import HarnessError
from harness.system import discover_systems
from harness.testing import plan_for, simulate_iterations

SMALL = ["+system=rollpacker", "model=7b", "cluster.num_nodes=1", "algo=grpo", "workload.global_batch_size=16",
         "workload.mini_batch_size=8"]


def test_is_found_and_plans_synchronous_tail_batching():
    assert "rollpacker" in discover_systems()
    plan, ctx, _ = plan_for([*SMALL, "system.speculation=1.25"])
    assert plan.off_policy == OffPolicyPolicy(0, rollout="tail_batching", oversample_factor=1.25, round_tp="adaptive")
    assert all(t.allocation.mesh == tuple(range(ctx.num_devices)) for t in plan.tasks)


def test_long_rounds_follow_and_nothing_is_stale():
    _, rows = simulate_iterations([*SMALL, "system.speculation=1.5"], 6)
    assert all(m[mk.STALENESS_MAX] == 0 for _, m in rows)
    assert [m[mk.LONG_ROUND] for _, m in rows] == [0, 0, 1, 0, 0, 1]


def test_the_parallelism_planner_can_be_turned_off():
    plan, _, _ = plan_for([*SMALL, "system.parallelism_planner=false"])
    assert plan.off_policy.round_tp == "fixed"


def test_speculation_below_one_is_refused():
    with pytest.raises(HarnessError, match="system.speculation=0.5"):
        plan_for([*SMALL, "system.speculation=0.5"])
