"""Every figure renders from a small results tree laid out exactly as the harness writes it.

The tree is synthetic (a few runs with plausible numbers) because the point is the rendering path:
the loader, the columns each figure needs, and PNG + PDF output. Real numbers come from
``python -m harness.figures all --run`` (docs/REPRODUCTION.md).
"""
import pytest

pytest.importorskip("seaborn")

from harness.run import results  # noqa: E402
from harness.figures import FIGURES  # noqa: E402

SYSTEMS = ("deepspeed_chat", "realhf", "interleaved", "disaggregated", "rlhfuse_base", "rlhfuse")
PAIRS = ("13b_33b", "33b_13b", "33b_65b", "65b_33b")


def _run(root, experiment, system, model, variant, metrics, samples=None):
    path = results.run_path(root, experiment, system, model, 0, variant)
    path.mkdir(parents=True)
    results.write_json(path / results.SUMMARY_FILE, {"metrics": metrics, "info": {}})
    if samples is not None:
        results.write_table(path / results.SAMPLES_FILE, samples)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    for cap in (512, 1024):
        _run(root, "fig2_lengths", "rlhfuse_base", "13b_33b", f"workload.max_gen_len={cap}",
             {"gen/tail_s": 1.0, "timing_s/gen": 2.0 + cap / 1024},
             [{"sample_id": i, "prompt_len": 100, "response_len": min(cap, 10 * (i + 1)), "finish_s": i / 10}
              for i in range(50)])
        for k, system in enumerate(SYSTEMS):
            for j, pair in enumerate(PAIRS):
                step = 10.0 - k + j
                _run(root, "fig7_throughput", system, pair, f"workload.max_gen_len={cap}",
                     {"perf/samples_per_s": 512 / step, "timing_s/step": step, "timing_s/gen_inference": 0.6 * step,
                      "timing_s/train": 0.35 * step})
    for pair in ("33b_65b", "65b_33b"):
        for frac in (0.0, 0.1, 0.2):
            _run(root, "fig9_migration", "rlhfuse", pair, f"system.migration_frac={frac}",
                 {"perf/samples_per_s": 40 + 10 * frac})
    rows = [{"pair": "33b/13b", "pp_actor": 8, "pp_critic": 4, "microbatches_actor": m, "microbatches_critic": m // 2,
             "serial_s": 0.1, "greedy_s": 0.09, "fused_s": 0.08, "one_f_one_b_plus_s": 0.095, "lower_bound_s": 0.08,
             "fused_speedup": 1.25, "fused_memory_ratio": 1.0, "greedy_memory_ratio": 1.2,
             "one_f_one_b_plus_memory_ratio": 2.0, "gap_to_lower_bound_frac": 0.0, "search_s": 1.0} for m in (8, 16)]
    results.write_table(root / "table3_schedules" / "table3.csv", rows)
    actions = [{"schedule": s, "rank": r, "pipe": "A" if model == "actor" else "Ca", "model": model, "stage": r,
                "kind": kind, "mb": 0, "start_s": t, "end_s": t + 0.001}
               for s in ("fused", "serial_1f1b") for r in range(2) for model, kind, t in
               (("actor", "F", 0.0), ("critic", "F", 0.001), ("actor", "B", 0.002), ("critic", "B", 0.004))]
    memory = [{"schedule": s, "rank": r, "time_s": t, "activation_gb": g}
              for s in ("fused", "serial_1f1b") for r in range(2) for t, g in ((0.0, 0.1), (0.002, 0.2), (0.005, 0.0))]
    results.write_table(root / "fig10_schedule" / "actions.csv", actions)
    results.write_table(root / "fig10_schedule" / "memory.csv", memory)
    results.write_table(root / "fig10_schedule" / "summary.csv", [{
        "fused_s": 0.006, "serial_s": 0.008, "actor_alone_1f1b_s": 0.006, "lower_bound_s": 0.006,
        "fused_peak_gb": 0.2, "serial_peak_gb": 0.2, "search_s": 1.0}])
    return root


@pytest.mark.parametrize("name", FIGURES)
def test_figure_renders(tree, name):
    import importlib

    paths = importlib.import_module(f"harness.figures.{name}").draw(tree)
    assert {p.suffix for p in paths} >= {".png", ".pdf"}
    for p in paths:
        assert p.is_file() and p.stat().st_size > (1000 if p.suffix in (".png", ".pdf") else 0)


def test_missing_results_give_a_clear_error(tmp_path):
    from harness.figures import fig7_throughput

    with pytest.raises(FileNotFoundError, match="python -m harness \\+experiment=fig7_throughput"):
        fig7_throughput.draw(tmp_path)
