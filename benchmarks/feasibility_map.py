"""Which systems plan and fit where: every system x paper model pair x cluster size.

    python benchmarks/feasibility_map.py                      # 1, 2, 4, 8, 16, 32 nodes of 8 H100-class GPUs
    python benchmarks/feasibility_map.py --nodes 1 2 --systems rlhfuse_base

For each cell the system plans (searches with small step budgets: feasibility does not hinge on
them), the plan is checked against device memory, and one iteration is simulated on the
representative batch; the cell shows samples/s, or why planning refused (the task or stage that
fits nowhere and its smallest requirement per GPU). A last table gives the smallest cluster on
which each system fits, and any larger one on which it does not. Markdown on stdout;
docs/FEASIBILITY.md holds a run.
"""
from __future__ import annotations

import argparse
import re
import sys
import time

from harness.errors import HarnessError
from harness.run import pipeline

SYSTEMS = ("deepspeed_chat", "rlhfuse_base", "rlhfuse", "realhf", "realhf_heuristic", "interleaved",
           "disaggregated", "colocated")
PAIRS = ("13b_33b", "33b_13b", "33b_65b", "65b_33b")
SMALL_BUDGETS = {"rlhfuse": ["system.fused_search.max_steps=500"], "realhf": ["system.max_steps=20"]}


def reason(message: str) -> str:
    """A few words on why a plan was refused, with the smallest requirement per GPU when named."""
    task = re.search(r"task (\S+)", message)
    if "does not fit in device memory" in message:
        need = re.search(r"needs (\d+\.\d) GB but only", message)
        return (f"memory: {task.group(1)}" if task else "memory") + (f", {need.group(1)} GB" if need else "")
    need = re.search(r"smallest requirement: .*? needs (\d+\.\d) GB per device", message)
    need = f" needs {need.group(1)} GB/GPU" if need else " fits nowhere"
    found = re.search(r"no feasible parallel strategy for (\S+)", message)
    if found:
        pool = re.search(r"(training|generation) pool", message)
        task = found.group(1).replace("update_actor+update_critic", "training")
        return f"{pool.group(0) + ': ' if pool else ''}{task}{need}"
    if "no shared inference layout" in message:
        return f"shared inference layout{need}"
    return " ".join(message.split()[:8])


def cell(system: str, pair: str, nodes: int) -> tuple[bool, str]:
    """(plans and fits, samples/s or why not); the time it took goes to stderr."""
    t0 = time.perf_counter()
    try:
        overrides = [f"+system={system}", f"model={pair}", f"cluster.num_nodes={nodes}",
                     *SMALL_BUDGETS.get(system, [])]
        planned = pipeline.plan(pipeline.prepare(pipeline.compose(overrides), overrides))  # checks memory
        [(trace, _)] = pipeline.simulate(planned, num_iterations=1)
        out = True, f"{planned.prepared.ctx.workload.global_batch_size / trace.makespan_s:.1f}"
    except HarnessError as e:
        out = False, f"no ({reason(str(e))})"
    print(f"{system} {pair} {nodes}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def smallest(fits: dict[int, bool]) -> str:
    """The smallest node count that fits, and any larger one that does not (a monotonicity gap)."""
    ok = sorted(n for n, f in fits.items() if f)
    if not ok:
        return "none"
    gaps = [n for n, f in fits.items() if not f and n > ok[0]]
    return str(ok[0]) + (f" (not {', '.join(map(str, gaps))})" if gaps else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--pairs", nargs="+", default=list(PAIRS))
    args = p.parse_args()
    t0 = time.perf_counter()
    fits: dict[tuple[str, str], dict[int, bool]] = {}
    for pair in args.pairs:
        print(f"\n### {pair} (actor_critic), samples/s on the simulated cluster\n")
        print("| system | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in args.nodes) + " |")
        print("|---|" + "---|" * len(args.nodes))
        for system in args.systems:
            cells = {n: cell(system, pair, n) for n in args.nodes}
            fits[system, pair] = {n: ok for n, (ok, _) in cells.items()}
            print(f"| {system} | " + " | ".join(text for _, text in cells.values()) + " |", flush=True)
    print("\n### Smallest cluster (nodes of 8 GPUs) on which each system plans and fits\n")
    print("| system | " + " | ".join(args.pairs) + " |")
    print("|---|" + "---|" * len(args.pairs))
    for system in args.systems:
        print(f"| {system} | " + " | ".join(smallest(fits[system, pair]) for pair in args.pairs) + " |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
