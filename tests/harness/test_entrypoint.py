"""End-to-end tests of ``python -m harness`` as a user runs it (docs/DESIGN.md sections 1, 8, 9).

Each test runs the entry point in a subprocess from an empty working directory, on the sim backend
with one 8-GPU node and two iterations, writing to a ``results_dir`` under ``tmp_path``. Checked:
the run folder of a single run and what is in it; that bad input fails before any work with a
message naming the bad value and leaves no results behind; that a sweep runs every job, is skipped
when resumed, and survives (and records) a job that fails, then exits 1 with a table of its failures
(tests/harness/test_errors.py checks the one-line errors in detail).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from harness.core.plan import Plan
from harness.schedule import from_csv

FAST = ("logger=none", "cluster.num_nodes=1", "backend.num_iterations=2", "logger.progress_bar=false")
VARIANT = "cluster.num_nodes=1"  # the results variant FAST implies (iterations and logger are not part of it)
RUN_FILES = ("summary.json", "metrics.jsonl", "units.jsonl", "plan.json", "config.yaml", "trace.json")


def harness_args(*overrides: str, results_dir: Path) -> list[str]:
    """``overrides`` plus the fast defaults they do not set themselves, plus ``results_dir``."""
    keys = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    return [*overrides, *(o for o in FAST if o.split("=", 1)[0] not in keys), f"results_dir={results_dir}"]


def leftovers(results_dir: Path) -> list[str]:
    """Every file, seed* folder or hidden partial folder under ``results_dir``."""
    if not results_dir.exists():
        return []
    return sorted(str(p.relative_to(results_dir)) for p in results_dir.rglob("*")
                  if p.is_file() or p.name.startswith(("seed", ".seed")) or "partial" in p.name)


def hidden_entries(results_dir: Path) -> list[str]:
    return sorted(str(p) for p in results_dir.rglob(".*"))


# ---- a single run --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def single_run(tmp_path_factory, run_harness):
    tmp = tmp_path_factory.mktemp("single")
    results_dir = tmp / "results"
    proc = run_harness(harness_args("+system=rlhfuse_base", "model=7b", results_dir=results_dir), cwd=tmp / "cwd")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, results_dir, results_dir / "default" / f"rlhfuse_base,{VARIANT}" / "7b" / "seed0", tmp / "cwd"


def test_single_run_prints_summary_table(single_run):
    proc, _, run_dir, _ = single_run
    assert "samples/s" in proc.stdout
    assert "tokens/s/GPU" in proc.stdout
    assert str(run_dir) in proc.stdout
    assert re.search(r"samples/s\s+\d+\.\d+", proc.stdout), proc.stdout
    assert "Traceback" not in proc.stderr


def test_single_run_writes_complete_run_folder(single_run):
    _, results_dir, run_dir, cwd = single_run
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), name
    assert sorted(p.name for p in (run_dir / "schedules").glob("*.csv")) == ["update_actor.csv", "update_critic.csv"]
    # Published atomically: no staging folders left, and nothing written into the working directory.
    assert hidden_entries(results_dir) == []
    assert [p.name for p in cwd.iterdir() if p.name != ".wandb"] == []

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["run"] == {**summary["run"], "experiment": "default", "system": "rlhfuse_base", "model": "7b",
                              "seed": 0, "backend": "sim", "num_devices": 8, "wandb_mode": "disabled"}
    assert summary["metrics"]["perf/samples_per_s"] > 0
    assert summary["metrics"]["training/global_step"] == 2

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["training/global_step"] for r in rows] == [1, 2]
    assert all(r["timing_s/step"] > 0 for r in rows)

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["system"]["name"] == "rlhfuse_base"
    assert config["model"]["actor"]["name"] == "7b"
    assert config["cluster"]["num_nodes"] == 1
    assert config["backend"]["num_iterations"] == 2
    assert config["results_dir"] == str(results_dir)


def test_trace_json_is_a_chrome_trace(single_run):
    _, _, run_dir, _ = single_run
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list)
    spans = [e for e in events if e.get("ph") == "X"]
    assert spans, "no complete ('X') events"
    for e in spans:
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        assert "name" in e and "pid" in e and "tid" in e, e
    assert {e["pid"] for e in spans} == set(range(8))  # every device of the one node appears
    assert {"gen", "update_actor"} <= {e["name"].split(":")[0] for e in spans}


def test_plan_json_round_trips_and_matches_schedules(single_run):
    _, _, run_dir, _ = single_run
    text = (run_dir / "plan.json").read_text()
    plan = Plan.from_json(text)
    assert plan.to_json() == text
    assert json.loads(Plan.from_json(plan.to_json()).to_json()) == json.loads(text)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.system == "rlhfuse_base"
    plan.validate(8)
    # The schedule CSVs are the plan's training schedules, rank by rank.
    for stage in plan.training:
        csv = run_dir / "schedules" / f"{'+'.join(stage.tasks)}.csv"
        assert from_csv(str(csv), stage.schedule.pipes) == stage.schedule


# ---- bad input: fail before any work, say what was wrong, leave nothing behind -----------------------

BAD_INPUTS = {
    # id: (overrides, regexes the output must contain, is a harness error (exit 2, no traceback))
    "unknown_system": (["+system=nope", "model=7b"],
                       [r"unknown option \+system=nope", r"deepspeed_chat", r"rlhfuse_base"], True),
    "misspelled_key": (["+system=rlhfuse_base", "model=7b", "workload.mini_bach_size=4"],
                       [r"unknown key workload\.mini_bach_size", r"did you mean workload\.mini_batch_size"], True),
    "layout_larger_than_cluster": (["+system=deepspeed_chat", "model=7b", "system.gen_tp=16"],
                                   [r"system\.gen_tp", r"tp=?16", r"8"], True),
    "tp_across_nodes": (["+system=deepspeed_chat", "model=7b", "system.gen_tp=16", "cluster.num_nodes=2"],
                        [r"system\.gen_tp", r"tp=16", r"8 GPUs of a node"], True),
    "plan_exceeds_gpu_memory": (["+system=deepspeed_chat", "model=65b"],
                                [r"does not fit", r"\d+(\.\d+)? GB.*\d+(\.\d+)? GB"], True),
    "missing_profile_table": (["+system=rlhfuse_base", "model=7b", "backend.profile_table=/nonexistent.csv"],
                              [r"backend\.profile_table", r"/nonexistent\.csv", r"no such file"], True),
    "zero_iterations": (["+system=rlhfuse_base", "model=7b", "backend.num_iterations=0"],
                        [r"backend\.num_iterations=0"], True),
    # Fails inside the staged run folder (when the logger starts): the staging must be discarded.
    "bad_logger_mode": (["+system=rlhfuse_base", "model=7b", "logger=wandb", "logger.mode=bogus"],
                        [r"logger\.mode='bogus'"], True),
    "unknown_cost_model": (["+system=rlhfuse_base", "model=7b", "cluster.cost_model=guess"],
                           [r"cluster\.cost_model", r"roofline or calibrated", r"'guess'"], True),
    "missing_calibration": (["+system=rlhfuse_base", "model=7b", "cluster.calibration=/nonexistent.json"],
                            [r"calibration file /nonexistent\.json", r"no such file"], True),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_cleanly(case, tmp_path, run_harness):
    overrides, patterns, harness_error = BAD_INPUTS[case]
    results_dir = tmp_path / "results"
    proc = run_harness(harness_args(*overrides, results_dir=results_dir), cwd=tmp_path / "cwd")
    assert proc.returncode != 0, proc.stdout
    for pattern in patterns:
        assert re.search(pattern, proc.stderr), f"{pattern!r} not in stderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    if harness_error:
        assert proc.returncode == 2
        assert proc.stderr.startswith("error: ")
    assert "samples/s" not in proc.stdout
    assert leftovers(results_dir) == []


# ---- sweeps ----------------------------------------------------------------------------------------

SWEEP = ("-m", "+system=deepspeed_chat,rlhfuse_base", "model=7b")


def test_sweep_runs_every_job_and_resume_skips_them(tmp_path, run_harness):
    results_dir = tmp_path / "results"
    args = harness_args(*SWEEP, results_dir=results_dir)
    runs = [results_dir / "default" / f"{system},{VARIANT}" / "7b" / "seed0" for system in ("deepspeed_chat", "rlhfuse_base")]

    first = run_harness(args, cwd=tmp_path / "cwd")
    assert first.returncode == 0, first.stdout + first.stderr
    for run in runs:
        for name in RUN_FILES:
            assert (run / name).is_file(), run / name
        assert str(run) in first.stdout
    assert "skip" not in first.stdout
    assert not (results_dir / "default" / "failures.jsonl").exists()
    before = {run: ((run / "summary.json").stat().st_mtime_ns, (run / "summary.json").read_bytes()) for run in runs}

    second = run_harness(args, cwd=tmp_path / "cwd")
    assert second.returncode == 0, second.stdout + second.stderr
    for run in runs:
        assert re.search(rf"skip {re.escape(str(run))}", second.stdout), second.stdout
        assert ((run / "summary.json").stat().st_mtime_ns, (run / "summary.json").read_bytes()) == before[run]
    assert hidden_entries(results_dir) == []


def test_sweep_records_a_failing_job_and_finishes_the_others(tmp_path, run_harness):
    # deepspeed_chat trains ZeRO-3 data-parallel over all 8 GPUs, at least one sample per GPU per
    # step: a global batch of 4 fails at plan time, while rlhfuse_base (mini-batch 4) runs.
    results_dir = tmp_path / "results"
    proc = run_harness(harness_args(*SWEEP, "workload.global_batch_size=4", "workload.mini_batch_size=4",
                                    results_dir=results_dir), cwd=tmp_path / "cwd")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "job failed (PlanError)" in proc.stderr, output
    assert "Traceback" not in proc.stderr
    assert re.search(r"sweep: 1 of 2 jobs failed.*\n.*system\s+overrides\s+error\n\s+deepspeed_chat\s+model=7b.*PlanError",
                     proc.stderr), proc.stderr

    lines = (results_dir / "default" / "failures.jsonl").read_text().splitlines()
    assert len(lines) == 1
    failure = json.loads(lines[0])
    assert failure["system"] == "deepspeed_chat"
    assert failure["seed"] == 0
    assert failure["error_type"] == "PlanError"
    assert "workload.global_batch_size=4 must be a multiple of 8" in failure["error"]
    assert "workload.global_batch_size=4" in failure["overrides"]

    assert not list((results_dir / "default").glob("deepspeed_chat*"))
    ok = next((results_dir / "default").glob("rlhfuse_base,*")) / "7b" / "seed0"
    for name in RUN_FILES:
        assert (ok / name).is_file(), ok / name
    assert json.loads((ok / "summary.json").read_text())["metrics"]["perf/samples_per_s"] > 0
    assert hidden_entries(results_dir) == []


def test_help_is_the_harness_own_page(run_harness, tmp_path):
    """``--help``: a usage line, every system with one line, the main groups, three
    examples; no internal schema group, exit 0."""
    from harness.system import discover_systems

    proc = run_harness(["--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: python -m harness +system=<system>")
    for system in discover_systems():
        assert any(line.startswith(f"  {system} ") and len(line.split()) > 2 for line in lines), system
    for group in ("model", "cluster", "workload", "backend", "logger", "experiment", "engine"):
        assert any(line.startswith(f"  {group} ") for line in lines), group
    assert "schema" not in proc.stdout
    assert sum(line.startswith("  python -m harness") for line in lines) == 4
