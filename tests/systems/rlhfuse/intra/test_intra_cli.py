"""``python -m systems.rlhfuse.fuse``: JSON output, CSV output, errors (exit 2)."""
import json
import subprocess
import sys

import pytest

from harness.schedule import from_csv, validate
from systems.rlhfuse.fuse import main
from systems.rlhfuse.intra import fused_pipes


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "systems.rlhfuse.fuse", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_json_smoke_and_csv(tmp_path):
    out = tmp_path / "fused.csv"
    proc = _run("--stages", 4, 2, "--microbatches", 4, 8, "--fwd", 2, 1, "--mem", 2, 1,
                "--max-steps", 2000, "--json", "--out", out)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in ("makespan", "lower_bound", "serial_makespan", "greedy_makespan", "peak_memory",
                "serial_peak_memory", "bubble_frac", "search_s", "valid", "gap_to_lower_bound_frac",
                "steps"):
        assert key in data
    assert data["valid"] is True
    assert data["lower_bound"] <= data["makespan"] <= data["serial_makespan"]
    assert data["gap_to_lower_bound_frac"] == pytest.approx(data["makespan"] / data["lower_bound"] - 1)
    assert data["num_ranks"] == 4 and list(data["pipes"]) == ["A", "Ca", "Cb"]
    sched = from_csv(str(out), fused_pipes(4, 2, 4, 8))
    validate(sched)


def test_table_and_grid_without_json():
    proc = _run("--stages", 2, 2, "--microbatches", 2, 2, "--fwd", 1, 1, "--bwd", 2, 2,
                "--mem", 1, 1, "--mem-cap", 3, "--max-steps", 500, "--seed", 3)
    assert proc.returncode == 0, proc.stderr
    assert "makespan" in proc.stdout and "lower bound" in proc.stdout
    assert "r0 |" in proc.stdout and "A0F0" in proc.stdout


def test_makespan_slack_in_the_json():
    base = ["--stages", 4, 2, "--microbatches", 4, 4, "--fwd", 1, 0.6, "--mem", 1, 0.7, "--max-steps", 3000,
            "--json"]
    plain = json.loads(_run(*base).stdout)
    slack = _run(*base, "--makespan-slack", 0.05)
    assert slack.returncode == 0, slack.stderr
    data = json.loads(slack.stdout)
    assert plain["makespan_slack_frac"] == 0 and data["makespan_slack_frac"] == 0.05
    assert data["valid"] is True
    assert plain["makespan"] <= plain["phase1_makespan"] * (1 + 1e-9)
    assert data["makespan"] <= data["phase1_makespan"] * 1.05 * (1 + 1e-9)


@pytest.mark.parametrize("args,message", [
    (["--stages", 0, 2, "--microbatches", 1, 1, "--fwd", 1, 1, "--mem", 1, 1], "--stages"),
    (["--stages", 2, 2, "--microbatches", 1, -1, "--fwd", 1, 1, "--mem", 1, 1], "--microbatches"),
    (["--stages", 2, 2, "--microbatches", 1, 1, "--fwd", 0, 1, "--mem", 1, 1], "--fwd"),
    (["--stages", 2, 2, "--microbatches", 1, 1, "--fwd", 1, 1, "--mem", 1, 0], "--mem"),
    (["--stages", 2, 2, "--microbatches", 1, 1, "--fwd", 1, 1, "--bwd", 1, -2, "--mem", 1, 1], "--bwd"),
    (["--stages", 2, 2, "--microbatches", 2, 2, "--fwd", 1, 1, "--mem", 1, 1, "--mem-cap", 1],
     "below the peak"),
    (["--stages", 2, 2, "--microbatches", 1, 1, "--fwd", 1, 1], "--mem"),
    (["--stages", 2, 2, "--microbatches", 1, 1, "--fwd", 1, 1, "--mem", 1, 1, "--makespan-slack", -0.1],
     "--makespan-slack"),
])
def test_bad_input_exits_2(args, message):
    proc = _run(*args, "--max-steps", 10)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr


REQUIRED = {"--stages": ["2", "2"], "--microbatches": ["2", "2"], "--fwd": ["1", "1"], "--mem": ["1", "1"]}


@pytest.mark.parametrize("option,values", [
    ("--fwd", ["nan", "1"]), ("--fwd", ["1", "inf"]), ("--bwd", ["nan", "2"]), ("--mem", ["1", "inf"]),
    ("--mem-cap", ["inf"]), ("--p2p", ["nan"]), ("--time-limit", ["inf"]), ("--exact-effort", ["nan"]),
    ("--makespan-slack", ["nan"]),
])
def test_non_finite_numbers_are_refused_naming_the_option(option, values, capsys):
    args = {**REQUIRED, "--max-steps": ["10"], option: values}
    with pytest.raises(SystemExit) as refused:
        main([word for key, value in args.items() for word in (key, *value)])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {option} "), err
    assert "finite" in err


def test_nan_forward_time_as_reported_is_one_line():
    proc = _run("--stages", 2, 2, "--microbatches", 2, 2, "--fwd", "nan", 1, "--mem", 1, 1)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --fwd values must be finite and > 0, got nan 1 "
                                        "(python -m systems.rlhfuse.fuse --help lists the options)"]
