"""Our fused-schedule search against the paper authors' solver, side by side, on the authors' own
Table 3 instances (the bar: better or equal on all 16 rows, in the same wall time on the same cores).

    python benchmarks/flexfusion_compare.py --flexfusion-dir ~/FlexFusion       # every row
    python benchmarks/flexfusion_compare.py --flexfusion-dir ~/FlexFusion --pp 8/4 --microbatches 8

``--flexfusion-dir`` is a checkout of github.com/FlexFusion/FlexFusion (commit 212c257; nothing
is downloaded here). Its ``DualEgoSolver.h`` is compiled unchanged with its Makefile's flags
(``-Ofast -march=native``) into ``benchmarks/flexfusion/budget_driver.cc``, our driver that gives
it a wall-clock budget on a number of threads (its own MPI driver runs hundreds of annealing
configurations to completion, with no budget). Per row: our search first, with
``benchmarks/fuse_search.py``'s default budget and options (work units per seed, 2 seeds on 2
worker processes, the exact refinement on the 8-micro-batch rows); then FlexFusion with the wall
time ours took, on 2 threads, with the start and stop temperatures of its own configuration for
that instance (``parallel_driver.cc``; rows it has no configuration for take the nearest
micro-batch count's). Prints each side's makespan over our
lower bound and peak over the serial peak (actor 1F1B, barrier, critic 1F1B), and which is better:
the shorter makespan, then the lower peak. Not a test: numbers for docs/FUSED_SEARCH.md.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from fuse_search import (DEFAULT_ACTION_STEPS, DEFAULT_EXACT_EFFORT,  # the same options as that benchmark
                         DEFAULT_EXACT_MAX_MICROBATCHES, work_budget)
from systems.rlhfuse.experiments import FLEXFUSION_COSTS, flexfusion_layout_costs
from systems.rlhfuse.intra import FusedSearchConfig, search_fused_schedule

HERE = Path(__file__).resolve().parent
# (pp actor, pp critic, micro-batches) -> (makespan start, stop temperature, memory start, stop), from
# FlexFusion's parallel_driver.cc get_config_exp0..11 (0: its configuration runs no makespan annealing)
TEMPERATURES = {(8, 4, 32): (10, 1e-12, 20, 1e-20), (8, 4, 16): (10, 1e-14, 10, 1e-20), (8, 4, 8): (0, 0, 10, 1e-16),
                (8, 8, 32): (50, 1e-22, 20, 1e-26), (8, 8, 16): (10, 1e-22, 10, 1e-26), (8, 8, 8): (0, 0, 10, 1e-16),
                (16, 8, 64): (200, 1e-16, 200, 1e-20), (16, 8, 32): (50, 1e-16, 50, 1e-20),
                (16, 8, 16): (50, 1e-16, 50, 1e-20), (16, 16, 64): (40, 1e-22, 200, 1e-20),
                (16, 16, 32): (20, 1e-20, 20, 1e-20), (16, 16, 16): (10, 1e-14, 10, 1e-16)}


def temperatures(pp_a: int, pp_c: int, m: int) -> tuple:
    known = [k for k in TEMPERATURES if k[:2] == (pp_a, pp_c)]
    return TEMPERATURES[min(known, key=lambda k: (abs(k[2] - m), k[2]))]


def build(flexfusion_dir: Path, out: Path) -> Path:
    header = flexfusion_dir / "DualEgoSolver.h"
    if not header.is_file():
        raise SystemExit(f"error: {header} not found: --flexfusion-dir must be a checkout of "
                         "github.com/FlexFusion/FlexFusion")
    binary = out / "budget_driver"
    subprocess.run(["g++", "-std=c++17", "-Ofast", "-march=native", "-w", f"-I{flexfusion_dir}",
                    str(HERE / "flexfusion" / "budget_driver.cc"), "-o", str(binary), "-lpthread"], check=True)
    return binary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flexfusion-dir", type=Path, required=True, help="a checkout of FlexFusion (commit 212c257)")
    p.add_argument("--pp", nargs="*", default=None, help="shapes, e.g. 8/4 16/16 (default: all four)")
    p.add_argument("--microbatches", type=int, nargs="*", default=[8, 16, 32, 64])
    p.add_argument("--action-steps", type=float, default=DEFAULT_ACTION_STEPS, help="our budget per seed")
    p.add_argument("--workers", type=int, default=2, help="our worker processes and FlexFusion's threads")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(args.flexfusion_dir.expanduser(), Path(tmp))
        print(f"# ours: {args.action_steps:g} work units per seed, {args.workers} seeds on {args.workers} workers, "
              f"exact refinement effort {DEFAULT_EXACT_EFFORT:g} up to {DEFAULT_EXACT_MAX_MICROBATCHES} micro-batches; "
              f"FlexFusion: the same wall time on {args.workers} threads")
        print(f"{'pp':<6}{'M':>4}{'ours T/LB':>11}{'peak':>8}{'FlexFusion T/LB':>17}{'peak':>8}{'wall s':>8}"
              f"{'its steps (T, memory)':>24}  better")
        for pp_a, pp_c in FLEXFUSION_COSTS:
            if args.pp and f"{pp_a}/{pp_c}" not in args.pp:
                continue
            for m in args.microbatches:
                pipes, costs, m_c = flexfusion_layout_costs(pp_a, pp_c, m)
                t0 = time.perf_counter()
                ours = search_fused_schedule(pipes, costs, None, FusedSearchConfig(
                    max_steps=work_budget(pipes, args.action_steps)[1], num_workers=args.workers,
                    exact_effort=DEFAULT_EXACT_EFFORT, exact_max_microbatches=DEFAULT_EXACT_MAX_MICROBATCHES))
                wall = time.perf_counter() - t0
                fwd_a, fwd_c, act_a, act_c = FLEXFUSION_COSTS[(pp_a, pp_c)]
                out = subprocess.run([str(binary), *map(str, (pp_a, pp_c, m, m_c, fwd_a, fwd_c, act_a, act_c,
                                                               *temperatures(pp_a, pp_c, m), wall, args.workers))],
                                     check=True, capture_output=True, text=True).stdout.split()
                their_t, their_peak = float(out[7]), float(out[8])
                mine = (round(ours.makespan, 6), round(ours.peak_memory, 4))  # it prints 4 decimals
                theirs = (round(their_t, 6), round(their_peak, 4))
                better = "tie" if mine == theirs else "ours" if mine < theirs else "FlexFusion"
                lb, serial = ours.lower_bound, ours.serial_peak_memory
                print(f"{pp_a}/{pp_c:<4}{m:>4}{ours.makespan / lb:>11.4f}{ours.peak_memory / serial:>8.3f}"
                      f"{their_t / lb:>17.4f}{their_peak / serial:>8.3f}{wall:>8.1f}"
                      f"{out[10] + ', ' + out[11]:>24}  {better}", flush=True)


if __name__ == "__main__":
    main()
