"""Progress over the jobs of a Hydra sweep (``python -m harness -m ...``), and its failures.

A Hydra callback: at the start of a multirun it counts the jobs (the product of the sweep
overrides' lengths, from the command line and from ``hydra.sweeper.params``), then advances a
progress bar as each job ends. With a parallel launcher (joblib) jobs end in worker processes, so
there is no bar; each job still prints its summary.

The sweep's exit status comes from its jobs themselves: at the start of a multirun the callback
makes an outcome folder (named in the environment, :data:`OUTCOMES_ENV`, which the launcher's
worker processes inherit), every job writes one small file there saying whether it succeeded and,
if not, why (:func:`report_job_outcome`), and at the end the callback reads them all. A job that
left no outcome (a worker that died) counts as failed. The failed jobs are printed as a table on
stderr (system, overrides, error) and kept for :func:`last_sweep_failures`, which the entry point
turns into exit code 1. Each failure is also recorded in ``<results_dir>/<experiment_name>/
failures.jsonl`` (:func:`harness.run.results.record_failure`), which lists a job once in its latest
state across sweeps; that file is a record for people, not the source of the exit status.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def count_sweep_jobs(task_overrides: list[str], sweeper_params: dict[str, str] | None) -> int:
    """Jobs of a sweep: the product of the sweep overrides' lengths, where a command-line override
    replaces the ``hydra.sweeper.params`` entry of the same key (as Hydra's basic sweeper does)."""
    parser = OverridesParser.create()
    by_key = {o.key_or_group: o for o in parser.parse_overrides([f"{k}={v}" for k, v in (sweeper_params or {}).items()])}
    by_key.update({o.key_or_group: o for o in parser.parse_overrides(list(task_overrides))})
    sizes = [len(list(o.sweep_string_iterator())) for o in by_key.values() if o.is_sweep_override()]
    return math.prod(sizes) if sizes else 1


_last_failures: list[dict[str, Any]] = []
ERROR_WIDTH = 240  # characters of an error shown in the table (failures.jsonl has all of it)
# Overrides the table leaves out: the system (its own column) and those that do not change what runs.
_TABLE_SKIPS = ("system", "results_dir", "overwrite", "logger", "hydra")


def last_sweep_failures() -> list[dict[str, Any]]:
    """The failed jobs of the last sweep that ended in this process (failures.jsonl entries)."""
    return list(_last_failures)


OUTCOMES_ENV = "HARNESS_SWEEP_OUTCOMES"  # the folder a running sweep's jobs report their outcomes in


def report_job_outcome(job: dict[str, Any], error: BaseException | None, recorded_in: Path | None = None) -> None:
    """Report one job's outcome to the sweep that launched it (nothing outside a sweep). Called by
    the job, in whatever process runs it; one file per job, written whole (a rename)."""
    folder = os.environ.get(OUTCOMES_ENV)
    if not folder or not Path(folder).is_dir():
        return
    entry: dict[str, Any] = {**job, "ok": error is None, "time": time.time()}
    if error is not None:
        entry.update(error_type=type(error).__name__, error=str(error))
        if recorded_in is not None:
            entry["file"] = str(recorded_in)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".job-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f, default=str)
    os.replace(tmp, Path(folder) / f"job-{os.getpid()}-{time.monotonic_ns()}.json")


def read_job_outcomes(folder: Path) -> list[dict[str, Any]]:
    """Every outcome the jobs wrote in ``folder``, in the order they ended."""
    outcomes = []
    for path in folder.glob("job-*.json"):
        try:
            outcomes.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # unreadable: reported as a job without outcome
            continue
    return sorted(outcomes, key=lambda o: o.get("time", 0.0))


def sweep_failures(outcomes: list[dict[str, Any]], total: int | None) -> list[dict[str, Any]]:
    """The failed jobs among ``outcomes``, plus one entry for the jobs of ``total`` that reported
    no outcome at all."""
    failed = [o for o in outcomes if not o.get("ok")]
    missing = (total - len(outcomes)) if total is not None else 0
    if missing > 0:
        failed.append({"system": None, "overrides": [], "error_type": "NoOutcome",
                       "error": f"{missing} job{'s' if missing != 1 else ''} ended without reporting an outcome "
                                f"(a worker process died?)"})
    return failed


def format_failures(failures: list[dict[str, Any]], total: int | None = None) -> str:
    """The table printed at the end of a sweep with failed jobs."""
    files = sorted({f["file"] for f in failures if "file" in f})
    of = f" of {total}" if total else ""
    head = f"[harness] sweep: {len(failures)}{of} job{'s' if (total or len(failures)) != 1 else ''} failed"
    head += f" (recorded in {', '.join(files)}):" if files else ":"
    rows = [(str(f.get("system") or "-"), " ".join(_shown_overrides(f.get("overrides") or [])) or "-",
             f"{f.get('error_type', 'Error')}: {' '.join(str(f.get('error', '')).split())}") for f in failures]
    rows = [(s, o, e if len(e) <= ERROR_WIDTH else e[:ERROR_WIDTH - 3] + "...") for s, o, e in rows]
    ws = max(len("system"), *(len(r[0]) for r in rows))
    wo = max(len("overrides"), *(len(r[1]) for r in rows))
    lines = [head, f"  {'system':<{ws}}  {'overrides':<{wo}}  error"]
    lines += [f"  {s:<{ws}}  {o:<{wo}}  {e}" for s, o, e in rows]
    return "\n".join(lines)


def _shown_overrides(overrides: list[Any]) -> list[str]:
    def group(line: str) -> str:
        return line.split("=", 1)[0].lstrip("+~").split(".")[0].split("@")[0]
    return [str(o) for o in overrides if group(str(o)) not in _TABLE_SKIPS]


class SweepProgress(Callback):
    def __init__(self) -> None:
        self.bar: Any = None
        self.outcomes: Path | None = None
        self.previous_env: str | None = None
        self.total: int | None = None

    # Parallel launchers (joblib) pickle callbacks into their workers: the bar and the failure
    # bookkeeping stay in the parent.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from tqdm import tqdm

        _last_failures.clear()
        self.outcomes = Path(tempfile.mkdtemp(prefix="harness-sweep-"))
        atexit.register(shutil.rmtree, self.outcomes, True)  # also when the sweep is interrupted
        self.previous_env = os.environ.get(OUTCOMES_ENV)
        os.environ[OUTCOMES_ENV] = str(self.outcomes)
        params = config.hydra.sweeper.get("params", None)
        try:
            self.total = count_sweep_jobs(list(config.hydra.overrides.task), dict(params) if params else None)
        except Exception:  # noqa: BLE001 - sweeps the basic sweeper's syntax does not describe
            self.total = None
        if "BasicLauncher" not in str(config.hydra.launcher.get("_target_", "")) or self.total is None:
            return  # parallel launchers end jobs in their workers: no progress reaches this process
        self.bar = tqdm(total=self.total, desc="sweep", unit="job", position=1)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        failures: list[dict[str, Any]] = []
        if self.outcomes is not None:
            failures = sweep_failures(read_job_outcomes(self.outcomes), self.total)
            shutil.rmtree(self.outcomes, ignore_errors=True)
            self.outcomes = None
            if self.previous_env is None:
                os.environ.pop(OUTCOMES_ENV, None)
            else:
                os.environ[OUTCOMES_ENV] = self.previous_env
        _last_failures[:] = failures
        if failures:
            print(format_failures(failures, self.total), file=sys.stderr, flush=True)
