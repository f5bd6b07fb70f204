"""Progress over the jobs of a Hydra sweep (``python -m harness -m ...``).

A Hydra callback: at the start of a multirun it counts the jobs (the product of the sweep
overrides' lengths, from the command line and from ``hydra.sweeper.params``), then advances a
progress bar as each job ends. With a parallel launcher (joblib) jobs end in worker processes, so
there is no bar; each job still prints its summary.
"""
from __future__ import annotations

import math
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def count_sweep_jobs(task_overrides: list[str], sweeper_params: dict[str, str] | None) -> int:
    overrides = list(task_overrides) + [f"{k}={v}" for k, v in (sweeper_params or {}).items()]
    parsed = OverridesParser.create().parse_overrides(overrides)
    sizes = [len(list(o.sweep_string_iterator())) for o in parsed if o.is_sweep_override()]
    return math.prod(sizes) if sizes else 1


class SweepProgress(Callback):
    def __init__(self) -> None:
        self.bar: Any = None

    # Parallel launchers (joblib) pickle callbacks into their workers: the bar stays in the parent.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.bar = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from tqdm import tqdm

        if "BasicLauncher" not in str(config.hydra.launcher.get("_target_", "")):
            return  # parallel launchers end jobs in their workers: no progress reaches this process
        params = config.hydra.sweeper.get("params", None)
        total = count_sweep_jobs(list(config.hydra.overrides.task), dict(params) if params else None)
        self.bar = tqdm(total=total, desc="sweep", unit="job", position=1)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
