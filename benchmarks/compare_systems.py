"""Side-by-side stage breakdown of systems on one model and cluster (simulated), with ratios.

    python benchmarks/compare_systems.py [--model 13b] [--systems deepspeed_chat rlhfuse_base] [--iterations 5]
    python benchmarks/compare_systems.py --systems rlhfuse_base rlhfuse:system.intra_stage=false rlhfuse
    python benchmarks/compare_systems.py --systems rlhfuse_base rlhfuse --overrides algo=grpo

A system entry may carry its own overrides after a colon, comma-separated (for ablations); the
positional overrides apply to every entry.

Prints, per metric, each system's value (mean over iterations after one warm-up) and the ratio of
the first system to the last, so "system B is X times faster, because stage S takes Y s less"
can be read off one run. Not a test: a benchmark of the simulated systems.
"""
from __future__ import annotations

import argparse

from harness.core import metrics as mk
from harness.run import pipeline

ROWS = [mk.SAMPLES_PER_S, mk.STEP_TIME, mk.GEN_INFERENCE_TIME] + [mk.timing_key(t) for t in mk.TIMED_TASKS] + \
       [mk.REALLOC_TIME, mk.TRAIN_TIME, mk.GEN_TAIL_S, mk.VERIFY_TAIL, mk.BUSY_MEAN, mk.MAX_MEMORY_GB]


def simulate(entry: str, model: str, iterations: int, extra: list[str]) -> dict[str, float]:
    system, _, own = entry.partition(":")
    overrides = [f"+system={system}", f"model={model}", "logger=none", *extra, *(o for o in own.split(",") if o)]
    planned = pipeline.plan(pipeline.prepare(pipeline.compose(overrides), overrides))
    rows = [metrics for _, metrics in pipeline.simulate(planned, iterations)]
    summary = mk.summarize(rows, num_warmup=1)
    summary.update({f"strategy/{t.name}": str(t.allocation.strategy) for t in planned.plan.tasks})
    for stage in planned.plan.training:  # bubble fraction per training stage (fused or per task)
        key = mk.bubble_key("+".join(stage.tasks) if len(stage.tasks) > 1 else stage.tasks[0])
        summary[f"bubble/{'+'.join(stage.tasks)}"] = summary.get(key, float("nan"))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="13b")
    parser.add_argument("--systems", nargs="+", default=["deepspeed_chat", "rlhfuse_base"])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--overrides", nargs="*", default=[],
                        help="Hydra overrides for every entry, e.g. workload.max_gen_len=2048")
    args = parser.parse_args()
    results = {s: simulate(s, args.model, args.iterations, args.overrides) for s in args.systems}
    print(f"model={args.model} {' '.join(args.overrides)}")
    width = max(18, *(len(s) + 2 for s in args.systems))
    print(f"{'metric':<26}" + "".join(f"{s:>{width}}" for s in args.systems) + f"  {'first/last':>12}")
    for key in ROWS:
        if not any(key in r for r in results.values()):
            continue
        values = [results[s].get(key, float("nan")) for s in args.systems]
        ratio = values[0] / values[-1] if values[-1] else float("nan")
        print(f"{key:<26}" + "".join(f"{v:>{width}.3f}" for v in values) + f"  {ratio:>12.2f}")
    for key in sorted({k for r in results.values() for k in r if k.startswith("bubble/")}):
        print(f"{key:<26}" + "".join(f"{results[s].get(key, float('nan')):>{width}.3f}" for s in args.systems))
    for task in ("gen", "ref", "values", "update_actor", "update_critic"):
        print(f"{'strategy/' + task:<26}" + "".join(f"{results[s].get('strategy/' + task, '-'):>{width}}"
                                                  for s in args.systems))


if __name__ == "__main__":
    main()
