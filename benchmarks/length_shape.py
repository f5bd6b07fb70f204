"""The shape of a workload's drawn response lengths, per iteration: median, 75th and 99th
percentiles, the longest as a multiple of the median, the share cut at the cap, and the median's
drift over iterations.

    python benchmarks/length_shape.py workload=long_reasoning algo=dapo [--iterations 0 100 1000]
"""
from __future__ import annotations

import argparse

import numpy as np

from harness.core.algorithm import sample_workload
from harness.core.workload import make_batch
from harness.testing import run_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides (as for python -m harness)")
    parser.add_argument("--iterations", type=int, nargs="+", default=[0, 100, 1000])
    args = parser.parse_args()
    run = run_config(["+system=verl", *args.overrides])
    workload = sample_workload(run.workload, run.algo)
    print(f"{'iteration':>9} {'samples':>8} {'median':>8} {'p75/med':>8} {'p99/med':>8} {'max/med':>8} {'at cap':>7}")
    for it in args.iterations:
        lens = make_batch(workload, run.seed, it, run.algo.group_size).output_lens
        med = float(np.median(lens))
        print(f"{it:>9} {len(lens):>8} {med:>8.0f} {np.percentile(lens, 75) / med:>8.2f} "
              f"{np.percentile(lens, 99) / med:>8.2f} {lens.max() / med:>8.1f} "
              f"{(lens == workload.max_gen_len).mean():>7.1%}")


if __name__ == "__main__":
    main()
