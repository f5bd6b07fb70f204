"""Every figure command end to end: ``python -m harness.figures <name> --run`` on a tiny sweep.

Each figure's experiment runs for real (``python -m harness +experiment=<name>`` as a subprocess,
launched by the figure command's ``main`` exactly as from the command line) with overrides,
forwarded by ``-o``, that make it a few seconds: tiny models, workload and one node for the
benchmark sweeps (Figures 2, 7, 8, 9: the overrides replace the experiments' sweeps over the
paper's model pairs and lengths), one small case and a small search budget for the schedule
experiments (Table 3, Figure 10). Every figure runs in its own fresh results folder, so Figure 8
runs its own experiment (it once ran nothing and ended in a traceback). Measured on the 2-core
development machine: about 5-9 s per figure. ``learning_curves`` (real PPO on Ray) runs its
figure command in tests/harness/backends/ray/test_ray_learning.py, whose experiment it is.

Also: missing results end every figure with one ``error:`` line naming the experiment and exit 2,
and a command line the harness refuses stops the figure with exit 2 before drawing; ``python -m
harness.figures`` exits with its ``main``'s status.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("seaborn")

from harness.run import results  # noqa: E402
from harness.figures import EXTRA_FIGURES, FIGURES  # noqa: E402
from harness.figures.__main__ import main, split_overrides  # noqa: E402

# One node of 8 devices; a global batch of 16 so DeepSpeed-Chat's ZeRO-3 gets a micro-batch of 2 per device.
SIM_TINY = ["logger=none", "model=tiny", "workload=tiny", "workload.global_batch_size=16", "workload.max_gen_len=16",
            "cluster=h100_8x", "cluster.num_nodes=1", "backend.num_iterations=2", "backend.num_warmup_iterations=1"]
SCHEDULE_TINY = ["experiment_params.search_action_steps=1e4"]
TINY = {
    "fig2_lengths": [o for o in SIM_TINY if not o.startswith("workload.max_gen_len=")] + ["workload.max_gen_len=8,16"],
    "fig7_throughput": SIM_TINY,
    "fig8_breakdown": SIM_TINY,
    "fig9_migration": SIM_TINY + ["system.migration_frac=0,0.2"],
    "table3_schedules": SCHEDULE_TINY + ["experiment_params.microbatches=[4]",
                                         "experiment_params.cases=[{actor:33b,critic:13b,pp_actor:4,pp_critic:2}]"],
    "fig10_schedule": SCHEDULE_TINY + ["experiment_params.microbatches=4"],
}


def _ran_tiny(root, name) -> None:
    """The experiment ran with the forwarded overrides (not the paper-scale defaults)."""
    if name in ("table3_schedules",):
        table = results.load_run_table(root / name, "table3.csv")
        assert list(table["microbatches_actor"]) == [4] and list(table["pp_actor"]) == [4]
        return
    if name == "fig10_schedule":
        actions = results.load_run_table(root / name, "actions.csv")
        assert set(actions["mb"]) == set(range(4))  # 4 micro-batches per actor pipeline, not 16
        return
    experiment = {"fig8_breakdown": "fig7_throughput"}.get(name, name)
    df = results.load_results(root, experiment)
    assert set(df["model"]) == {"tiny"}, df[["system", "model"]]
    assert len(df) == RUN_COUNTS[name], df[["system", "variant"]]


RUN_COUNTS = {"fig2_lengths": 2, "fig7_throughput": 7, "fig8_breakdown": 2, "fig9_migration": 2}  # of the tiny sweeps


def _draw_tiny(tmp_path, name, capfd):
    root = tmp_path / "results"
    argv = [name, "--run", "--results", str(root)]
    if name == "fig10_schedule":  # the other spelling: everything after -- is forwarded
        argv += ["--", *TINY[name]]
    else:
        argv += [f"--override={o}" for o in TINY[name]]
    code = main(argv)
    out, err = capfd.readouterr()
    assert code == 0, out[-2000:] + err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    for suffix in (".png", ".pdf"):
        path = root / "figures" / f"{name}{suffix}"
        assert path.is_file() and path.stat().st_size > 1000, path
    _ran_tiny(root, name)
    assert f"+experiment={name} results_dir={root}" in out  # fig8 runs its own experiment
    if name in RUN_COUNTS:  # each run one line, not its summary table
        lines = out.splitlines()
        assert len([line for line in lines if line.startswith("run: ")]) == RUN_COUNTS[name], out[-2000:]
        assert not [line for line in lines if line.startswith(" ")], out[-2000:]


@pytest.mark.parametrize("name", FIGURES)
def test_figure_command_runs_and_draws_a_tiny_sweep(tmp_path, monkeypatch, capfd, name):
    monkeypatch.chdir(tmp_path)  # nothing may be written outside tmp_path
    _draw_tiny(tmp_path, name, capfd)



# The long-workload sweep of every system, smaller: a batch of 8 prompts, responses up to 512 tokens
ASYNC_TINY = ["logger=none", "workload.global_batch_size=8", "workload.mini_batch_size=4", "workload.max_gen_len=512",
              "backend.num_iterations=3", "backend.num_warmup_iterations=1"]


def test_async_figures_run_a_small_sweep_and_draw_both(tmp_path, monkeypatch, capfd):
    """``async_tradeoff --run`` runs every system of the experiment once; ``async_utilisation``
    draws from the same runs without running anything."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "results"
    code = main(["async_tradeoff", "--run", "--results", str(root), *[f"--override={o}" for o in ASYNC_TINY]])
    out, err = capfd.readouterr()
    assert code == 0, out[-2000:] + err[-4000:]
    df = results.load_results(root, "async_tradeoff")
    assert set(df["system"]) == {"verl", "nemo_rl", "rlhfuse_base", "rlhfuse", "one_step_off", "nemo_rl_async",
                                 "areal", "partial_rollout", "rollpacker", "streamrl"}
    stale = df.set_index("system")["staleness/max"]
    assert (stale[["verl", "nemo_rl", "rlhfuse_base", "rlhfuse", "rollpacker"]] == 0).all()
    assert (stale[["one_step_off", "nemo_rl_async", "areal", "streamrl"]] >= 1).all()
    code = main(["async_utilisation", "--results", str(root)])
    out, err = capfd.readouterr()
    assert code == 0 and "+experiment=" not in out, out[-2000:] + err[-4000:]
    for name in ("async_tradeoff", "async_utilisation"):
        for suffix in (".png", ".pdf"):
            path = root / "figures" / f"{name}{suffix}"
            assert path.is_file() and path.stat().st_size > 1000, path


