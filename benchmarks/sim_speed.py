"""Simulator speed: simulated PPO iterations per second (docs/DESIGN.md section 4).

Plans each system once for a 65B actor / 33B critic pair on the RLHFuse testbed (256 GPUs), through
the run pipeline (:mod:`harness.run.pipeline`), then times its iterations on the simulator (the
batch, ``SimBackend.run_iteration`` and metric extraction) over several iterations, side by side in
one process. Prints one line per system and the planning time. Not a test: numbers depend on the
machine.

    python benchmarks/sim_speed.py [--model 65b_33b] [--iterations 5] [--systems deepspeed_chat rlhfuse_base]
"""
from __future__ import annotations

import argparse
import time

from harness.run import pipeline


def bench(system: str, model: str, iterations: int) -> None:
    overrides = [f"+system={system}", f"model={model}", "logger=none"]
    planned = pipeline.plan(pipeline.prepare(pipeline.compose(overrides), overrides))
    ctx = planned.prepared.ctx
    backend = pipeline.simulator(ctx)
    backend.setup(planned.plan)
    t0 = time.perf_counter()
    num_spans = sum(len(trace.spans) for trace, _ in pipeline.iterations(planned, backend, range(iterations)))
    wall = time.perf_counter() - t0
    print(f"{system:>16} {model:>8} on {ctx.num_devices} GPUs: {iterations / wall:6.2f} simulated iterations/s "
          f"({wall / iterations * 1e3:7.1f} ms each, {num_spans // iterations} spans/iteration; "
          f"plan {planned.plan_s:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="65b_33b")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--systems", nargs="+", default=["deepspeed_chat", "rlhfuse_base"])
    args = parser.parse_args()
    for system in args.systems:
        bench(system, args.model, args.iterations)


if __name__ == "__main__":
    main()
