"""A sweep's jobs and outcomes (harness/cli/sweep.py): counting jobs (the command line replaces the
experiment's sweep of the same key, as Hydra's basic sweeper does), and the exit status taken from
the jobs' own outcomes: a sweep with a failing job exits 1 and ends with a table of this sweep's
failures only."""
import json
import re
import subprocess
import sys

from harness.cli.sweep import count_sweep_jobs
from tests.helpers import harness_env


def test_jobs_are_the_product_of_the_sweeps():
    assert count_sweep_jobs([], {"model": "a,b,c", "+system": "x,y"}) == 6
    assert count_sweep_jobs(["seed=0,1"], {"model": "a,b,c"}) == 6


def test_a_command_line_override_replaces_the_configured_sweep():
    assert count_sweep_jobs(["model=tiny"], {"model": "a,b,c", "+system": "x,y"}) == 2
    assert count_sweep_jobs(["model=a,b"], {"model": "a,b,c"}) == 2


def test_no_sweep_is_one_job():
    assert count_sweep_jobs(["model=tiny"], None) == 1


# ---- the exit status comes from the jobs, not from failures.jsonl ----------------------------------

REPEATS = 10
SWEEP_LOOP = r'''
import contextlib, io, json, sys
from harness.cli.app import run

argv, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
for _ in range(repeats):
    sys.argv = ["harness", *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            run()
        code = 0
    except SystemExit as e:
        code = e.code
    print(json.dumps({"code": code, "stderr": err.getvalue()}), flush=True)
'''


def test_repeated_failing_sweeps_always_exit_1_with_their_table(tmp_path):
    """The same failing sweep again and again (each rewrites its failures.jsonl line in place, so the
    file need not grow): every repeat exits 1 and ends with the table of its failed job, without the
    failure an earlier sweep recorded in the same file."""
    results_dir = tmp_path / "results"
    failures = results_dir / "default" / "failures.jsonl"
    failures.parent.mkdir(parents=True)
    old = {"system": "realhf", "seed": 0, "overrides": ["+system=realhf", "model=70b"], "error_type": "PlanError",
           "error": "an earlier sweep's failure", "time": 0.0}
    failures.write_text(json.dumps(old) + "\n")
    # deepspeed_chat needs one sample per GPU per step: a global batch of 4 fails on 8 GPUs; rlhfuse_base runs.
    argv = ["-m", "+system=deepspeed_chat,rlhfuse_base", "model=7b", "workload.global_batch_size=4",
            "workload.mini_batch_size=4", "logger=none", "logger.progress_bar=false", "cluster.num_nodes=1",
            "backend.num_iterations=1", "backend.num_warmup_iterations=0", f"results_dir={results_dir}"]
    proc = subprocess.run([sys.executable, "-c", SWEEP_LOOP, json.dumps(argv), str(REPEATS)], cwd=tmp_path,
                          env=harness_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    repeats = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"code"')]
    assert len(repeats) == REPEATS, proc.stdout + proc.stderr
    for i, r in enumerate(repeats):
        assert r["code"] == 1, (i, r["stderr"])
        assert "Traceback" not in r["stderr"] and "earlier sweep" not in r["stderr"], (i, r["stderr"])
        table = r["stderr"][r["stderr"].index("[harness] sweep: 1 of 2 jobs failed"):].splitlines()
        assert re.match(r"\s+system\s+overrides\s+error$", table[1]), (i, table)
        assert re.match(r"\s+deepspeed_chat\s+model=7b workload\.global_batch_size=4 .*PlanError: .*"
                        r"workload\.global_batch_size=4 must be a multiple of 8", table[2]), (i, table)
        assert len(table) == 3, (i, table)  # the table ends the output
    # the earlier sweep's failure and this sweep's job, in its latest state
    assert [json.loads(line)["system"] for line in failures.read_text().splitlines()] == ["realhf", "deepspeed_chat"]
    assert list((results_dir / "default").glob("rlhfuse_base,*/7b/seed0/summary.json"))


def test_a_job_without_outcome_counts_as_failed():
    from harness.cli.sweep import sweep_failures

    outcomes = [{"system": "a", "ok": True}, {"system": "b", "ok": False, "error": "x"}]
    assert [f["system"] for f in sweep_failures(outcomes, 2)] == ["b"]
    failed = sweep_failures(outcomes, 3)
    assert len(failed) == 2 and failed[1]["error_type"] == "NoOutcome"
    assert sweep_failures([{"ok": True}], None) == []


def test_outcomes_are_reported_only_inside_a_sweep(tmp_path, monkeypatch):
    from harness.cli import sweep

    monkeypatch.delenv(sweep.OUTCOMES_ENV, raising=False)
    sweep.report_job_outcome({"system": "a"}, None)  # outside a sweep: nowhere, no error
    monkeypatch.setenv(sweep.OUTCOMES_ENV, str(tmp_path))
    sweep.report_job_outcome({"system": "a"}, None)
    sweep.report_job_outcome({"system": "b"}, ValueError("bad"), tmp_path / "failures.jsonl")
    outcomes = sweep.read_job_outcomes(tmp_path)
    assert [(o["system"], o["ok"]) for o in outcomes] == [("a", True), ("b", False)]
    assert outcomes[1]["error_type"] == "ValueError" and outcomes[1]["error"] == "bad"