def test_utilisation_counts_each_device_once_per_bin(tmp_path):
    """Oracle for the utilisation curve: two devices, one busy the whole time, one half of it."""
    import json

    from harness.figures.async_utilisation import utilisation

    events = [{"ph": "X", "cat": "decode", "pid": 0, "ts": 0.0, "dur": 4e6},
              {"ph": "X", "cat": "forward", "pid": 1, "ts": 0.0, "dur": 2e6},
              {"ph": "X", "cat": "forward", "pid": 1, "ts": 0.5e6, "dur": 1e6},  # overlapping: counted once
              {"ph": "X", "cat": "p2p", "pid": 1, "ts": 2e6, "dur": 2e6}]  # not compute
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    t, frac = utilisation(path, num_devices=2, num_bins=4)
    assert list(t) == [0.5, 1.5, 2.5, 3.5]
    assert list(frac) == [1.0, 1.0, 0.5, 0.5]


@pytest.mark.parametrize("name", FIGURES + EXTRA_FIGURES)
def test_missing_results_end_with_one_error_line_and_exit_2(tmp_path, capfd, name):
    code = main([name, "--results", str(tmp_path)])
    out, err = capfd.readouterr()
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}: "), err
    assert f"python -m harness +experiment={name} results_dir={tmp_path}" in lines[0]
    assert f"python -m harness.figures {name} --run --results {tmp_path}" in lines[0]


def test_the_module_command_exits_with_mains_status(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness.figures", "fig8_breakdown", "--results", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: fig8_breakdown: "), proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_refused_command_line_stops_the_figure_with_exit_2(tmp_path, capfd):
    code = main(["fig9_migration", "--run", "--results", str(tmp_path), "-o", "system.no_such_key=1"])
    out, err = capfd.readouterr()
    assert code == 2
    assert "Traceback" not in err
    assert "error: fig9_migration: python -m harness +experiment=fig9_migration refused" in err
    assert not (tmp_path / "figures").exists()


def test_overrides_need_run_and_a_known_experiment(capfd):
    for argv in (["fig7_throughput", "-o", "model=tiny"], ["fig7_throughput", "--run", "-o", "fig99:model=tiny"],
                 ["fig7_throughput", "--run", "-o", "model"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    capfd.readouterr()
    scoped = split_overrides(["model=tiny", "fig9_migration:system.migration_frac=0,0.2", "~a.b",
                              "table3_schedules:experiment_params.cases=[{actor:33b,critic:13b}]"],
                             {"fig9_migration", "table3_schedules"})
    assert scoped == {None: ["model=tiny", "~a.b"], "fig9_migration": ["system.migration_frac=0,0.2"],
                      "table3_schedules": ["experiment_params.cases=[{actor:33b,critic:13b}]"]}


def test_runs_differing_in_other_overrides_are_refused_not_averaged(tmp_path, capfd):
    for variant in ("system.migration_frac=0.1", "cluster.num_nodes=16,system.migration_frac=0.1"):
        path = results.run_path(tmp_path, "fig9_migration", "rlhfuse", "65b_33b", 0, variant)
        path.mkdir(parents=True)
        results.write_json(path / results.SUMMARY_FILE, {"metrics": {"perf/samples_per_s": 1.0}, "info": {}})
    assert main(["fig9_migration", "--results", str(tmp_path)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: fig9_migration: ") and "different overrides" in err[0], err
