"""The smallest cluster on which each system plans and fits, for every paper model pair.

For each system and each of RLHFuse's model pairs (``conf/model/<actor>_<critic>.yaml``) on the
RLHFuse testbed (nodes of 8 x 80 GB H100-class GPUs, 72 GB usable each) and the default workload,
:data:`SMALLEST` is the smallest node count among 1, 2, 4, 8, 16, 32 on which the system plans and
the plan fits in device memory; half of it must be refused with an error that names the memory
needed. The table is what ``python benchmarks/feasibility_map.py`` measured (docs/FEASIBILITY.md,
which also checks that every larger cluster fits as well).

Where the floor is physics (Adam keeps 16 bytes per parameter: bf16 weights and gradients, fp32
master weights, momentum and variance): the 13B/33B pairs' training states are 16 x 45.3e9 B = 725 GB,
more than one node's 8 x 72 = 576 GB, so they need 2 nodes; the 65B/33B pairs' are 16 x 97.6e9 B =
1562 GB, more than two nodes' 1152 GB, so they need 4 (3 would do, but the sweep doubles). The
disaggregated training pool holds those states on all but the generation pool's nodes: 4 nodes
for every pair (its 13B/33B pool on 2 nodes would be 1 node). DeepSpeed-Chat's 65B pairs need 8
nodes: on 4, its ZeRO-3 actor training (with the hybrid engine's gathered generation copy) does
not fit beside the other models.

Search budgets are small (feasibility does not hinge on them), as in the benchmark.
"""
from __future__ import annotations

import pytest

from harness.errors import PlanError
from harness.planning.memory import check_plan_memory
from harness.testing import plan_for

PAIRS = ("13b_33b", "33b_13b", "33b_65b", "65b_33b")
SMALLEST = {  # system: smallest nodes per pair, in the order of PAIRS
    "deepspeed_chat": (2, 2, 8, 8),
    "rlhfuse_base": (2, 2, 4, 4),
    "rlhfuse": (2, 2, 4, 4),
    "realhf": (2, 2, 4, 4),
    "realhf_heuristic": (2, 2, 4, 4),
    "interleaved": (2, 2, 4, 4),
    "disaggregated": (4, 4, 4, 4),
    "colocated": (2, 2, 4, 4),
}
SMALL_BUDGETS = {"rlhfuse": ["system.fused_search.max_steps=100"], "realhf": ["system.max_steps=20"]}


def overrides(system: str, pair: str, nodes: int) -> list[str]:
    return [f"+system={system}", f"model={pair}", f"cluster.num_nodes={nodes}", *SMALL_BUDGETS.get(system, [])]


def plan_that_fits(overrides: list[str]):
    """Plan, then check memory as a run does before anything executes (some systems leave that to
    the check, others refuse while planning)."""
    plan, ctx, _ = plan_for(overrides)
    plan.validate(ctx.num_devices)
    report = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    assert max(report.peak_gb.values()) <= ctx.cost_model.hbm_capacity_gb
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("system", sorted(SMALLEST))
def test_smallest_cluster_that_fits(system, pair):
    nodes = SMALLEST[system][PAIRS.index(pair)]
    plan_that_fits(overrides(system, pair, nodes))
    if nodes > 1:
        with pytest.raises(PlanError, match=r"needs \d+\.\d GB"):
            plan_that_fits(overrides(system, pair, nodes // 2))
