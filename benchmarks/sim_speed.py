"""Simulator speed: simulated PPO iterations per second (docs/DESIGN.md section 4).

Plans each system once for a 65B actor / 33B critic pair on the RLHFuse testbed (256 GPUs), then
times ``SimBackend.run_iteration`` plus metric extraction over several iterations, side by side in
one process. Prints one line per system and the planning time. Not a test: numbers depend on the
machine.

    python benchmarks/sim_speed.py [--model 65b_33b] [--iterations 5] [--systems deepspeed_chat rlhfuse_base]
"""
from __future__ import annotations

import argparse
import time

from omegaconf import OmegaConf

from harness.core import metrics as mk
from harness.cli.app import compose
from harness.run.runner import build_context
from harness.backends.sim import SimBackend
from harness.planning.collector import full_collections_deferred
from harness.core.workload import make_batch
from hydra.utils import get_class


def bench(system: str, model: str, iterations: int) -> None:
    cfg = compose([f"+system={system}", f"model={model}", "logger=none"])
    run = OmegaConf.to_object(cfg)
    ctx = build_context(run)
    t0 = time.perf_counter()
    with full_collections_deferred():  # as the runner plans
        plan = get_class(run.system.impl)(run.system).plan(ctx)
    plan_s = time.perf_counter() - t0
    backend = SimBackend(run.backend, ctx)
    backend.setup(plan)
    task_models = {t.name: t.model for t in plan.tasks}
    peak = run.cluster.gpu.peak_bf16_tflops * 1e12
    batches = [make_batch(run.workload, run.seed, i) for i in range(iterations)]
    t0 = time.perf_counter()
    num_spans = 0
    for i, batch in enumerate(batches):
        trace = backend.run_iteration(plan, i, batch)
        mk.iteration_metrics(trace, batch.total_num_tokens, task_models, peak)
        num_spans += len(trace.spans)
    wall = time.perf_counter() - t0
    print(f"{system:>16} {model:>8} on {ctx.num_devices} GPUs: {iterations / wall:6.2f} simulated iterations/s "
          f"({wall / iterations * 1e3:7.1f} ms each, {num_spans // iterations} spans/iteration; plan {plan_s:.2f} s)")


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
