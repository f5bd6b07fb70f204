"""``+system=one_step_off`` (baselines/one_step_off.py) and NeMo-RL's asynchronous GRPO
(``system.max_trajectory_age_steps``): the refit plan with generation on GPUs of its own, made
off-policy.

Oracles: the plan's pools are disjoint and sized as asked; the searched rollout pool is the fastest
of the splits it names (each planned pinned, steady-state step compared); a trained batch is never
staler than the bound, and one-step-off trains every batch after the first one version stale; the
off-policy step is no longer than the same plan run synchronously (it overlaps the same work);
knobs that cannot work are refused with their key before any work."""
import dataclasses

import pytest

from harness.core import metrics as mk
from harness.core.plan import Feature, OffPolicyPolicy, TaskKind
from harness.errors import HarnessError
from harness.planning.estimate import simulated_makespan_s
from harness.system import discover_systems
from harness.testing import plan_for, simulate_iterations

SMALL = ["model=7b", "cluster.num_nodes=2", "algo=grpo", "workload.global_batch_size=16",
         "workload.mini_batch_size=8"]


def test_is_found():
    assert "one_step_off" in discover_systems()


def test_pools_are_disjoint_and_the_plan_is_one_step_off():
    plan, ctx, _ = plan_for(["+system=one_step_off", "system.rollout_gpus=4", *SMALL,
                             "workload.mini_batch_size=12", "workload.global_batch_size=12"])
    gen = set(plan.task("gen").allocation.mesh)
    train = {d for t in plan.tasks if t.kind in (TaskKind.TRAIN, TaskKind.INFERENCE) for d in t.allocation.mesh}
    assert gen == set(range(12, 16)) and train == set(range(12)) and not gen & train
    assert plan.off_policy == OffPolicyPolicy(1) and Feature.OFF_POLICY in plan.features()
    [sync] = plan.weight_movements
    assert sync.kind == "param_sync" and sync.target == plan.task("gen").allocation


def test_searched_split_is_the_fastest_of_the_pinned_ones():
    plan, ctx, _ = plan_for(["+system=one_step_off", *SMALL])
    steps = {}
    for gpus in (8, 12):  # 4 GPUs leave 12 to FSDP training, which cannot split a mini-batch of 8 samples
        pinned, _, _ = plan_for(["+system=one_step_off", f"system.rollout_gpus={gpus}", *SMALL])
        steps[gpus] = simulated_makespan_s(ctx, pinned)
    assert len(plan.task("gen").allocation.mesh) == min(steps, key=steps.get)
    assert "searched among [4, 8, 12]" in plan.notes["rollout_gpus"]


def test_staleness_and_overlap_in_the_run():
    plan, rows = simulate_iterations(["+system=one_step_off", "system.rollout_gpus=8", *SMALL], 4)
    stale = [m[mk.STALENESS_MAX] for _, m in rows]
    assert stale == [0.0, 1.0, 1.0, 1.0]
    _, sync_rows = simulate_iterations(["+system=one_step_off", "system.rollout_gpus=8", "system.max_staleness=0",
                                        *SMALL], 4)
    for (_, off), (_, on) in zip(rows[1:], sync_rows[1:]):
        assert off[mk.STEP_TIME] <= on[mk.STEP_TIME] * (1 + 1e-9)
        assert on[mk.STALENESS_MAX] == 0


def test_nemo_rl_async_grpo_searches_its_pools_when_none_is_given():
    plan, _, _ = plan_for(["+system=nemo_rl_async", *SMALL])
    assert plan.off_policy.max_staleness == 1 and plan.off_policy.weight_update == "inflight"
    assert "searched among [4, 8, 12]" in plan.notes["rollout_gpus"]


def test_nemo_rl_async_grpo_is_off_policy_on_its_own_pool():
    plan, _, _ = plan_for(["+system=nemo_rl", "system.generation_gpus=8", "system.max_trajectory_age_steps=2",
                           *SMALL, "system.train_layout=dp8tp1pp1"])
    # the collector: continuous, each step its own groups, prompts per step x age groups in flight
    assert plan.off_policy == OffPolicyPolicy(2, rollout="continuous", weight_update="drain",
                                              batch_order="iteration", max_groups_in_flight=16 * 2)
    inflight, _, _ = plan_for(["+system=nemo_rl", "system.generation_gpus=8", "system.max_trajectory_age_steps=2",
                               "system.in_flight_weight_updates=true", *SMALL, "system.train_layout=dp8tp1pp1"])
    assert inflight.off_policy.weight_update == "inflight"
    assert set(plan.task("gen").allocation.mesh) == set(range(8, 16))
    sync, _, _ = plan_for(["+system=nemo_rl", "system.generation_gpus=8", *SMALL, "system.train_layout=dp8tp1pp1"])
    assert sync.off_policy is None and dataclasses.replace(plan, off_policy=None) == sync


@pytest.mark.parametrize("overrides,message", [
    (["+system=nemo_rl", "system.generation_gpus=8", "system.generation_nodes=1"], "set one"),
    (["+system=one_step_off", "system.rollout_gpus=16"], "system.rollout_gpus=16: generation needs 0"),
    (["+system=one_step_off", "system.max_staleness=-1"], "system.max_staleness=-1"),
])
def test_bad_knobs_are_refused(overrides, message):
    with pytest.raises(HarnessError, match=message):
        plan_for([*overrides, *SMALL])


@pytest.mark.parametrize("system, extra, message", [
    ("one_step_off", ["algo=dapo", "system.rollout_gpus=2"], "dynamic sampling in an off-policy plan"),
])
def test_backend_ray_refuses_what_it_does_not_run_ahead_before_any_work(tmp_path, system, extra, message):
    """backend=ray runs batched, continuous and partial rollout, tail batching and length dispatch
    (tests/harness/backends/ray/test_ray_off_policy.py, test_ray_partial_rollout.py); dynamic
    sampling's rounds ahead of training are refused after planning, before Ray starts or anything
    is written."""
    from harness.errors import PlanError
    from harness.run.pipeline import compose, execute

    cfg = compose([f"+system={system}", "backend=ray", "backend.options.reward.kind=token_range", "model=tiny",
                   "workload=tiny", "algo=grpo", *extra, "cluster=h100_8x", "cluster.num_nodes=1",
                   "cluster.gpus_per_node=4", "logger=none", f"results_dir={tmp_path}"])
    with pytest.raises(PlanError, match=message):
        execute(cfg, [])
    assert not any(tmp_path.iterdir())
