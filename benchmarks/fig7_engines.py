"""Simulated stage times of every system on the Figure 7 setups, under the previous calibrated model
and under the execution-engine defaults, side by side.

    python benchmarks/fig7_engines.py                        # 13b_33b pair, max_gen_len 1024, 7 systems
    python benchmarks/fig7_engines.py --pairs 13b_33b 33b_13b 33b_65b 65b_33b --max-gen-len 512 1024 2048

"before": the calibrated cost model without execution engines: every fitted engine constant at its
prior (``engine.fitted=false``), no host seconds per CUDA-graph generation step (their prior is vLLM's
measured per-step host time, which the calibrated model alone did not have) and DeepSpeed-Chat on its
earlier generation policy (``benchmarks/engines_before/ds_hybrid_unpadded_prompts.yaml``: prompts not
padded to the maximum). "engines":
the defaults (each system's engines with the constants of ``data/engines/fitted.json``). Each system
plans under each model (its searches score plans with the simulator), on the RLHFuse testbed model
(32 x 8 H100-class GPUs, default workload). Searches use step budgets (deterministic): ReaLHF 50
annealing steps, RLHFuse 2000 fused-schedule steps. Printed per run: generation, generation +
inference, training and step seconds and samples/s, before, with engines, and their ratio.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cost_models import BUDGETS, SYSTEMS, side_by_side, stage_times  # the sibling benchmark (same directory)

HERE = Path(__file__).resolve().parent
# every system but DeepSpeed-Chat defaults to the cuda_graph generation engine
BEFORE = {"*": ["engine.fitted=false", "engine.generation=cuda_graph", "engine.generation.host_s_per_step=0.0"],
          "deepspeed_chat": ["engine.fitted=false",
                             f"engine.generation={HERE / 'engines_before' / 'ds_hybrid_unpadded_prompts.yaml'}"]}


def run(system: str, pair: str, max_gen_len: int, before: bool) -> dict[str, float]:
    extra = BEFORE.get(system, BEFORE["*"]) if before else []
    return stage_times([f"+system={system}", f"model={pair}", f"workload.max_gen_len={max_gen_len}",
                        *BUDGETS.get(system, []), *extra])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", nargs="+", default=["13b_33b"])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--max-gen-len", type=int, nargs="+", default=[1024])
    side_by_side(p.parse_args(), ("before", "eng"), run)


if __name__ == "__main__":
    main()
