"""The results tree (docs/DESIGN.md section 8) and its one loader.

``results/<experiment>/<system>[,<variant>]/<model>/seed<k>/`` holds the resolved config (``config.yaml``),
``plan.json``, ``schedules/*.csv``, ``trace.json`` (Chrome trace), ``metrics.jsonl`` (one line per
iteration), ``units.jsonl`` (one line per iteration: the scheduler's units in start order and the
pairs that ran at the same time) and ``summary.json``. A run is written into a hidden sibling folder and renamed into
place only when complete, so a crash or a refused plan never leaves a half-written run (a killed
run's staging folder is removed by the next run in that experiment, :func:`remove_stale_partials`);
a folder with ``summary.json`` is a finished run and is skipped when a sweep is resumed. Two
identical runs at once: the second waits for the first (:func:`run_lock`, a lock file in the
system's temporary folder, removed when the run ends) and then skips its result. A failed sweep
job is one JSON line of ``results/<experiment>/failures.jsonl``, replaced if it fails again and
removed when it later succeeds.

The *variant* names every command-line override that changes what runs, other than the system,
model and seed (e.g. ``system.migration_frac=0.1,workload.max_gen_len=2048``), so a sweep over a
system or workload parameter gets one folder per point; bookkeeping keys (logger, results
location, experiment name, overwrite, number of measured iterations) are not part of it.

Figure code reads results only through :func:`load_results`.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"
TRACE_FILE = "trace.json"
CONFIG_FILE = "config.yaml"
SAMPLES_FILE = "samples.csv"  # last iteration: one row per sample (lengths, finish time, weights versions)
UNITS_FILE = "units.jsonl"  # per iteration: the scheduler's record (harness.planning.scheduler.UnitQueue.record)
FAILURES_FILE = "failures.jsonl"
LOCK_DIR = Path(tempfile.gettempdir()) / "rlhf-harness-locks"  # run and failures-file locks (this machine)


# Overrides that do not change what runs (or are already in the path) stay out of the variant.
NON_VARIANT_KEYS = ("system", "model", "seed", "experiment", "experiment_name", "results_dir", "overwrite",
                    "backend.num_iterations", "backend.num_warmup_iterations")
NON_VARIANT_GROUPS = ("logger", "llama", "hydra")  # and everything under them
VARIANT_SEPARATOR = ","


def variant_label(overrides: list[str]) -> str:
    """Canonical ``key=value`` list (sorted, comma-joined) of the overrides that define a variant."""
    from urllib.parse import quote

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parts = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        key = o.key_or_group
        if key in NON_VARIANT_KEYS or key.split(".")[0].split("@")[0] in NON_VARIANT_GROUPS:
            continue
        parts.append(f"{key}={quote(o.value_string if hasattr(o, 'value_string') else str(o.value()), safe='=.-_+:')}")
    return VARIANT_SEPARATOR.join(sorted(parts))


MAX_FOLDER_CHARS = 150  # file systems cap a name at 255 bytes; long variants are shortened with a hash


def run_path(root: str | Path, experiment: str, system: str, model: str, seed: int, variant: str = "") -> Path:
    folder = f"{system}{VARIANT_SEPARATOR}{variant}" if variant else system
    if len(folder) > MAX_FOLDER_CHARS:  # the full variant is kept in summary.json ("run"."variant")
        import hashlib

        digest = hashlib.sha1(variant.encode()).hexdigest()[:10]
        folder = f"{folder[:MAX_FOLDER_CHARS - 12]}~{digest}"
    return Path(root) / experiment / folder / model / f"seed{seed}"


def is_finished(path: Path) -> bool:
    return (path / SUMMARY_FILE).is_file()


def write_json(path: Path, obj: Any) -> None:
    """Write JSON via a temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


PARTIAL_MARK = ".partial-"  # staging folders: .<seedK>.partial-<host>-<pid>


