"""Which systems plan and fit where: every system x paper model pair x cluster size (issue 13, item 6).

    python benchmarks/feasibility_map.py                      # 1, 2, 4, 8, 16, 32 nodes of 8 H100-class GPUs
    python benchmarks/feasibility_map.py --nodes 1 2 --systems rlhfuse_base

For each cell the system plans (searches with small step budgets: feasibility does not hinge on
them), the plan is checked against device memory, and one iteration is simulated on the
representative batch; the cell shows samples/s, or why planning refused (first words of the
error). Markdown on stdout; docs/FEASIBILITY.md holds a run.
"""
from __future__ import annotations

import argparse
import re
import time

from harness.errors import HarnessError
from harness.planning.estimate import simulate_plan
from harness.testing import plan_for

SYSTEMS = ("deepspeed_chat", "rlhfuse_base", "rlhfuse", "realhf", "realhf_heuristic", "interleaved",
           "disaggregated", "colocated")
PAIRS = ("13b_33b", "33b_13b", "33b_65b", "65b_33b")
SMALL_BUDGETS = {"rlhfuse": ["system.fuse_max_steps=500"], "realhf": ["system.max_steps=20"]}


def reason(message: str) -> str:
    """A few words on why a plan was refused."""
    task = re.search(r"task (\S+)", message)
    if "does not fit in device memory" in message:
        return f"memory: {task.group(1)}" if task else "memory"
    found = re.search(r"no feasible parallel strategy for (\S+)", message)
    if found:
        pool = " in the training pool" if "training pool" in message else ""
        return f"no layout of {found.group(1)} fits{pool}"
    if "no shared inference layout" in message:
        return "no shared inference layout fits"
    if "no fused actor+critic layout" in message:
        return "no fused layout fits"
    return " ".join(message.split()[:8])


def cell(system: str, pair: str, nodes: int) -> str:
    try:
        plan, ctx, _ = plan_for([f"+system={system}", f"model={pair}", f"cluster.num_nodes={nodes}",
                                 *SMALL_BUDGETS.get(system, [])])
        trace = simulate_plan(ctx, plan)  # checks memory first
    except HarnessError as e:
        return f"no ({reason(str(e))})"
    return f"{ctx.workload.global_batch_size / trace.makespan_s:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--pairs", nargs="+", default=list(PAIRS))
    args = p.parse_args()
    t0 = time.perf_counter()
    for pair in args.pairs:
        print(f"\n### {pair} (actor_critic), samples/s on the simulated cluster\n")
        print("| system | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in args.nodes) + " |")
        print("|---|" + "---|" * len(args.nodes))
        for system in args.systems:
            print(f"| {system} | " + " | ".join(cell(system, pair, n) for n in args.nodes) + " |", flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
