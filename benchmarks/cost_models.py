"""Simulated stage times of every system under both cost models, on the Figure 7 setups.

    python benchmarks/cost_models.py                        # 4 paper pairs x 7 systems, max_gen_len 1024
    python benchmarks/cost_models.py --pairs 13b_33b --max-gen-len 512 2048

Each system plans and is simulated twice on the RLHFuse testbed model (32 x 8 H100-class GPUs,
default workload): with ``cluster.cost_model=roofline`` (datasheet rooflines) and with the
calibrated default (``harness/costmodel/calibrated.py``). Each plans under its own cost model, so
a layout may differ between the two. Printed per run: generation, generation+inference, training
and step seconds, samples/s, and the calibrated / roofline ratio of each, side by side. Searches
use step budgets (deterministic): ReaLHF 50 annealing steps, RLHFuse 2000 fused-schedule steps.
"""
from __future__ import annotations

import argparse
import time

from harness.core import metrics as mk
from harness.errors import HarnessError
from harness.run import pipeline

SYSTEMS = ("deepspeed_chat", "realhf_heuristic", "realhf", "rlhfuse_base", "rlhfuse", "interleaved",
           "disaggregated")
PAIRS = ("13b_33b", "33b_13b", "33b_65b", "65b_33b")
BUDGETS = {"rlhfuse": ["system.fused_search.max_steps=2000"], "realhf": ["system.max_steps=50"]}
STAGES = (("gen", "timing_s/gen"), ("gen+inf", mk.GEN_INFERENCE_TIME), ("train", mk.TRAIN_TIME),
          ("step", mk.STEP_TIME))


def run(system: str, pair: str, max_gen_len: int, cost_model: str) -> dict[str, float]:
    return stage_times([f"+system={system}", f"model={pair}", f"workload.max_gen_len={max_gen_len}",
                        f"cluster.cost_model={cost_model}", *BUDGETS.get(system, [])])


def stage_times(overrides: list[str]) -> dict[str, float]:
    """One simulated iteration (the workload's first batch) of the run ``overrides`` describe: each
    of :data:`STAGES` in seconds, and samples/s; shared with ``fig7_engines.py``."""
    planned = pipeline.plan(pipeline.prepare(pipeline.compose(overrides), overrides))
    [(trace, m)] = pipeline.simulate(planned, num_iterations=1)
    out = {name: m.get(key, float("nan")) for name, key in STAGES}
    out["samples/s"] = planned.prepared.ctx.workload.global_batch_size / trace.makespan_s
    return out


def side_by_side(args: argparse.Namespace, labels: tuple[str, str], run_variant) -> None:
    """Print ``run_variant(system, pair, length, first)`` for ``first`` True and False side by side, per
    stage, with their ratio (second / first); shared with ``fig7_engines.py``."""
    cols = [name for name, _ in STAGES] + ["samples/s"]
    a, b = labels
    print(f"{'pair':<8} {'len':>5} {'system':<17} " + " ".join(f"{c + ' ' + a:>14} {c + ' ' + b:>11} {'x':>5}"
                                                           for c in cols))
    t0 = time.perf_counter()
    for pair in args.pairs:
        for length in args.max_gen_len:
            for system in args.systems:
                try:
                    first, second = (run_variant(system, pair, length, v) for v in (True, False))
                except HarnessError as e:
                    print(f"{pair:<8} {length:>5} {system:<17} refused: {' '.join(str(e).split()[:12])}")
                    continue
                cells = " ".join(f"{first[c]:>14.3f} {second[c]:>11.3f} {second[c] / first[c]:>5.2f}" for c in cols)
                print(f"{pair:<8} {length:>5} {system:<17} {cells}", flush=True)
    print(f"# {time.perf_counter() - t0:.0f} s; x = {b} / {a}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", nargs="+", default=list(PAIRS))
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--max-gen-len", type=int, nargs="+", default=[1024])
    side_by_side(p.parse_args(), ("roof", "cal"),
                 lambda system, pair, length, first: run(system, pair, length, "roofline" if first else "calibrated"))


if __name__ == "__main__":
    main()