def _partial_suffix() -> str:
    return f"{PARTIAL_MARK}{socket.gethostname()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_partials(root: Path) -> list[Path]:
    """Remove the staging folders under ``root`` left by processes of this host that are gone (a
    killed run); folders of live processes and of other hosts are kept. Returns what was removed."""
    removed = []
    host = socket.gethostname()
    for folder in sorted(Path(root).rglob(f".*{PARTIAL_MARK}*")) if Path(root).is_dir() else []:
        tail = folder.name.rpartition(PARTIAL_MARK)[2]
        owner, _, pid = tail.rpartition("-")
        if not folder.is_dir() or not pid.isdigit() or owner not in ("", host):
            continue  # a folder of another machine sharing the tree: its process is not ours to judge
        if not _pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _lock_file(path: Path, kind: str) -> Path:
    """This machine's lock file for ``path`` (in LOCK_DIR, named by a hash of its absolute path)."""
    digest = hashlib.sha256(str(Path(path).absolute()).encode()).hexdigest()[:24]
    return LOCK_DIR / f"{digest}.{kind}.lock"


@contextmanager
def exclusive_lock(lock_path: Path, waiting: str | None = None) -> Iterator[None]:
    """Hold the exclusive ``flock`` of the file ``lock_path`` (created if needed) for the block, and
    remove the file on the way out, so lock files do not pile up in the temporary folder.

    The file is removed while its lock is still held. A process that opened it before the removal
    and gets the lock after it holds a file that is no longer at ``lock_path``: after locking, each
    process compares the file it holds with the one at the path (device and inode) and starts over
    on the path's file when they differ, so two holders never overlap. ``waiting`` is printed as one
    line on stderr when another process holds the lock."""
    announced = False
    while True:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting and not announced:
                    print(waiting, file=sys.stderr, flush=True)
                    announced = True
                fcntl.flock(f, fcntl.LOCK_EX)
            held = os.fstat(f.fileno())
            try:
                current = os.stat(lock_path)
            except FileNotFoundError:
                current = None
            if current is None or (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
                continue  # removed by its last holder: closing releases it; lock the path's file
            try:
                yield
            finally:
                try:
                    os.unlink(lock_path)
                except FileNotFoundError:
                    pass
            return  # closing the file releases the lock, after the removal


@contextmanager
def run_lock(final: Path) -> Iterator[None]:
    """Hold the lock of the run folder ``final`` (one per run path, on this machine): a second
    identical run waits here, saying so in one line, and then finds the first one's result. The lock
    file lives in the temporary directory, so a run refused later writes nothing under results_dir,
    and is removed when the run ends (:func:`exclusive_lock`)."""
    with exclusive_lock(_lock_file(final, "run"), f"[harness] waiting: another run is writing {final}"):
        yield


class RunFolder:
    """Stage a run in ``.<seedK>.partial-<host>-<pid>`` and publish it atomically with :meth:`commit`;
    staging folders of dead processes of this host in the same experiment are removed on the way in."""

    def __init__(self, final: Path, tree: Path | None = None):
        self.final = final
        self.tree = tree  # where stale staging folders are looked for (None: the run's own parent)
        self.staging = final.parent / f".{final.name}{_partial_suffix()}"

    def __enter__(self) -> "RunFolder":
        remove_stale_partials(self.tree if self.tree is not None else self.final.parent)
        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.staging.mkdir(parents=True)
        return self

    def path(self, name: str) -> Path:
        p = self.staging / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def commit(self) -> Path:
        if self.final.exists():  # only with overwrite=true: keep the old run until the new one is in place
            old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            os.replace(self.final, old)
            os.replace(self.staging, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.staging, self.final)
        return self.final

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.staging.exists():  # not committed: discard everything staged
            shutil.rmtree(self.staging, ignore_errors=True)
        _remove_empty_parents(self.final.parent, stop_at=3)


def _remove_empty_parents(path: Path, stop_at: int) -> None:
    for _ in range(stop_at):
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def job_key(job: dict[str, Any]) -> tuple:
    """What identifies a job in failures.jsonl: its system, seed and command-line overrides."""
    return job.get("system"), job.get("seed"), tuple(job.get("overrides") or ())


def _rewrite_failures(path: Path, keep: Callable[[dict[str, Any]], bool], add: dict[str, Any] | None) -> None:
    """``failures.jsonl`` without the lines ``keep`` rejects, plus ``add``; atomic, one writer at a time.
    A line that is not JSON is kept as it is."""
    with exclusive_lock(_lock_file(path, "failures")):
        lines = path.read_text().splitlines() if path.is_file() else []
        out = []
        for text in lines:
            try:
                entry = json.loads(text)
            except json.JSONDecodeError:
                out.append(text)
                continue
            if not isinstance(entry, dict) or keep(entry):
                out.append(text)
        if add is not None:
            out.append(json.dumps(add))
        if not out and not path.exists():
            return
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in out))
        os.replace(tmp, path)


