"""Shared fixtures: run ``python -m harness`` as a user would, hermetically; the order and the machine
lock of parallel runs (pytest-xdist)."""
from __future__ import annotations

import contextlib
import fcntl
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# pytest-xdist runs one worker process per core (the README's ``-n auto``): each worker's torch (and
# the ``python -m harness`` processes it starts, which inherit the variable) gets its share of the
# cores instead of a thread per core each, which oversubscribes the machine: with another process
# keeping both cores of the 2-core CI machine busy, OpenMP threads waiting for a core made in-process
# generation of the tiny model take 26 s instead of 2 s. Set before torch is first imported (it reads
# the variable then).
_NUM_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _NUM_XDIST_WORKERS:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _NUM_XDIST_WORKERS)))

from harness.cli import app  # noqa: E402 - after OMP_NUM_THREADS
from harness.system import PlanContext  # noqa: E402
from harness.testing import context  # noqa: E402
from tests.helpers import harness_env  # noqa: E402


@pytest.fixture(scope="session")
def run_harness():
    """``run_harness(args, cwd, timeout=120) -> CompletedProcess`` for ``python -m harness *args``."""
    def run(args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        cwd = Path(cwd)
        cwd.mkdir(parents=True, exist_ok=True)
        return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], cwd=cwd,
                              env=harness_env(cwd), capture_output=True, text=True, timeout=timeout)
    return run


# The planning context of the planning tests: tiny models on one node of 4 devices.
TINY_FOUR_DEVICES = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "cluster.num_nodes=1",
                     "cluster.gpus_per_node=4"]


@pytest.fixture(scope="session")
def tiny_ctx() -> PlanContext:
    """The PlanContext of TINY_FOUR_DEVICES (frozen; tests only read it)."""
    ctx = context(TINY_FOUR_DEVICES)
    assert ctx.num_devices == 4
    return ctx


# Options that make a refused command's run as small as possible, should the refusal not come.
REFUSAL_FAST = ["logger=none", "logger.progress_bar=false", "cluster.num_nodes=1", "backend.num_iterations=1",
                "backend.num_warmup_iterations=0"]


def override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def refusal_command(tmp_path: Path, args: tuple[str, ...]) -> tuple[list[str], Path]:
    """``args`` with the options of REFUSAL_FAST it does not set, and ``results_dir`` under
    ``tmp_path`` unless it sets one; the results_dir."""
    given = {override_key(a) for a in args}
    argv = [*args, *(o for o in REFUSAL_FAST if override_key(o) not in given)]
    if "results_dir" not in given:
        argv.append(f"results_dir={tmp_path / 'results'}")
    results_dir = Path(next(a for a in reversed(argv) if override_key(a) == "results_dir").partition("=")[2])
    return argv, results_dir


def refusal_line(code, stdout: str, stderr: str, results_dir: Path) -> str:
    """The one line of a refused command (exit 2, exactly one stderr line ``error: ...``, nothing on
    stdout and nothing under results_dir)."""
    lines = stderr.splitlines()
    assert code == 2, stdout + stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert stdout == ""
    assert not results_dir.exists() or not any(results_dir.rglob("*")), sorted(results_dir.rglob("*"))
    return lines[0]


def run_refused(run_harness, tmp_path: Path, *args: str) -> str:
    """Run ``python -m harness args`` that must be refused (:func:`refusal_line`); returns its line."""
    argv, results_dir = refusal_command(tmp_path, args)
    proc = run_harness(argv, cwd=tmp_path / "cwd")
    return refusal_line(proc.returncode, proc.stdout, proc.stderr, results_dir)


