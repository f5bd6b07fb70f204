"""Shared fixtures: run ``python -m harness`` as a user would, hermetically."""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def harness_env(home: Path) -> dict[str, str]:
    """The caller's environment without W&B credentials or modes, with W&B's own dirs under ``home``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WANDB_API_KEY", "WANDB_MODE", "HYDRA_FULL_ERROR") and not k.startswith("PYTEST_")}
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        env[var] = str(home / ".wandb" / sub)
    return env


@pytest.fixture(scope="session")
def run_harness():
    """``run_harness(args, cwd, timeout=120) -> CompletedProcess`` for ``python -m harness *args``."""
    def run(args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        cwd = Path(cwd)
        cwd.mkdir(parents=True, exist_ok=True)
        return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], cwd=cwd,
                              env=harness_env(cwd), capture_output=True, text=True, timeout=timeout)
    return run


# Options that make a refused command's run as small as possible, should the refusal not come.
REFUSAL_FAST = ["logger=none", "logger.progress_bar=false", "cluster.num_nodes=1", "backend.num_iterations=1",
                "backend.num_warmup_iterations=0"]


def run_refused(run_harness, tmp_path: Path, *args: str) -> str:
    """Run ``python -m harness args`` that must be refused: exit 2, exactly one stderr line
    ``error: ...``, nothing on stdout and nothing under results_dir. Returns that line."""
    results_dir = tmp_path / "results"
    proc = run_harness([*args, *REFUSAL_FAST, f"results_dir={results_dir}"], cwd=tmp_path / "cwd")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert proc.stdout == ""
    assert not results_dir.exists() or not any(results_dir.rglob("*")), sorted(results_dir.rglob("*"))
    return lines[0]


# ---- parallel runs (pytest-xdist: the README's test command runs ``-n auto --dist loadfile``) ------
# Test files run in parallel worker processes (whole files per worker). Two kinds of test must not
# share the machine with others, so every test module holds an inter-process lock on MACHINE_LOCK
# while it runs (whole modules: module-scoped fixtures start work before any test), shared by
# default and exclusive where needed:
# - a cluster started with ``ray start`` (the README's cluster commands in test_readme.py,
#   test_ray_cluster.py): ``ray stop`` stops every Ray on the machine, and a plain ``ray.init()``
#   would join such a cluster (the harness's embedded runs start their own instance beside it,
#   which test_ray_cluster.py checks);
# - a check of real-time behaviour (two Ray tasks of a few milliseconds overlapping in time,
#   test_ray_backend.py) needs the cores it was written for, not a neighbour's load.
# ``machine_lock.exclusive()`` turns this module's hold exclusive for a block; EXCLUSIVE_MODULES hold
# it exclusively throughout; SELF_LOCKING_MODULES hold nothing until they call
# ``machine_lock.acquire`` (test_readme.py: exclusively, from its first Ray command to its end).
EXCLUSIVE_MODULES = ("tests/harness/backends/ray/test_ray_cluster.py",)
SELF_LOCKING_MODULES = ("tests/test_readme.py",)
MACHINE_LOCK = Path(tempfile.gettempdir()) / "rlhf-harness-tests-machine.lock"


class MachineLock:
    """One hold on MACHINE_LOCK (a file lock: shared or exclusive across processes)."""

    def __init__(self):
        self.file = None

    def acquire(self, exclusive: bool) -> None:
        if self.file is None:
            self.file = open(MACHINE_LOCK, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)  # converts a held lock

    @contextlib.contextmanager
    def exclusive(self):
        """Exclusive for the block, then shared again."""
        self.acquire(exclusive=True)
        try:
            yield
        finally:
            self.acquire(exclusive=False)

    @property
    def held(self) -> bool:
        return self.file is not None

    def release(self) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


@pytest.fixture(scope="module", autouse=True)
def machine_lock(request):
    """This module's hold on MACHINE_LOCK (see above); ``.held`` says whether it holds it."""
    lock = MachineLock()
    where = Path(str(request.node.path)).relative_to(Path(str(request.config.rootpath))).as_posix()
    if where not in SELF_LOCKING_MODULES:
        lock.acquire(exclusive=where in EXCLUSIVE_MODULES)
    yield lock
    lock.release()
