"""Fused-schedule search quality and cost on the paper's Table 3 shapes (issue 13, item 5).

    python benchmarks/fuse_search.py                        # deterministic: 20000 annealing steps each
    python benchmarks/fuse_search.py --time-limit 60        # the issue's budget: 60 s per configuration
    python benchmarks/fuse_search.py --workers 2 --seeds 2  # independent restarts on 2 cores

For every actor/critic pair and pipeline shape of Table 3 (33B/13B at pp 8/4 and 8/8, 65B/33B at
pp 16/8 and 16/16; tp 8; per-stage costs from the H100-class cost model at the workload's median
sequence length) and 8 to 64 micro-batches per actor pipeline, prints the fused schedule's
makespan over the lower bound, its peak activation memory over the paper's serial baseline's
(actor 1F1B, barrier, critic 1F1B), its speedup over that baseline, and the search's wall time,
with no memory cap. Not a test: numbers for docs, measured side by side in one run.
"""
from __future__ import annotations

import argparse
import time

from omegaconf import OmegaConf

from harness.app import compose
from harness.runner import build_context
from systems.rlhfuse.experiments import fused_layout_costs
from systems.rlhfuse.intra import search_fused_schedule

CASES = (("33b", "13b", 8, 4), ("33b", "13b", 8, 8), ("65b", "33b", 16, 8), ("65b", "33b", 16, 16))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--max-steps", type=int, default=20000, help="annealing steps per seed (deterministic)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per configuration instead of steps")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--tp", type=int, default=8)
    args = p.parse_args()
    print(f"{'pair':<9}{'pp':>7}{'M':>4}{'makespan/LB':>13}{'peak/serial':>13}{'vs serial':>11}"
          f"{'no-barrier peak':>17}{'search s':>10}{'steps':>8}")
    for actor, critic, pp_a, pp_c in CASES:
        run = OmegaConf.to_object(compose(["+system=rlhfuse", f"llama@model.actor={actor}",
                                           f"llama@model.ref={actor}", f"llama@model.critic={critic}",
                                           f"llama@model.reward={critic}"]))
        ctx = build_context(run)
        for m in args.microbatches:
            pipes, costs, _ = fused_layout_costs(ctx, actor, critic, pp_a, pp_c, m, args.tp)
            t0 = time.perf_counter()
            res = search_fused_schedule(pipes, costs, seed=0, time_limit_s=args.time_limit,
                                        max_steps=None if args.time_limit else args.max_steps,
                                        num_workers=args.workers, num_seeds=args.seeds)
            wall = time.perf_counter() - t0
            print(f"{actor}/{critic:<5}{pp_a:>4}/{pp_c:<2}{m:>4}{res.makespan / res.lower_bound:>13.3f}"
                  f"{res.peak_memory / res.serial_peak_memory:>13.2f}{res.serial_makespan / res.makespan:>10.3f}x"
                  f"{res.peak_memory / res.serial_no_barrier_peak_memory:>17.2f}{wall:>10.1f}{res.steps:>8}",
                  flush=True)


if __name__ == "__main__":
    main()
