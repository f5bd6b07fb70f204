"""Planning CPU seconds of every system, and the estimated samples/s of the plan it returns (issue 28).

    python benchmarks/planning_speed.py                               # 13b and 65b_33b, default cluster (256 GPUs)
    python benchmarks/planning_speed.py --models 13b --nodes 512 --batch 8192   # 4,096 GPUs, 8,192 samples

Each system plans as ``python -m harness +system=<name> model=<pair>`` would (its default budgets,
which are in steps: the plans are deterministic), timed by the process's CPU clock
(``time.process_time``: the planner's own work, whatever else runs on the machine; a system that
plans in worker processes would need their CPU added, none does by default). The plan's samples/s is
the simulator's, one iteration of the workload's first batch. ``--compare REF.json`` prints a
previous run's numbers (written with ``--json``) beside this one's, with the ratios: how planning
speed and plan quality moved between two commits, measured side by side.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hydra.utils import get_class

from harness.errors import PlanError
from harness.planning.estimate import simulate_plan
from harness.testing import run_config
from harness.runner import build_context

SYSTEMS = ("deepspeed_chat", "realhf_heuristic", "realhf", "rlhfuse_base", "rlhfuse", "interleaved", "disaggregated",
           "colocated", "openrlhf")


def plan_once(system: str, model: str, extra: list[str]) -> dict[str, float]:
    run = run_config([f"+system={system}", f"model={model}", "logger=none", *extra])
    ctx = build_context(run)
    planner = get_class(run.system.impl)(run.system)
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    plan = planner.plan(ctx)
    cpu_s, wall_s = time.process_time() - start_cpu, time.perf_counter() - start_wall
    trace = simulate_plan(ctx, plan)
    return {"plan_cpu_s": cpu_s, "plan_wall_s": wall_s,
            "samples_per_s": ctx.workload.global_batch_size / trace.makespan_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--models", nargs="+", default=["13b", "65b_33b"])
    parser.add_argument("--nodes", type=int, default=None, help="cluster.num_nodes (default: the cluster's)")
    parser.add_argument("--batch", type=int, default=None, help="workload.global_batch_size")
    parser.add_argument("--json", metavar="OUT", help="write the numbers here")
    parser.add_argument("--compare", metavar="REF", help="a --json file of another run, printed beside this one")
    args = parser.parse_args()
    extra = ([f"cluster.num_nodes={args.nodes}"] if args.nodes else []) + \
        ([f"workload.global_batch_size={args.batch}"] if args.batch else [])
    ref = json.loads(Path(args.compare).read_text()) if args.compare else {}
    rows = {}
    head = f"{'system':<18}{'model':<10}{'plan CPU s':>11}{'wall s':>9}{'samples/s':>11}"
    if ref:
        head += f"{'ref CPU s':>11}{'ref s/s':>10}{'CPU x':>8}{'s/s x':>8}"
    print(head, flush=True)
    for model in args.models:
        for system in args.systems:
            key = f"{system}/{model}"
            try:
                r = rows[key] = plan_once(system, model, extra)
            except PlanError as e:  # the system's defaults do not fit this setting: say so, go on
                print(f"{system:<18}{model:<10}  refused: {str(e)[:100]}", flush=True)
                continue
            line = f"{system:<18}{model:<10}{r['plan_cpu_s']:>11.2f}{r['plan_wall_s']:>9.2f}{r['samples_per_s']:>11.3f}"
            if key in ref:
                o = ref[key]
                line += (f"{o['plan_cpu_s']:>11.2f}{o['samples_per_s']:>10.3f}"
                         f"{r['plan_cpu_s'] / o['plan_cpu_s']:>8.2f}{r['samples_per_s'] / o['samples_per_s']:>8.3f}")
            print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"overrides": extra, **rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
