"""``+system=areal`` (baselines/areal.py): AReaL's fully asynchronous RL on the refit plan.

Oracles: the plan is continuous rollout with interruption, earliest-finished batches and the bound
eta, on pools of its own; in the run every trained sample is within eta, interrupted samples exist
once generation runs across weight updates, and eta = 0 trains nothing stale; eta below 0 is
refused with its key."""
import pytest

from harness.core import metrics as mk
from harness.core.plan import OffPolicyPolicy
from harness.errors import HarnessError
from harness.system import discover_systems
from harness.testing import plan_for, simulate_iterations

SMALL = ["+system=areal", "model=7b", "cluster.num_nodes=2", "algo=grpo", "workload.global_batch_size=16",
         "workload.mini_batch_size=8", "system.rollout_gpus=8"]


def test_is_found_and_plans_interruptible_continuous_rollout():
    assert "areal" in discover_systems()
    plan, _, _ = plan_for([*SMALL, "system.eta=3"])
    assert plan.off_policy == OffPolicyPolicy(3, rollout="continuous", weight_update="interrupt",
                                              batch_order="finish")
    assert not set(plan.task("gen").allocation.mesh) & set(plan.task("update_actor").allocation.mesh)


@pytest.mark.parametrize("eta", [0, 2])
def test_trained_samples_stay_within_eta(eta):
    _, rows = simulate_iterations([*SMALL, f"system.eta={eta}"], 5)
    assert all(m[mk.STALENESS_MAX] <= eta for _, m in rows)
    assert max(m[mk.STALENESS_MAX] for _, m in rows) == eta
    if eta:
        assert sum(m[mk.INTERRUPTED_SAMPLES] for _, m in rows) > 0


def test_negative_eta_is_refused():
    with pytest.raises(HarnessError, match="system.eta=-1"):
        plan_for([*SMALL, "system.eta=-1"])