@pytest.fixture
def refused_in_process(tmp_path, monkeypatch):
    """``refused_in_process(*args) -> str``: :func:`run_refused` in this process, through the
    command's own entry point (``harness.cli.app.run``, with ``sys.argv``, stdout and stderr
    replaced, the environment as :func:`harness_env` leaves it): the same checks without the
    seconds a new interpreter takes to start (tests/harness/test_entrypoint.py starts it)."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "HYDRA_FULL_ERROR"):
        monkeypatch.delenv(var, raising=False)
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / ".wandb" / sub))

    def refused(*args: str) -> str:
        argv, results_dir = refusal_command(tmp_path, args)
        monkeypatch.setattr(sys, "argv", ["harness", *argv])
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                app.run()
                code = 0
            except SystemExit as ended:
                code = ended.code
        return refusal_line(code, stdout.getvalue(), stderr.getvalue(), results_dir)
    return refused


# ---- parallel runs (pytest-xdist, as the README's test command runs the suite) -------------------------
# Test files run in parallel worker processes (whole files per worker). One kind of test must not
# share the machine with others, so every test module holds an inter-process lock on MACHINE_LOCK
# while it runs (whole modules: module-scoped fixtures start work before any test), shared by
# default and exclusive for EXCLUSIVE_MODULES: the README's cluster commands
# (test_readme_cluster.py), whose ``ray stop`` stops every Ray on the machine and whose run joins
# the cluster that ``ray start`` last started on it. The clusters of test_ray_cluster.py share the
# machine: each has its own port and temporary folder, only that module's runs join them (the
# harness's embedded runs start their own instance beside a running cluster, which it checks), and
# they are stopped by killing their own processes, never with ``ray stop``.
EXCLUSIVE_MODULES = ("tests/test_readme_cluster.py",)
# Modules that never start Ray (planning in-process only) hold no lock, so one runs beside the
# exclusive module instead of a worker waiting for it; tests/test_suite.py checks that their source
# names neither Ray nor a subprocess.
LOCK_FREE_MODULES = ("tests/test_systems_plan.py",)
MACHINE_LOCK = Path(tempfile.gettempdir()) / "rlhf-harness-tests-machine.lock"

# The order files are handed to the workers (the command line's ``--no-loadscope-reorder`` keeps
# this order; by default pytest-xdist orders files by their number of tests, which put the Ray files
# of a few tests and minutes each last, one of them running alone after the other worker had
# finished). First the exclusive module, beside a lock-free module on the other worker (minutes of
# planning that run while the exclusive module holds the machine, instead of a worker waiting);
# then the files that take a minute or more on the 2-core CI machine (``--durations``), longest
# first; then the rest in collection order. tests/test_suite.py checks that every file named here
# exists.
RUN_FIRST = (
    *EXCLUSIVE_MODULES,
    *LOCK_FREE_MODULES,
    "tests/test_suite.py",
    "tests/harness/backends/ray/test_ray_backend.py",
    "tests/harness/backends/ray/test_ray_critic_free.py",
    "tests/test_readme.py",
    "tests/harness/backends/ray/test_ray_fused_order.py",
    "tests/harness/backends/ray/test_ray_checkpoints.py",
    "tests/harness/backends/ray/test_ray_cluster.py",
    "tests/harness/figures/test_figures_e2e.py",
    "tests/test_golden.py",
    "tests/harness/backends/ray/test_ray_deepspeed.py",
    "tests/harness/backends/ray/test_ray_learning.py",
    "tests/harness/backends/ray/test_ray_pin_hints.py",
    "tests/harness/test_entrypoint.py",
    "tests/systems/rlhfuse/intra/test_intra_search.py",
)


def module_path(node, config) -> str:
    """``node``'s file relative to the repository root, with forward slashes."""
    return Path(str(node.path)).relative_to(Path(str(config.rootpath))).as_posix()


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(module_path(item, config), len(rank)))  # stable: the rest keep their order


class MachineLock:
    """One hold on MACHINE_LOCK (a file lock: shared or exclusive across processes)."""

    def __init__(self):
        self.file = None

    def acquire(self, exclusive: bool) -> None:
        if self.file is None:
            self.file = open(MACHINE_LOCK, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def release(self) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


@pytest.fixture(scope="module", autouse=True)
def machine_lock(request):
    """This module's hold on MACHINE_LOCK (see above), for the whole module; none for LOCK_FREE_MODULES."""
    lock = MachineLock()
    path = module_path(request.node, request.config)
    if path not in LOCK_FREE_MODULES:
        lock.acquire(exclusive=path in EXCLUSIVE_MODULES)
    yield lock
    lock.release()
