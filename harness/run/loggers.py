"""Experiment loggers: Weights & Biases, offline unless the user is logged in (docs/DESIGN.md section 1).

Runs are grouped by experiment and named ``<system>-<model>-seed<k>``; the W&B files live in the
run folder (``wandb/``), so an offline run can be synced later with ``wandb sync``. ``mode=auto``
goes online only when an API key is configured (``WANDB_API_KEY`` or a netrc entry for the W&B
host) and never prompts. The run config holds the resolved config plus ``provenance``
(:mod:`harness.run.provenance`); the run summary holds summary.json's ``metrics`` under the same keys
as the history (averages after warm-up, not the last iteration's values).
"""
from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from harness.core.config import LoggerConfig
from harness.errors import ConfigError

MODES = ("auto", "online", "offline", "disabled")


def wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


SUMMARY_FORMATS = ("table", "line")


def resolve_mode(cfg: LoggerConfig) -> str:
    if cfg.summary not in SUMMARY_FORMATS:
        raise ConfigError(f"logger.summary={cfg.summary!r}; use one of {SUMMARY_FORMATS}")
    if cfg.mode not in MODES:
        raise ConfigError(f"logger.mode={cfg.mode!r}; use one of {MODES}")
    if not cfg.wandb:
        return "disabled"
    if cfg.mode == "auto":
        return "online" if wandb_logged_in() else "offline"
    if cfg.mode == "online" and not wandb_logged_in():  # else wandb.init fails after planning
        raise ConfigError("logger.mode=online but no W&B credentials are set (WANDB_API_KEY or `wandb login`); "
                          "log in, or use logger.mode=offline or logger.mode=auto")
    return cfg.mode


class WandbLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, experiment: str, name: str, config: dict[str, Any]):
        self.mode = resolve_mode(cfg)
        self.run = None
        if self.mode == "disabled":
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, group=experiment, name=name, job_type="benchmark",
            config=config, dir=str(run_dir), mode=self.mode, reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    @property
    def run_files_dir(self) -> str | None:
        return None if self.run is None else str(Path(self.run.dir).parent)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:  # committed now: W&B would otherwise write the last step at finish,
            self.run.log(metrics, step=step, commit=True)  # after (and over) the run summary

    def update_config(self, config: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.config.update(config, allow_val_change=True)

    def log_summary(self, summary: dict[str, float]) -> None:
        """Make the run summary ``summary`` (summary.json's ``metrics``): W&B keeps each key's last
        logged value as the run summary, so the averages overwrite those under the same keys, and
        a key logged in some iteration but absent from ``summary`` is removed. The history (every
        iteration's values, ``run.log``) is untouched."""
        if self.run is not None:
            for key in [k for k in self.run.summary.keys() if not k.startswith("_") and k not in summary]:
                del self.run.summary[key]
            self.run.summary.update(summary)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