def record_failure(root: str | Path, experiment: str, run: dict[str, Any], error: BaseException) -> Path:
    """Record a failed job in ``<root>/<experiment>/failures.jsonl``, replacing an earlier record of
    the same job (system, seed, overrides): each job appears once, in its latest state."""
    path = Path(root) / experiment / FAILURES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {**run, "error_type": type(error).__name__, "error": str(error), "time": time.time()}
    key = job_key(run)
    _rewrite_failures(path, lambda entry: job_key(entry) != key, line)
    return path


def clear_failure(root: str | Path, experiment: str, run: dict[str, Any]) -> None:
    """Drop the failure record of a job that has now succeeded (nothing to do without one)."""
    path = Path(root) / experiment / FAILURES_FILE
    if not path.is_file():
        return
    key = job_key(run)
    _rewrite_failures(path, lambda entry: job_key(entry) != key, None)


def load_run_table(run_path: str | Path, name: str):
    """A table a run or an experiment wrote next to its results (e.g. ``samples.csv``), as a DataFrame."""
    import pandas as pd

    path = Path(run_path) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such results table (run the experiment first)")
    return pd.read_csv(path)


def write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as CSV atomically (pandas)."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pd.DataFrame(rows).to_csv(tmp, index=False)
    os.replace(tmp, path)


def _variant_columns(variant: str) -> dict[str, Any]:
    """``system.migration_frac=0.1`` -> column ``system.migration_frac`` = 0.1 (numbers parsed)."""
    from urllib.parse import unquote

    out: dict[str, Any] = {}
    for part in filter(None, variant.split(VARIANT_SEPARATOR)):
        key, _, value = part.partition("=")
        text = unquote(value)
        try:
            out[key] = int(text)
        except ValueError:
            try:
                out[key] = float(text)
            except ValueError:
                out[key] = text
    return out


def load_results(root: str | Path = "results", experiment: str | None = None):
    """One row per finished run: experiment, system, variant, model, seed, path, one column per
    variant override, then every summary metric, ``info/`` fact and ``run/cluster``, ``run/workload``."""
    import pandas as pd

    root = Path(root)
    rows = []
    pattern = f"{experiment}/*/*/seed*/{SUMMARY_FILE}" if experiment else f"*/*/*/seed*/{SUMMARY_FILE}"
    for summary_path in sorted(root.glob(pattern)):
        run = summary_path.parent
        with open(summary_path) as f:
            summary = json.load(f)
        system, _, variant = run.parents[1].name.partition(VARIANT_SEPARATOR)
        variant = summary.get("run", {}).get("variant", variant)  # exact even when the folder name is shortened
        rows.append({
            "experiment": run.parents[2].name, "system": system, "variant": variant, "model": run.parent.name,
            "seed": int(run.name.removeprefix("seed")), "path": str(run), **_variant_columns(variant),
            **summary.get("metrics", {}), **{f"info/{k}": v for k, v in summary.get("info", {}).items()},
            **{f"run/{k}": summary["run"][k] for k in ("cluster", "workload") if k in summary.get("run", {})},
        })
    return pd.DataFrame(rows)
