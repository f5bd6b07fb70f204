"""The simulator across iterations (harness/planning/iterations.py): off-policy plans on one timeline.

Oracles: with a staleness bound of 0 every steady-state window equals the synchronous iteration of
the same plan, metric for metric; the bound holds for every trained sample and one-step-off
trains every batch after the pipeline's fill exactly one version stale; with the same batch every
iteration the steady step is the closed form F + max(G, L + T) of the pipeline (weight broadcast F,
generation G, log-probs L and training T, read from the synchronous iteration's timeline); windows
do not depend on how far ahead the timeline was simulated."""
import dataclasses

import pytest

from harness.core import metrics as mk
from harness.core.plan import OffPolicyPolicy
from harness.errors import PlanError
from harness.planning.estimate import representative_batch
from harness.planning.iterations import run_off_policy
from harness.planning.offpolicy import OffPolicyTimeline, simulated_steady_step_s, steady_step_s
from harness.planning.memory import check_plan_memory
from harness.planning.simulate import PlanSimulator
from harness.testing import plan_for, simulate_plan_metrics
from harness.core.workload import draw_batch
from helpers import window_metrics

SMALL = ["model=7b", "cluster.num_nodes=2", "algo=grpo", "workload.global_batch_size=16",
         "workload.mini_batch_size=8", "+system=one_step_off", "system.rollout_gpus=8"]


def plan_and_memory(extra=()):
    plan, ctx, run = plan_for([*SMALL, *extra])
    return plan, ctx, check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)


def batches(ctx):
    return lambda k: draw_batch(ctx.workload, ctx.seed, k, ctx.algorithm)


def test_bound_zero_equals_the_synchronous_iterations():
    plan, ctx, memory = plan_and_memory(["system.max_staleness=0"])
    assert plan.off_policy == OffPolicyPolicy(0)
    sync = dataclasses.replace(plan, off_policy=None)
    windows = OffPolicyTimeline(ctx, plan, memory, batches(ctx), 4)
    for k in range(1, 4):  # window 0 has no weight broadcast before its generation: the warm-up
        off = window_metrics(plan, ctx, windows.window(k))
        _, on = simulate_plan_metrics(sync, ctx, iteration=k)
        assert off.keys() == on.keys()
        for key in on:
            assert off[key] == pytest.approx(on[key], rel=1e-9, abs=1e-9), key
        assert off[mk.STALENESS_MAX] == 0 and off[mk.staleness_frac_key(0)] == 1


@pytest.mark.parametrize("bound", [1, 2])
def test_the_bound_holds_and_is_reached_after_the_fill(bound):
    plan, ctx, memory = plan_and_memory([f"system.max_staleness={bound}"])
    windows = OffPolicyTimeline(ctx, plan, memory, batches(ctx), 6)
    for k in range(6):
        trace = windows.window(k)
        m = window_metrics(plan, ctx, trace)
        assert 0 <= m[mk.STALENESS_MAX] <= bound
        assert {r.first_version for r in trace.samples} == {max(0, k - bound)}
        assert m[mk.STALENESS_MEAN] == min(k, bound)
        assert m[mk.OFF_POLICY_TOKEN_FRAC] == (1.0 if k else 0.0)


def test_steady_step_is_the_pipeline_closed_form():
    """Without the verifier's tail (which overlaps the broadcast: the engines are free before the
    last response is scored), one period is the broadcast, then generation beside log-probs and
    training."""
    plan, ctx, memory = plan_and_memory(["algo.rule_reward_s_per_sample=0"])
    batch = representative_batch(ctx)
    sync = dataclasses.replace(plan, off_policy=None)
    simulator = PlanSimulator(ctx, sync, memory, 0, batch)
    simulator.run()
    end = simulator.timeline.end_s
    broadcast, generation = end["param_sync"], end["gen"] - end["param_sync"]
    rest = end["update_actor"] - end["gen"]  # log-probs and training
    simulated = simulated_steady_step_s(ctx, plan, memory, batch)
    assert simulated == pytest.approx(broadcast + max(generation, rest), rel=1e-9)
    assert simulated < simulator.timeline.makespan_s
    assert steady_step_s(ctx, plan, memory, batch) == pytest.approx(simulated, rel=1e-9)  # what planners score


def test_windows_do_not_depend_on_the_horizon():
    plan, ctx, memory = plan_and_memory()
    short = OffPolicyTimeline(ctx, plan, memory, batches(ctx), 2)
    first = [short.window(k) for k in range(2)]
    long = OffPolicyTimeline(ctx, plan, memory, batches(ctx), 7)
    for k in range(2):
        assert window_metrics(plan, ctx, first[k]) == window_metrics(plan, ctx, long.window(k))
    later = short.window(5)  # extends the horizon
    assert window_metrics(plan, ctx, later) == window_metrics(plan, ctx, long.window(5))


def test_running_ahead_on_shared_devices_is_refused():
    plan, ctx, memory = plan_and_memory()
    gen = plan.task("gen")
    shared = dataclasses.replace(gen, allocation=plan.task("update_actor").allocation)
    plan = dataclasses.replace(plan, tasks=[shared if t.name == "gen" else t for t in plan.tasks])
    with pytest.raises(PlanError, match="shares devices"):
        run_off_policy(ctx, plan, memory, batches(ctx), 3)
