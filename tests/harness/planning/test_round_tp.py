"""Per-round tensor parallelism under tail batching (RollPacker's parallelism planner,
harness/planning/partial.py): the planner's rule by hand, the layouts a round may take, and the
simulated rounds following the rule from the preemptions they record.

Oracles: the paper's heuristic worked by hand (double after a rise of more than 5%, halve after four
rounds without preemptions, short and long rounds apart); the planner replayed over the simulated
rounds' own preemption counters gives the tensor parallelism each round ran with; a larger tp frees
weight memory for KV cache, so the short rounds that preempted at tp 1 (and do in the fixed run's
same iterations) stop preempting at tp 2; and until the planner first changes a layout, the adaptive
run is the fixed one, number for number. (Whether the rounds then run faster is a benchmark's
question: tp 2 also pays its all-reduces.)"""
from __future__ import annotations

import json

import pytest

from harness.core import metrics as mk
from harness.core.plan import OffPolicyPolicy, Plan
from harness.errors import PlanError
from harness.planning.partial import RoundTpPlanner, round_plan, round_tp_choices
from harness.testing import plan_for, simulate_iterations

# 8 engines of tp 1 on one node, vLLM at a quarter of each GPU: short rounds (1.5x the prompts in
# flight) preempt, long rounds barely
PRESSED = ["+system=rollpacker", "model=7b", "cluster.num_nodes=1", "algo=grpo", "workload.global_batch_size=64",
           "workload.mini_batch_size=64", "system.rollout_tp=1", "system.gpu_memory_utilization=0.25",
           "system.speculation=1.5"]
ITERATIONS = 12


def test_the_planner_rule_by_hand():
    planner = RoundTpPlanner(2, (1, 2, 4, 8), lambda tp: True)
    planner.after(False, 100)  # a first short round sets the reference
    assert planner.tp == {False: 2, True: 2}
    planner.after(False, 105)  # +5%: not a rise
    assert planner.tp[False] == 2
    planner.after(False, 111)  # more than 5% over the last: double
    assert planner.tp[False] == 4 and planner.tp[True] == 2
    for _ in range(3):
        planner.after(False, 0)
    assert planner.tp[False] == 4  # three calm rounds are not four (the count restarted at the change)
    planner.after(False, 0)
    assert planner.tp[False] == 2
    planner.after(True, 0)
    planner.after(True, 3)  # from none, any preemption is a rise
    assert planner.tp[True] == 4


def test_the_planner_stays_within_its_choices_and_memory():
    top = RoundTpPlanner(8, (1, 2, 4, 8), lambda tp: True)
    top.after(False, 1)
    top.after(False, 50)
    assert top.tp[False] == 8  # no tp 16 within the node
    tight = RoundTpPlanner(2, (1, 2, 4), lambda tp: tp >= 2)  # tp 1 does not fit
    for _ in range(8):
        tight.after(True, 0)
    assert tight.tp[True] == 2


def test_a_round_keeps_its_devices_at_another_tp():
    plan, ctx, _ = plan_for(PRESSED)
    gen = plan.task("gen").allocation
    assert gen.strategy.tp == 1 and round_tp_choices(plan, ctx) == (1, 2, 4, 8)
    assert round_plan(plan, 1) is plan
    wide = round_plan(plan, 4)
    moved = wide.task("gen").allocation
    assert moved.mesh == gen.mesh and (moved.strategy.dp, moved.strategy.tp) == (2, 4)
    targets = [m.target for m in wide.weight_movements if m.task.endswith("_gen")]
    assert targets and all(t == moved for t in targets)
    assert all(wide.task(t.name) == t for t in plan.tasks if t.name != "gen")


def test_round_tp_in_plan_json_only_when_adaptive():
    plan, _, _ = plan_for(PRESSED)
    assert plan.off_policy.round_tp == "adaptive"
    assert Plan.from_json(plan.to_json()).off_policy == plan.off_policy
    fixed, _, _ = plan_for([*PRESSED, "system.parallelism_planner=false"])
    assert fixed.off_policy.round_tp == "fixed" and "round_tp" not in json.loads(fixed.to_json())["off_policy"]
    with pytest.raises(PlanError, match="round_tp='adaptive' applies to tail batching"):
        OffPolicyPolicy(1, rollout="partial", oversample_factor=1.5, round_tp="adaptive")
    with pytest.raises(PlanError, match="round_tp='wide'"):
        OffPolicyPolicy(0, rollout="tail_batching", round_tp="wide")


@pytest.fixture(scope="module")
def pressed_runs():
    adaptive = [m for _, m in simulate_iterations(PRESSED, ITERATIONS)[1]]
    fixed = [m for _, m in simulate_iterations([*PRESSED, "system.parallelism_planner=false"], ITERATIONS)[1]]
    return adaptive, fixed


def test_each_round_runs_the_tp_the_rule_gives_from_its_preemptions(pressed_runs):
    adaptive, _ = pressed_runs
    plan, ctx, _ = plan_for(PRESSED)
    replay = RoundTpPlanner(1, round_tp_choices(plan, ctx), lambda tp: True)
    for m in adaptive:
        long_round = bool(m[mk.LONG_ROUND])
        assert m[mk.ROUND_TP] == replay.tp[long_round]
        replay.after(long_round, int(m[mk.PREEMPTIONS]))
    assert {m[mk.ROUND_TP] for m in adaptive} == {1, 2}  # the planner did change layouts


def test_a_larger_tp_relieves_the_short_rounds(pressed_runs):
    adaptive, fixed = pressed_runs
    short = [m for m in adaptive if not m[mk.LONG_ROUND]]
    assert all(m[mk.PREEMPTIONS] > 0 for m in short if m[mk.ROUND_TP] == 1)
    assert all(m[mk.PREEMPTIONS] == 0 for m in short if m[mk.ROUND_TP] == 2)
    assert all(m[mk.ROUND_TP] == 1 for m in fixed)
    # the same rounds until the planner first changed a layout
    first_change = next(i for i, m in enumerate(adaptive) if m[mk.ROUND_TP] != 1)
    assert first_change > 0
    for a, f in zip(adaptive[:first_change], fixed[:first_change]):
        assert a[mk.STEP_TIME] == f[mk.STEP_TIME] and a[mk.PREEMPTIONS] == f[mk.PREEMPTIONS]
    # where the fixed run's same iterations preempted
    relieved = [i for i, m in enumerate(adaptive) if not m[mk.LONG_ROUND] and m[mk.ROUND_TP] == 2]
    assert relieved and all(fixed[i][mk.PREEMPTIONS] > 0 for i in relieved)
