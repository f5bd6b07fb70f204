"""``+system=partial_rollout`` (baselines/partial_rollout.py): APRIL's over-provisioned partial
rollout on the refit plan.

Oracles: colocated by default (every task on every GPU), the plan partial rollout with the
configured over-provisioning and bound; in the run responses are carried and trained later, never
staler than the bound; knobs that cannot work are refused with their key."""
import pytest

from harness.core import metrics as mk
from harness.core.plan import OffPolicyPolicy
from harness.errors import HarnessError
from harness.system import discover_systems
from harness.testing import plan_for, simulate_iterations

SMALL = ["+system=partial_rollout", "model=7b", "cluster.num_nodes=1", "algo=grpo", "workload.global_batch_size=16",
         "workload.mini_batch_size=8", "system.train_layout=dp8tp1pp1"]


def test_is_found_and_colocated_by_default():
    assert "partial_rollout" in discover_systems()
    plan, ctx, _ = plan_for([*SMALL, "system.oversample_factor=1.5", "system.max_staleness=3"])
    assert plan.off_policy == OffPolicyPolicy(3, rollout="partial", oversample_factor=1.5)
    assert all(t.allocation.mesh == tuple(range(ctx.num_devices)) for t in plan.tasks)


def test_carried_responses_train_later_within_the_bound():
    _, rows = simulate_iterations([*SMALL, "system.max_staleness=2"], 5)
    assert all(m[mk.STALENESS_MAX] <= 2 for _, m in rows)
    assert max(m[mk.STALENESS_MAX] for _, m in rows) >= 1
    assert all(m[mk.CARRIED_SAMPLES] > 0 for _, m in rows)


@pytest.mark.parametrize("overrides,message", [
    (["system.oversample_factor=0.5"], "system.oversample_factor=0.5"),
    (["system.max_staleness=-1"], "system.max_staleness=-1"),
])
def test_bad_knobs_are_refused(overrides, message):
    with pytest.raises(HarnessError, match=message):
        plan_for([*SMALL, *overrides])
