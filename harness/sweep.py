"""Progress over the jobs of a Hydra sweep (``python -m harness -m ...``), and its failures.

A Hydra callback: at the start of a multirun it counts the jobs (the product of the sweep
overrides' lengths, from the command line and from ``hydra.sweeper.params``), then advances a
progress bar as each job ends. With a parallel launcher (joblib) jobs end in worker processes, so
there is no bar; each job still prints its summary.

A failing job is recorded by the job itself in ``<results_dir>/<experiment_name>/failures.jsonl``
(:func:`harness.results.record_failure`; in a worker process under joblib). The file accumulates
across sweeps, so the callback notes where it ended when the sweep started and, when the sweep
ends, reads the entries written since: it prints them as a table on stderr (system, overrides,
error) and keeps them for :func:`last_sweep_failures`, which the entry point turns into exit code 1.
"""
from __future__ import annotations

import itertools
import json
import math
import sys
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


def failure_files(config: DictConfig) -> list[Path]:
    """The failures.jsonl files the jobs of a sweep write: ``<results_dir>/<experiment_name>/``, for
    every value of ``results_dir`` and ``experiment_name`` the sweep uses (usually one of each)."""
    from harness.results import FAILURES_FILE

    values = {"results_dir": [str(config.results_dir)], "experiment_name": [str(config.experiment_name)]}
    params = config.hydra.sweeper.get("params", None) or {}
    lines = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    try:
        for o in OverridesParser.create().parse_overrides(lines):
            if o.key_or_group in values:
                values[o.key_or_group] = (list(o.sweep_string_iterator()) if o.is_sweep_override()
                                          else [o.get_value_element_as_str()])
    except Exception:  # noqa: BLE001 - an unusual sweep syntax: the config's own values
        pass
    pairs = itertools.product(values["results_dir"], values["experiment_name"])
    paths = (Path(r) / e / FAILURES_FILE for r, e in pairs)
    return list(dict.fromkeys(paths))


def read_new_failures(marks: dict[Path, int], since: float) -> list[dict[str, Any]]:
    """Entries appended to each file after its size in ``marks`` (all entries from ``since`` on
    if the file is now shorter than that, i.e. it was replaced during the sweep)."""
    found = []
    for path, offset in marks.items():
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(offset if size >= offset else 0)
            text = f.read().decode("utf-8", errors="replace")
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and (size >= offset or entry.get("time", since) >= since):
                found.append({**entry, "file": str(path)})
    return found


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
        self.marks: dict[Path, int] = {}
        self.started = 0.0
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
        self.started = time.time()
        self.marks = {p: (p.stat().st_size if p.is_file() else 0) for p in failure_files(config)}
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
        failures = read_new_failures(self.marks, self.started)
        _last_failures[:] = failures
        if failures:
            print(format_failures(failures, self.total), file=sys.stderr, flush=True)
