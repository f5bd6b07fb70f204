"""Shared fixtures: run ``python -m harness`` as a user would, hermetically."""
from __future__ import annotations

import os
import subprocess
import sys
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
