"""Simulated stage times of every system on the Figure 7 setups, under the previous calibrated model
and under the execution-engine defaults, side by side (issue 26).

    python benchmarks/fig7_engines.py                        # 13b_33b pair, max_gen_len 1024, 7 systems
    python benchmarks/fig7_engines.py --pairs 13b_33b 33b_13b 33b_65b 65b_33b --max-gen-len 512 1024 2048

"before": the calibrated cost model as it was before issue 26: every fitted engine constant at its
prior (``engine.fitted=false``) and DeepSpeed-Chat on its issue-12 generation policy
(``benchmarks/engines_before/ds_hybrid_issue12.yaml``: prompts not padded to the maximum). "engines":
the defaults (each system's engines with the constants of ``data/engines/fitted.json``). Each system
plans under each model (its searches score plans with the simulator), on the RLHFuse testbed model
(32 x 8 H100-class GPUs, default workload). Searches use step budgets (deterministic): ReaLHF 50
annealing steps, RLHFuse 2000 fused-schedule steps. Printed per run: generation, generation +
inference, training and step seconds and samples/s, before, with engines, and their ratio.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cost_models import BUDGETS, STAGES, SYSTEMS, side_by_side  # the sibling benchmark (same directory)
from harness.core import metrics as mk
from harness.planning.estimate import simulate_plan
from harness.testing import plan_for

HERE = Path(__file__).resolve().parent
BEFORE = {"*": ["engine.fitted=false"],
          "deepspeed_chat": [f"engine.generation={HERE / 'engines_before' / 'ds_hybrid_issue12.yaml'}"]}


def run(system: str, pair: str, max_gen_len: int, before: bool) -> dict[str, float]:
    extra = (BEFORE["*"] + BEFORE.get(system, [])) if before else []
    plan, ctx, _ = plan_for([f"+system={system}", f"model={pair}", f"workload.max_gen_len={max_gen_len}",
                             *BUDGETS.get(system, []), *extra])
    trace = simulate_plan(ctx, plan)
    m = mk.iteration_metrics(trace, 0, {t.name: t.model.value for t in plan.tasks}, 1.0)
    out = {name: m.get(key, float("nan")) for name, key in STAGES}
    out["samples/s"] = ctx.workload.global_batch_size / trace.makespan_s
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", nargs="+", default=["13b_33b"])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--max-gen-len", type=int, nargs="+", default=[1024])
    side_by_side(p.parse_args(), ("before", "eng"), run)


if __name__ == "__main__":
    main()
