"""Planning CPU seconds of every system, and the estimated samples/s of the plan it returns.

    python benchmarks/planning_speed.py                               # 13b and 65b_33b, default cluster (256 GPUs)
    python benchmarks/planning_speed.py --baseline 7e29151            # the same, beside another commit's planners
    python benchmarks/planning_speed.py --models 13b --nodes 512 --batch 8192   # 4,096 GPUs, 8,192 samples
    python benchmarks/planning_speed.py --overrides algo=grpo         # a critic-free algorithm

Each system plans as ``python -m harness +system=<name> model=<pair>`` would, through the run
pipeline (:func:`harness.run.pipeline.plan`: its default budgets, which are in steps, so the plans
are deterministic; the garbage-collector policy while planning, :mod:`harness.planning.collector`;
the plan's checks), in a fresh Python process per (system, model), so no cache of one plan speeds
up the next. Timed by that process's CPU clock (``time.process_time``: the planner's own work and
the plan's checks, whatever else runs on the machine; a system that plans in worker processes
would need their CPU added, none does by default); the wall seconds are the planner's alone. The
plan's samples/s is the simulator's, one iteration of the workload's first batch.

``--baseline REV`` checks out commit ``REV`` (one that has the run pipeline,
``harness/run/pipeline.py``) into a temporary git worktree and times its planners the same way,
each right after this tree's, and prints both with the ratios: planning speed and plan quality of
two commits measured side by side in one run. Before timing, each tree's compiled
kernels (numba, cached on disk) are built by a small warm-up search, so the times are planning,
not a one-off compilation. ``--json OUT`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("deepspeed_chat", "realhf_heuristic", "realhf", "rlhfuse_base", "rlhfuse", "interleaved", "disaggregated",
           "colocated", "openrlhf", "verl", "nemo_rl")

# Run inside the tree being measured (its directory first on sys.path): plan once, print JSON.
CHILD = r"""
import json, sys, time
from harness.errors import PlanError
from harness.run import pipeline
system, model, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
overrides = [f"+system={system}", f"model={model}", "logger=none", *extra]
prepared = pipeline.prepare(pipeline.compose(overrides), overrides)
start_cpu = time.process_time()
try:
    planned = pipeline.plan(prepared)
    cpu_s = time.process_time() - start_cpu
    [(trace, _)] = pipeline.simulate(planned, num_iterations=1)
except PlanError as e:  # the system's defaults do not fit this setting: say so
    print(json.dumps({"refused": str(e)[:100]}))
    sys.exit(0)
print(json.dumps({"plan_cpu_s": cpu_s, "plan_wall_s": planned.plan_s,
                  "samples_per_s": prepared.ctx.workload.global_batch_size / trace.makespan_s}))
"""

WARM_UP = r"""
from systems.rlhfuse.intra import fused_costs, fused_pipes, search_fused_schedule
try:
    from systems.rlhfuse.intra import FusedSearchConfig
    options = {"config": FusedSearchConfig(max_steps=200)}
except ImportError:  # a tree from before the typed search config
    options = {"max_steps": 200}
pipes = fused_pipes(4, 2, 4, 4)
search_fused_schedule(pipes, fused_costs(pipes, 1.0, 0.5), **options)
"""


def _run(tree: Path, code: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"planning in {tree} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def plan_once(tree: Path, system: str, model: str, extra: list[str]) -> dict:
    return json.loads(_run(tree, CHILD, [system, model, *extra]).strip().splitlines()[-1])


def _fmt(r: dict) -> str:
    if "refused" in r:
        return f"  refused: {r['refused']}"
    return f"{r['plan_cpu_s']:>11.2f}{r['plan_wall_s']:>9.2f}{r['samples_per_s']:>11.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--models", nargs="+", default=["13b", "65b_33b"])
    parser.add_argument("--nodes", type=int, default=None, help="cluster.num_nodes (default: the cluster's)")
    parser.add_argument("--batch", type=int, default=None, help="workload.global_batch_size")
    parser.add_argument("--overrides", nargs="*", default=[], help="further overrides for every run (algo=grpo)")
    parser.add_argument("--baseline", metavar="REV", help="a git commit whose planners are timed beside this tree's")
    parser.add_argument("--json", metavar="OUT", help="write the numbers here")
    args = parser.parse_args()
    extra = ([f"cluster.num_nodes={args.nodes}"] if args.nodes else []) + \
        ([f"workload.global_batch_size={args.batch}"] if args.batch else []) + list(args.overrides)
    with tempfile.TemporaryDirectory(prefix="planning-baseline-") as tmp:
        base = None
        if args.baseline:
            base = Path(tmp) / "tree"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                           check=True, capture_output=True)
        try:
            rows = _measure(args, extra, base)
        finally:
            if base is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                               capture_output=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"overrides": extra, "baseline": args.baseline, **rows}, indent=1) + "\n")


def _measure(args, extra: list[str], base: Path | None) -> dict:
    for tree in (ROOT, base):
        if tree is not None:
            _run(tree, WARM_UP, [])
    head = f"{'system':<18}{'model':<10}{'plan CPU s':>11}{'wall s':>9}{'samples/s':>11}"
    if base is not None:
        head += f"{'base CPU s':>11}{'base s/s':>10}{'CPU x':>8}{'s/s x':>8}"
    print(head, flush=True)
    rows = {}
    for model in args.models:
        for system in args.systems:
            r = plan_once(ROOT, system, model, extra)
            line = f"{system:<18}{model:<10}{_fmt(r)}"
            if base is not None:
                b = plan_once(base, system, model, extra)
                r = {**r, "baseline": b}
                if "refused" not in r and "refused" not in b:
                    line += (f"{b['plan_cpu_s']:>11.2f}{b['samples_per_s']:>10.3f}"
                             f"{r['plan_cpu_s'] / b['plan_cpu_s']:>8.2f}{r['samples_per_s'] / b['samples_per_s']:>8.3f}")
                elif "refused" in b and "refused" not in r:
                    line += "  (baseline refused)"
            rows[f"{system}/{model}"] = r
            print(line, flush=True)
    return rows


if __name__ == "__main__":
    main()
