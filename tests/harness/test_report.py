"""``python -m harness.report``: the comparison table of a results tree.

The tree is written by the real harness (sim backend, tiny model and workload, one node of 2 GPUs)
for DeepSpeed-Chat and RLHFuse-Base at two workload variants, plus a failed job recorded through
:func:`harness.run.results.record_failure`. Checked: the table's samples/s are summary.json's, the
speedup over the baseline matches runs by model, seed and workload variant (ignoring ``system.*``
overrides), CSV parses back, failures are listed, the plot is written, and bad folders fail with one
``error:`` line and exit code 2.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.cli import report
from harness.run import results

EXPERIMENT = "demo"
# deepspeed_chat's mini-batch must be a multiple of dp x micro-batch (2 x 2 on 2 GPUs) and divide the
# tiny workload's global batch of 8; these system.* overrides must not stop it being the baseline.
SYSTEMS = {"deepspeed_chat": ["system.mini_batch_size=4", "system.generation_batch_size=8"], "rlhfuse_base": []}
COMMON = ["model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=2",
          "logger=none", "logger.progress_bar=false", f"experiment_name={EXPERIMENT}"]
WORKLOADS = ([], ["workload.max_gen_len=8"])


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    from harness.run.pipeline import compose
    from harness.run.pipeline import execute

    root = tmp_path_factory.mktemp("results")
    for system, extra in SYSTEMS.items():
        for workload in WORKLOADS:
            overrides = [f"+system={system}", *extra, *COMMON, *workload]
            execute(compose([*overrides, f"results_dir={root}"]), overrides)
    results.record_failure(root, EXPERIMENT, {"system": "rlhfuse", "seed": 0,
                                              "overrides": ["+system=rlhfuse", "model=tiny"]},
                           RuntimeError("fused schedule search ran out of budget\nsecond line"))
    results.record_failure(root, "only_failures", {"system": "realhf", "seed": 1, "overrides": ["+system=realhf"]},
                           ValueError("no feasible layout"))
    return root


def summaries(root: Path) -> dict[tuple[str, str], dict]:
    """(system, workload variant) -> summary.json, read straight from the run folders."""
    out = {}
    for path in (root / EXPERIMENT).glob(f"*/*/seed*/{results.SUMMARY_FILE}"):
        summary = json.loads(path.read_text())
        run = summary["run"]
        out[(run["system"], report.workload_variant(run["variant"]))] = summary
    return out


def run_main(capsys, *argv) -> tuple[int, str, str]:
    code = report.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_csv(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(text.splitlines()))


def test_csv_has_summary_values_and_speedups(tree, capsys, tmp_path):
    out_file = tmp_path / "report.csv"
    code, out, err = run_main(capsys, tree / EXPERIMENT, "--format", "csv", "--output", out_file)
    assert code == 0, err
    assert out == ""  # the report went to --output
    rows = read_csv(out_file.read_text())
    stored = summaries(tree)
    assert len(rows) == len(stored) == 4
    assert {"experiment", "system", "variant", "model", "seed", "perf/samples_per_s", "perf/throughput",
            "timing_s/step", "timing_s/gen", "timing_s/update_actor", "util/gpu_busy_frac/mean",
            "pipeline/bubble_frac/update_actor", "speedup_vs_deepspeed_chat"} <= set(rows[0])
    for row in rows:
        summary = stored[(row["system"], report.workload_variant(row["variant"]))]
        assert row["variant"] == summary["run"]["variant"] and row["model"] == "tiny" and row["seed"] == "0"
        for key in ("perf/samples_per_s", "perf/throughput", "timing_s/step", "timing_s/gen"):
            assert float(row[key]) == summary["metrics"][key], key  # full precision in CSV
        base = stored[("deepspeed_chat", report.workload_variant(row["variant"]))]["metrics"]["perf/samples_per_s"]
        expected = summary["metrics"]["perf/samples_per_s"] / base
        assert float(row["speedup_vs_deepspeed_chat"]) == pytest.approx(expected, rel=1e-12)
        if row["system"] == "deepspeed_chat":
            assert float(row["speedup_vs_deepspeed_chat"]) == 1.0
    # The two workloads really differ, so matching on the workload variant matters.
    speedups = {float(r["speedup_vs_deepspeed_chat"]) for r in rows if r["system"] == "rlhfuse_base"}
    assert len(speedups) == 2
    # Order: per workload variant, systems in the shared figure order (DeepSpeed-Chat first).
    assert [r["system"] for r in rows] == ["deepspeed_chat", "rlhfuse_base"] * 2
    # Failed jobs go to stderr in CSV mode, so the file stays one table.
    assert "RuntimeError" in err and "fused schedule search ran out of budget" in err


def test_markdown_table_and_failures(tree, capsys):
    code, out, err = run_main(capsys, tree / EXPERIMENT, "--full")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("| experiment | system") and "samples/s" in lines[0] and "tokens/s/GPU" in lines[0]
    assert "speedup vs DeepSpeed-Chat" in lines[0]
    stored = summaries(tree)
    for (system, _), summary in stored.items():
        cell = report.fmt(summary["metrics"]["perf/samples_per_s"])
        assert any(f"| {system}" in line and f" {cell} |" in line for line in lines), (system, cell)
    assert sum(" 1.000 |" in line for line in lines if "| deepspeed_chat" in line) == 2
    # The failure follows the table: system, overrides, error type, first line of the message only.
    failure = next(line for line in lines if "RuntimeError" in line)
    assert "| rlhfuse" in failure and "+system=rlhfuse model=tiny" in failure
    assert "fused schedule search ran out of budget" in failure and "second line" not in out


def test_compact_default_table(tree, capsys):
    """Without --full: system (its label), model, readable variant, samples/s, speedup, step, bubble."""
    code, out, err = run_main(capsys, tree / EXPERIMENT)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "every run: cluster.gpus_per_node=2 cluster.num_nodes=1 cluster=h100_8x workload=tiny"
    head = [c.strip() for c in lines[2].strip("|").split("|")]
    assert head[:3] == ["system", "model", "variant"] or head[:4] == ["system", "model", "variant", "seed"]
    assert head[-4:] == ["samples/s", "speedup vs DeepSpeed-Chat", "step (s)", "bubble"]
    assert "| DeepSpeed-Chat" in out and "| deepspeed_chat" not in out.split("failed jobs")[0]
    assert "%" not in out.split("failed jobs")[0]  # variants decoded
    assert max(len(line) for line in out.split("failed jobs")[0].splitlines()) < 200
    assert report.readable_variant("a=x%2Fy,b=1") == "a=x/y b=1"


def test_results_root_and_only_failures(tree, capsys):
    code, out, err = run_main(capsys, tree, "--full")
    assert code == 0, err
    assert out.count("| demo ") >= 4 + 1  # four runs and the failure
    assert "no finished runs in only_failures" in out
    assert "ValueError" in out and "no feasible layout" in out
    code, out, err = run_main(capsys, tree / "only_failures")
    assert code == 0, err
    assert "no finished runs in only_failures" in out and "no feasible layout" in out


def test_extra_metrics_and_other_baseline(tree, capsys):
    code, out, err = run_main(capsys, tree / EXPERIMENT, "--format", "csv", "--baseline", "rlhfuse_base",
                              "--metrics", "perf/mfu/*", "perf/total_num_tokens")
    assert code == 0, err
    rows = read_csv(out)
    assert {"perf/mfu/actor", "perf/mfu/critic", "perf/total_num_tokens", "speedup_vs_rlhfuse_base"} <= set(rows[0])
    assert all(float(r["speedup_vs_rlhfuse_base"]) == 1.0 for r in rows if r["system"] == "rlhfuse_base")
    code, _, err = run_main(capsys, tree / EXPERIMENT, "--metrics", "perf/mfu/actr")
    assert code == 2 and err.startswith("error: ") and "perf/mfu/actor" in err
    # A baseline with no runs: empty speedup cells, not an error.
    code, out, err = run_main(capsys, tree / EXPERIMENT, "--format", "csv", "--baseline", "realhf")
    assert code == 0 and all(r["speedup_vs_realhf"] == "" for r in read_csv(out))


def test_plot_writes_png_and_pdf(tree, capsys, tmp_path):
    pytest.importorskip("seaborn")
    code, _, err = run_main(capsys, tree / EXPERIMENT, "--plot", tmp_path / "plots" / "compare.png")
    assert code == 0, err
    for name in ("compare.png", "compare.pdf"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["compare.pdf", "compare.png"]  # no leftovers


def test_bad_folders_exit_2_with_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "missing", tmp_path / "empty"):
        code, out, err = run_main(capsys, folder)
        assert code == 2 and out == ""
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and str(folder) in err
    # As a user runs it: no traceback.
    proc = subprocess.run([sys.executable, "-m", "harness.report", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1


def test_speedup_rule_on_a_sweep():
    """Figure 7 style: the baseline is matched on model, seed and workload variant; when the baseline
    was itself swept over its own system.* keys, its default run is the reference."""
    mk = lambda system, variant, model, value, seed=0: {  # noqa: E731
        "experiment": "fig7", "system": system, "variant": variant, "model": model, "seed": seed,
        "perf/samples_per_s": value}
    df = pd.DataFrame([
        mk("deepspeed_chat", "workload.max_gen_len=512", "13b_33b", 2.0),
        mk("deepspeed_chat", "system.generation_engine=graph,workload.max_gen_len=512", "13b_33b", 4.0),
        mk("deepspeed_chat", "workload.max_gen_len=1024", "13b_33b", 1.0),
        mk("rlhfuse", "system.migration_frac=0.1,workload.max_gen_len=512", "13b_33b", 6.0),
        mk("rlhfuse", "workload.max_gen_len=1024", "13b_33b", 3.0),
        mk("rlhfuse", "workload.max_gen_len=2048", "13b_33b", 3.0),  # no baseline at 2048
        mk("rlhfuse", "workload.max_gen_len=512", "33b_13b", 3.0),  # nor for this model
        mk("rlhfuse", "workload.max_gen_len=512", "13b_33b", 3.0, seed=1),  # nor for this seed
    ])
    assert report.speedups(df, "deepspeed_chat") == [1.0, 2.0, 1.0, 3.0, 3.0, None, None, None]
    ordered = report.sort_runs(df)
    assert [(r.model, report.workload_variant(r.variant), r.system) for r in ordered.itertuples()][:6] == [
        ("13b_33b", "workload.max_gen_len=512", "deepspeed_chat"),
        ("13b_33b", "workload.max_gen_len=512", "deepspeed_chat"),
        ("13b_33b", "workload.max_gen_len=512", "rlhfuse"),
        ("13b_33b", "workload.max_gen_len=512", "rlhfuse"),
        ("13b_33b", "workload.max_gen_len=1024", "deepspeed_chat"),  # 512 before 1024: numbers sort as numbers
        ("13b_33b", "workload.max_gen_len=1024", "rlhfuse"),
    ]


def test_compact_table_shows_staleness_where_a_run_trained_stale_samples():
    """The price of asynchrony beside its speed: staleness mean and largest, once, in that order,
    when any run trained stale samples; not for on-policy runs only."""
    import pandas as pd

    from harness.core import metrics as mk

    def runs(stale_max):
        return pd.DataFrame([{"experiment": "e", "system": s, "variant": "", "model": "m", "seed": 0,
                              mk.SAMPLES_PER_S: sps, mk.STEP_TIME: 1.0, mk.STALENESS_MEAN: mean,
                              mk.STALENESS_MAX: top}
                             for s, sps, mean, top in (("verl", 1.0, 0.0, 0.0), ("areal", 2.0, 0.5 * stale_max,
                                                                                  stale_max))])

    keys, rows = report.build_compact_table(runs(4.0), "verl", [mk.STALENESS_MAX])
    assert keys[-2:] == [mk.STALENESS_MEAN, mk.STALENESS_MAX] and keys.count(mk.STALENESS_MAX) == 1
    assert {row[0]: row[-2:] for row in rows} == {"verl": [0.0, 0.0], "areal": [2.0, 4.0]}
    keys, _ = report.build_compact_table(runs(0.0), "verl")
    assert mk.STALENESS_MEAN not in keys
