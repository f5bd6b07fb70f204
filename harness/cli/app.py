"""Entry point: ``python -m harness +system=<name> model=<size> [overrides]`` (docs/DESIGN.md sections 1, 9).

Registers the typed schemas, discovers systems (:mod:`harness.system`: importing each registers
its config schema; the harness never imports systems by name), checks the command line
(:func:`harness.checks.command_line.check_command_line`: unknown keys and group options, values of the wrong
type, in a sweep for its jobs), then hands control to Hydra. Errors caused by input
(:class:`harness.errors.HarnessError`) end a single run with one line ``error: ...`` on stderr and
exit code 2, before any result is written; a bad command line ends a sweep the same way before any
job starts. In a sweep (``-m``) every job reports its outcome to the sweep
(:func:`harness.cli.sweep.report_job_outcome`), a failing job is also recorded in
``results/<experiment>/failures.jsonl``, and the sweep goes on; at its end the sweep prints a table
of its failed jobs (:class:`harness.cli.sweep.SweepProgress`) and exits 1 if any job failed. Ctrl-C ends the command with
one line and exit code 130; the interrupted run's staged folder is removed (finished runs stay).
Each run ends by printing its summary table, or one line with ``logger.summary=line``.
"""
from __future__ import annotations

import sys
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from harness.backends import register_backend_configs
from harness.checks.command_line import check_command_line
from harness.cli import sweep
from harness.core.config import register_configs
from harness.core.engines import engine_group_overrides, engine_key_overrides
from harness.errors import HarnessError
from harness.run import results
from harness.run.pipeline import execute, run_experiment
from harness.run.runner import format_summary
from harness.system import discover_systems


def _is_multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        return False


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    if cfg.get("experiment_runner"):  # a non-benchmark experiment (e.g. a schedule table)
        print(f"[harness] experiment {cfg.experiment_name}: wrote {run_experiment(cfg)}")
        sweep.report_job_outcome({"system": None, "overrides": list(HydraConfig.get().overrides.task)}, None)
        return None
    multirun = _is_multirun()
    overrides = engine_key_overrides(HydraConfig.get().overrides.task)  # engine.<kind>=, as the user wrote it
    job = {"system": cfg.system.name if "system" in cfg else None, "seed": cfg.seed, "overrides": overrides}
    try:
        outcome = execute(cfg, overrides)
    except HarnessError as e:
        if not multirun:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        path = results.record_failure(cfg.results_dir, cfg.experiment_name, job, e)
        sweep.report_job_outcome(job, e, path)
        print(f"[harness] job failed ({type(e).__name__}): {e}\n  recorded in {path}", file=sys.stderr)
        return None
    except Exception as e:  # noqa: BLE001 - a sweep must survive one broken job
        if not multirun:
            raise
        traceback.print_exc()
        path = results.record_failure(cfg.results_dir, cfg.experiment_name, job, e)
        sweep.report_job_outcome(job, e, path)
        print(f"[harness] job crashed ({type(e).__name__}); recorded in {path}", file=sys.stderr)
        return None
    results.clear_failure(cfg.results_dir, cfg.experiment_name, job)  # it has a result now: not a failure
    sweep.report_job_outcome(job, None)
    brief = cfg.logger.summary == "line"
    if not (brief and outcome.skipped):  # a skipped run has said so in one line already
        print(format_summary(outcome, brief=brief))
    return outcome.summary.get("perf/samples_per_s")


def run() -> None:
    """``python -m harness``: Ctrl-C at any point ends it with one line and exit code 130 (a run's
    staged folder is discarded on the way out, :class:`harness.run.results.RunFolder`)."""
    try:
        _run()
    except KeyboardInterrupt:
        print("interrupted: nothing of the unfinished run was kept", file=sys.stderr)
        sys.exit(130)


def _run() -> None:
    register_configs()
    register_backend_configs()
    systems = discover_systems()
    if any(a in ("--help", "-h") for a in sys.argv[1:]):  # ours, not Hydra's generic page
        from harness.cli.help import help_text

        print(help_text(systems))
        sys.exit(0)
    sys.argv[1:] = engine_group_overrides(sys.argv[1:])  # engine.<kind>=<name>: Hydra composes the engine
    try:
        check_command_line(sys.argv[1:])  # a sweep's jobs too: minutes for a large one
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
    failures = sweep.last_sweep_failures()
    if failures:  # the table was printed at the end of the sweep
        sys.exit(1)

