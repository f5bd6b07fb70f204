"""Helpers shared by test modules (fixtures live in tests/conftest.py)."""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def flat_weights(state: Mapping[str, "torch.Tensor"] | Path | str) -> "torch.Tensor":
    """A state dict's tensors (or those of one saved with ``torch.save`` at a path) as one float64
    vector in name order: two sets of weights of the same model compare as vectors (a distance, a
    norm), whatever their layout was when they were saved."""
    import torch  # heavy; only the tests of real weights need it

    if isinstance(state, (str, Path)):
        state = torch.load(state)
    return torch.cat([state[name].reshape(-1).double() for name in sorted(state)])


def algo(name: str, *overrides: str):
    """The :class:`~harness.core.algorithm.AlgorithmConfig` of ``algo=<name>`` (conf/algo/) with
    ``overrides`` (``algo.group_size=2``), as a run composes it."""
    from harness.testing import run_config

    return run_config(["+system=rlhfuse_base", f"algo={name}", *overrides]).algo


def readme_command(system: str) -> list[str]:
    """The README's CPU command for ``system`` (``model=tiny workload=tiny backend=ray`` on 4 devices),
    as ``python -m harness`` arguments."""
    pattern = re.compile(rf"^python -m harness \+system={system} model=tiny workload=tiny backend=ray "
                         rf"cluster=h100_8x cluster\.num_nodes=1 cluster\.gpus_per_node=4( [^#\n]*)?$", re.M)
    found = [m.group(0).strip() for m in pattern.finditer(README.read_text())]
    assert len(found) == 1, (system, found)
    return shlex.split(found[0])[3:]


def run_folder(cwd: Path) -> Path:
    """The one run folder a ``python -m harness`` run of ``model=tiny`` started in ``cwd`` wrote
    (``results/default/<variant>/tiny/seed<k>``)."""
    [summary] = Path(cwd).glob("results/default/*/tiny/seed*/summary.json")
    return summary.parent


def harness_env(home: Path) -> dict[str, str]:
    """The caller's environment without W&B credentials or modes, with W&B's own dirs under ``home``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WANDB_API_KEY", "WANDB_MODE", "HYDRA_FULL_ERROR") and not k.startswith("PYTEST_")}
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        env[var] = str(home / ".wandb" / sub)
    return env


@contextlib.contextmanager
def _as_a_command(args: Sequence[str], cwd: Path) -> Iterator[None]:
    """``sys.argv``, the working directory and the environment of ``python -m harness *args`` run in
    ``cwd`` (:func:`harness_env`), restored on the way out."""
    saved_argv, saved_env = sys.argv, dict(os.environ)
    os.environ.clear()
    os.environ.update(harness_env(cwd))
    sys.argv = ["harness", *map(str, args)]
    try:
        with contextlib.chdir(cwd):
            yield
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)


def run_in_process(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m harness *args`` in ``cwd``, run in this process through the command's entry point
    (``harness.cli.app.run``) with its stdout and stderr captured: the same command, checks and files
    as a subprocess, without the seconds a new interpreter takes to import the harness and torch and,
    for ``backend=ray`` inside :func:`local_ray`, to start and stop a Ray instance of its own.
    ``python -m harness`` itself is started as a subprocess by the tests that check the entry point
    (tests/harness/test_entrypoint.py) and the README's commands."""
    from harness.cli import app

    cwd = Path(cwd)
    cwd.mkdir(parents=True, exist_ok=True)
    stdout, stderr = io.StringIO(), io.StringIO()
    with _as_a_command(args, cwd), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            app.run()
            code = 0
        except SystemExit as ended:
            code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
        except Exception:  # noqa: BLE001 - a crash is a failed run, with its traceback, as a subprocess's
            import traceback

            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["python", "-m", "harness", *map(str, args)], code,
                                       stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def local_ray(num_cpus: int = 8) -> Iterator[Path]:
    """A local Ray instance for the runs of one test module, yielding the folder of its log files
    (``worker-*.out``/``.err``: every worker's output, kept after the instance stops). A
    ``backend=ray`` run in this process (:func:`run_in_process`) finds Ray initialised and uses it
    (its workers and placement group are its own and go with the run) instead of starting and
    stopping one of its own."""
    import ray

    context = ray.init(address="local", num_cpus=num_cpus, num_gpus=0, include_dashboard=False,
                       logging_level="WARNING", log_to_driver=False)
    try:
        yield Path(context.address_info["session_dir"]) / "logs"
    finally:
        ray.shutdown()


def run_all_in_process(runs: Mapping[str, Sequence[str]], root: Path) -> dict[str, Path]:
    """Each of ``runs`` (name -> ``python -m harness`` arguments) in ``root / name``
    (:func:`run_in_process`; inside :func:`local_ray` for ``backend=ray`` runs), asserting each
    succeeded: the run folders, by name."""
    out = {}
    for name, args in runs.items():
        proc = run_in_process(args, root / name)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        out[name] = run_folder(root / name)
    return out


def window_metrics(plan, ctx, trace) -> dict[str, float]:
    """The per-iteration metrics of an off-policy window ``trace`` of ``plan``, as the run pipeline
    computes them (the iteration's batch from the workload, as the pipeline draws it)."""
    from harness.core import metrics as mk
    from harness.core.workload import draw_batch

    batch = draw_batch(ctx.workload, ctx.seed, trace.iteration, ctx.algorithm)
    return mk.iteration_metrics(trace, batch.total_num_tokens, {t.name: t.model for t in plan.tasks},
                                ctx.cluster.gpu.peak_bf16_tflops * 1e12)


def off_policy_setup(overrides, policy=None):
    """(plan, ctx, memory report, batch_of) of the run ``overrides`` plan, its off-policy policy
    replaced by ``policy`` when given."""
    import dataclasses

    from harness.core.workload import draw_batch
    from harness.planning.memory import check_plan_memory
    from harness.testing import plan_for

    plan, ctx, _ = plan_for(list(overrides))
    if policy is not None:
        plan = dataclasses.replace(plan, off_policy=policy)
    memory = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    return plan, ctx, memory, (lambda k: draw_batch(ctx.workload, ctx.seed, k, ctx.algorithm))
