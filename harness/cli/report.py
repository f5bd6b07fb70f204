"""``python -m harness.report results/<experiment> [...]``: one comparison table of finished runs.

Owns the command-line report of a results tree: it reads finished runs only through
:func:`harness.run.results.load_results` and failed sweep jobs from ``results/<experiment>/failures.jsonl``
(:data:`harness.run.results.FAILURES_FILE`), and prints one table, one row per run: experiment, system,
variant, model, seed, samples/s, tokens/s/GPU, step time, every ``timing_s/*`` stage time present in
any run, every ``pipeline/bubble_frac/*``, the mean GPU busy fraction, any ``--metrics`` columns and
the speedup over a baseline system. It changes nothing in the results tree. Figures of the paper
live in :mod:`harness.figures`; ``--plot`` reuses their style (:mod:`harness.figures.style`).

Arguments are experiment folders (``results/<experiment>``) or a results root holding several
(every child folder with runs or a failures file is taken). A path that does not exist or is not a
folder, a folder that holds no finished run and no failure, and an ``--output`` or ``--plot`` path
that cannot be written (checked before anything is read) are input errors: one ``error: ...`` line
on stderr, exit code 2. Ctrl-C ends the command with one line ``interrupted`` and exit code 130.

Speedup rule. ``speedup`` = this run's ``perf/samples_per_s`` / the baseline run's (``--baseline``,
default ``deepspeed_chat``), where the baseline run is the one with the same experiment, the same
model, the same seed and the same *workload variant*: the run's variant with every system-specific
override (``system.*`` keys, e.g. DeepSpeed-Chat's ``system.mini_batch_size=4`` or RLHFuse's
``system.migration_frac=0.1``) removed. Everything else in the variant (``workload.max_gen_len=...``,
``cluster.*``, ``backend=...``) must match, so in the Figure 7 sweep each system is compared with
DeepSpeed-Chat on the same actor/critic pair *and* the same max generation length. If several
baseline runs match (the baseline itself was swept over its own ``system.*`` keys), the one at its
defaults (no ``system.*`` key) is taken; if there is none of those either, or no baseline run matches
at all, the cell is empty. Baseline rows themselves show 1.0 (or their ratio to the default
baseline run).

Row order: experiment, model, workload variant (numbers in names compare as numbers, so
``max_gen_len=512`` sorts before ``1024``), system in :data:`harness.figures.style.SYSTEM_ORDER`
(unknown systems after, alphabetically), the full variant, seed.

Formats: ``--format markdown`` (default; short headers, rounded numbers; failed jobs follow the table
as a second table) or ``--format csv`` (the metric keys as headers, full precision; failed jobs go to
stderr so the CSV stays one table). ``--output FILE`` writes the report there instead of stdout.
``--plot PATH`` also draws samples/s per system grouped by model (and workload variant when the runs
differ in one) to ``PATH.png`` and ``PATH.pdf`` (a ``.png``/``.pdf`` suffix on PATH is dropped).
``--metrics KEY ...`` adds columns (any column of :func:`harness.run.results.load_results`: metric keys or
``info/...``; shell-style wildcards allowed, e.g. ``'perf/mfu/*'``).

``failures.jsonl`` holds each failed job once, in its latest state: a job that fails again replaces
its line, and one that later succeeds removes it (:func:`harness.run.results.record_failure`,
:func:`harness.run.results.clear_failure`); a file written before that rule may still list a job twice,
and the report then shows its latest record only.

``main(argv) -> int`` is the entry point (tests call it directly).
"""
from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.core import metrics as mk
from harness.run import results
from harness.errors import interrupt_is_one_line
from harness.core.files import file_kind
from harness.figures import style

DEFAULT_BASELINE = "deepspeed_chat"
SYSTEM_KEY_PREFIX = "system."  # variant keys of the system under test: not part of the workload variant
ID_COLUMNS = ("experiment", "system", "variant", "model", "seed")
# Headline columns and their short markdown headers; the stage timings follow in this order
# (then any other ``timing_s/*`` alphabetically, wall-clock planning time last).
HEADLINE = {mk.SAMPLES_PER_S: "samples/s", mk.THROUGHPUT: "tokens/s/GPU", mk.STEP_TIME: "step (s)"}
TIMING_ORDER = tuple(mk.timing_key(t) for t in mk.TIMED_TASKS) + (mk.GEN_INFERENCE_TIME, mk.TRAIN_TIME,
                                                                   mk.REALLOC_TIME)
BUBBLE_PREFIX = mk.bubble_key("")
FAILURE_COLUMNS = ("experiment", "system", "seed", "overrides", "error type", "error")


class ReportError(Exception):
    """Bad input: reported as one ``error:`` line and exit code 2."""


@dataclass
class Experiment:
    root: Path  # the results root (parent of the experiment folder)
    name: str
    failures: list[dict[str, Any]] = field(default_factory=list)


# ---- reading -------------------------------------------------------------------------------------

def _has_runs(folder: Path) -> bool:
    return any(folder.glob(f"*/*/seed*/{results.SUMMARY_FILE}"))


def _is_experiment(folder: Path) -> bool:
    return (folder / results.FAILURES_FILE).is_file() or _has_runs(folder)


def find_experiments(paths: list[str | Path]) -> list[Experiment]:
    """The experiments named by ``paths`` (experiment folders or results roots), each once."""
    found: dict[Path, Experiment] = {}
    for arg in paths:
        folder = Path(arg)
        if not folder.is_dir():
            if folder.exists():
                raise ReportError(f"{arg}: is {file_kind(folder)}, not a results folder (expected "
                                  f"results/<experiment>)")
            raise ReportError(f"{arg}: no such folder (expected results/<experiment>)")
        folder = folder.resolve()
        if _is_experiment(folder):
            folders = [folder]
        else:  # a results root: every child experiment
            folders = [child for child in sorted(folder.iterdir()) if child.is_dir() and _is_experiment(child)]
        if not folders:
            raise ReportError(f"{arg}: no finished runs and no {results.FAILURES_FILE} (expected "
                              f"results/<experiment> holding <system>/<model>/seed<k>/{results.SUMMARY_FILE})")
        for f in folders:
            found.setdefault(f, Experiment(f.parent, f.name))
    for exp in found.values():
        exp.failures = read_failures(exp.root / exp.name / results.FAILURES_FILE, exp.name)
    return list(found.values())


def read_failures(path: Path, experiment: str) -> list[dict[str, Any]]:
    """The lines of ``failures.jsonl`` in file order, each job (system, seed, overrides) once at its
    latest record (an unreadable line becomes a failure saying so)."""
    if not path.is_file():
        return []
    out: list[dict[str, Any]] = []
    where: dict[tuple, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            out.append({"experiment": experiment, "error_type": "unreadable line", "error": f"{path}:{n}: {e}"})
            continue
        key = results.job_key(record)
        if key in where:  # an older record of the same job: the later one replaces it
            out[where[key]] = {"experiment": experiment, **record}
        else:
            where[key] = len(out)
            out.append({"experiment": experiment, **record})
    return out


def load_runs(experiments: list[Experiment]):
    """Finished runs of every experiment, one DataFrame (through :func:`harness.run.results.load_results`)."""
    import pandas as pd

    frames = []
    for exp in experiments:
        try:
            df = results.load_results(exp.root, exp.name)
        except (OSError, ValueError) as e:  # an unreadable summary.json
            raise ReportError(f"{exp.root / exp.name}: cannot read results: {e}") from None
        frames.append(df)
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True, sort=False) if frames else pd.DataFrame(columns=list(ID_COLUMNS))


# ---- variants, order, speedup --------------------------------------------------------------------

def _split_variant(variant: str) -> tuple[str, str]:
    """(workload variant, system variant): the ``system.*`` overrides apart from everything else."""
    parts = [p for p in str(variant or "").split(results.VARIANT_SEPARATOR) if p]
    system = [p for p in parts if p.startswith(SYSTEM_KEY_PREFIX)]
    other = [p for p in parts if not p.startswith(SYSTEM_KEY_PREFIX)]
    return results.VARIANT_SEPARATOR.join(other), results.VARIANT_SEPARATOR.join(system)


def workload_variant(variant: str) -> str:
    return _split_variant(variant)[0]


def system_variant(variant: str) -> str:
    return _split_variant(variant)[1]


_NUMBER = re.compile(r"(\d+(?:\.\d+)?)")


def natural_key(text: str) -> tuple:
    """Sort key under which ``512`` < ``1024`` inside names (strings and numbers alternate)."""
    parts = _NUMBER.split(str(text))
    return tuple(float(p) if i % 2 else p for i, p in enumerate(parts))


def system_rank(system: str) -> tuple[int, str]:
    order = style.SYSTEM_ORDER
    return (order.index(system), "") if system in order else (len(order), system)


def sort_runs(df):
    if df.empty:
        return df
    keys = {i: (r["experiment"], natural_key(r["model"]), natural_key(workload_variant(r["variant"])),
                system_rank(r["system"]), natural_key(r["variant"]), int(r["seed"])) for i, r in df.iterrows()}
    return df.loc[sorted(df.index, key=keys.__getitem__)].reset_index(drop=True)


def match_key(row) -> tuple:
    return (row["experiment"], row["model"], workload_variant(row["variant"]), int(row["seed"]))


def speedups(df, baseline: str) -> list[float | None]:
    """Per row, samples/s over the matching baseline run's (module docstring), or None."""
    if df.empty or mk.SAMPLES_PER_S not in df:
        return [None] * len(df)
    candidates: dict[tuple, list] = {}
    for _, row in df[df["system"] == baseline].iterrows():
        candidates.setdefault(match_key(row), []).append(row)
    reference: dict[tuple, float] = {}
    for key, rows in candidates.items():
        if len(rows) > 1:
            rows = [r for r in rows if not system_variant(r["variant"])]
        if len(rows) == 1 and _number(rows[0][mk.SAMPLES_PER_S]):
            reference[key] = float(rows[0][mk.SAMPLES_PER_S])
    out = []
    for _, row in df.iterrows():
        ref = reference.get(match_key(row))
        value = row[mk.SAMPLES_PER_S]
        out.append(float(value) / ref if ref and _number(value) else None)
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---- the table -----------------------------------------------------------------------------------

def metric_columns(df, extra: list[str] | None = None) -> list[str]:
    """The metric columns of the table, in order (``extra``: ``--metrics`` keys or wildcards)."""
    present = set(df.columns)
    timings = [k for k in TIMING_ORDER if k in present]
    timings += sorted(k for k in present if k.startswith("timing_s/") and k not in timings
                      and k not in (mk.STEP_TIME, mk.PLAN_TIME))
    timings += [mk.PLAN_TIME] if mk.PLAN_TIME in present else []
    cols = list(HEADLINE) + timings  # the headline columns always (empty where a run lacks them)
    cols += sorted(k for k in present if k.startswith(BUBBLE_PREFIX))
    cols += [mk.BUSY_MEAN] if mk.BUSY_MEAN in present else []
    for pattern in extra or []:
        hits = sorted(c for c in df.columns if fnmatch.fnmatchcase(str(c), pattern)) if not df.empty else []
        if not hits and not df.empty:
            import difflib

            close = difflib.get_close_matches(pattern, [str(c) for c in df.columns], n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ReportError(f"--metrics {pattern}: no such column in these runs{hint}")
        cols += [c for c in hits if c not in cols and c not in ID_COLUMNS and c != "path"]
        if df.empty and pattern not in cols and not any(ch in pattern for ch in "*?["):
            cols.append(pattern)
    return cols


def build_table(df, baseline: str, extra: list[str] | None = None) -> tuple[list[str], list[list[Any]]]:
    """(column keys, rows): the id columns, the metric columns and ``speedup_vs_<baseline>``."""
    df = sort_runs(df)
    cols = metric_columns(df, extra)
    ratio = speedups(df, baseline)
    keys = list(ID_COLUMNS) + cols + [f"speedup_vs_{baseline}"]
    rows = []
    for i, (_, row) in enumerate(df.iterrows()):
        rows.append([row.get(k) for k in ID_COLUMNS] + [row.get(c) for c in cols] + [ratio[i]])
    return keys, rows


COMPACT_ID_COLUMNS = ("system", "model", "variant")
BUBBLE_COLUMN = "bubble"  # compact table: the mean of the run's pipeline/bubble_frac/* columns


def readable_variant(variant: str) -> str:
    """A variant as a person reads it: percent-escapes decoded, ``key=value`` pairs separated by spaces."""
    from urllib.parse import unquote

    return " ".join(unquote(p) for p in str(variant or "").split(results.VARIANT_SEPARATOR) if p)


def common_variant(df) -> str:
    """The ``key=value`` parts every run's variant shares (said once above the compact table)."""
    parts = [set(p for p in str(v or "").split(results.VARIANT_SEPARATOR) if p) for v in df["variant"]]
    common = set.intersection(*parts) if parts else set()
    return results.VARIANT_SEPARATOR.join(sorted(common))


def build_compact_table(df, baseline: str, extra: list[str] | None = None) -> tuple[list[str], list[list[Any]]]:
    """The default table: system, model, readable variant (the parts that differ between the runs),
    samples/s, speedup, step time, bubble, the staleness of the trained samples (mean and largest)
    where any run trained stale samples, and any ``--metrics``. The experiment and seed columns
    appear only where the runs differ in them."""
    df = sort_runs(df)
    shared = set(common_variant(df).split(results.VARIANT_SEPARATOR)) if not df.empty else set()
    ratio = speedups(df, baseline)
    ids = [c for c in ("experiment",) if not df.empty and df[c].nunique() > 1] + list(COMPACT_ID_COLUMNS)
    ids += ["seed"] if not df.empty and df["seed"].nunique() > 1 else []
    bubbles = sorted(c for c in df.columns if str(c).startswith(BUBBLE_PREFIX))
    standard = set(metric_columns(df))
    extra_cols = [c for c in metric_columns(df, extra) if c not in standard] if extra else []
    if mk.STALENESS_MAX in df.columns and (df[mk.STALENESS_MAX].fillna(0) > 0).any():  # off-policy runs: the price
        price = [mk.STALENESS_MEAN, mk.STALENESS_MAX]
        extra_cols = price + [c for c in extra_cols if c not in price]
    keys = ids + [mk.SAMPLES_PER_S, f"speedup_vs_{baseline}", mk.STEP_TIME, BUBBLE_COLUMN] + extra_cols
    rows = []
    for i, (_, row) in enumerate(df.iterrows()):
        values = [row.get(b) for b in bubbles if _number(row.get(b))]
        bubble = sum(values) / len(values) if values else None
        own = results.VARIANT_SEPARATOR.join(p for p in str(row["variant"] or "").split(results.VARIANT_SEPARATOR)
                                             if p and p not in shared)
        cells = [readable_variant(own) if k == "variant" else row.get(k) for k in ids]
        rows.append(cells + [row.get(mk.SAMPLES_PER_S), ratio[i], row.get(mk.STEP_TIME), bubble]
                    + [row.get(c) for c in extra_cols])
    return keys, rows


def header(key: str, baseline: str) -> str:
    if key == f"speedup_vs_{baseline}":
        return f"speedup vs {style.SYSTEM_LABELS.get(baseline, baseline)}"
    return HEADLINE.get(key, key)


def _missing(value) -> bool:
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN
    except (TypeError, ValueError):
        return False


def fmt(value) -> str:
    """A cell for markdown: numbers rounded (>= 100: one decimal; >= 1: three; below: three significant
    digits, so millisecond stage times of tiny runs stay readable), empty for missing."""
    if _missing(value):
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "dtype"):
        return str(value)
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.3f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def raw(value) -> str:
    """A cell for CSV: full precision, empty for missing."""
    if _missing(value):
        return ""
    value = value.item() if hasattr(value, "item") else value
    return str(value)


def markdown_table(headers: list[str], rows: list[list[str]], numeric: list[bool]) -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    cells = [[cell(h) for h in headers]] + [[cell(c) for c in r] for r in rows]
    widths = [max(3, *(len(r[j]) for r in cells)) for j in range(len(headers))]
    line = lambda r: "| " + " | ".join(  # noqa: E731
        (c.rjust(w) if num else c.ljust(w)) for c, w, num in zip(r, widths, numeric)) + " |"
    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def failure_rows(experiments: list[Experiment]) -> list[list[str]]:
    rows = []
    for exp in experiments:
        for f in exp.failures:
            overrides = f.get("overrides")
            overrides = " ".join(map(str, overrides)) if isinstance(overrides, list) else str(overrides or "")
            message = str(f.get("error", "")).strip().splitlines()
            rows.append([exp.name, str(f.get("system") or ""), raw(f.get("seed")), overrides,
                         str(f.get("error_type", "")), message[0] if message else ""])
    return rows


def render(experiments: list[Experiment], df, baseline: str, fmt_name: str,
           extra: list[str] | None = None, full: bool = False) -> tuple[str, str]:
    """(report, notes for stderr). Markdown is the compact table unless ``full``; CSV is always full."""
    if fmt_name == "csv" or full:
        keys, rows = build_table(df, baseline, extra)
    else:
        keys, rows = build_compact_table(df, baseline, extra)
    failures = failure_rows(experiments)
    empty = [e.name for e in experiments if df.empty or e.name not in set(df["experiment"])]
    notes = []
    if not df.empty and not (df["system"] == baseline).any():
        notes.append(f"note: no {baseline} run: the speedup column is empty (--baseline to choose another system)")
    if fmt_name == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(keys)
        writer.writerows([raw(v) for v in r] for r in rows)
        notes += [f"note: no finished runs in {name}" for name in empty]
        if failures:
            notes.append(f"failed jobs ({len(failures)}):")
            notes += ["  " + " | ".join(r) for r in failures]
        return buf.getvalue(), "\n".join(notes)
    numeric = [k not in ("experiment", "system", "variant", "model") for k in keys]
    if not full:  # readable labels in the compact table
        rows = [[style.SYSTEM_LABELS.get(v, v) if k == "system" else v for k, v in zip(keys, r)] for r in rows]
    parts = []
    shared = readable_variant(common_variant(df)) if not full and not df.empty else ""
    if rows and shared:
        parts.append(f"every run: {shared}")
    if rows:
        parts.append(markdown_table([header(k, baseline) for k in keys], [[fmt(v) for v in r] for r in rows],
                                    numeric))
    parts += [f"no finished runs in {name}" for name in empty]
    if failures:
        parts.append(f"failed jobs ({len(failures)}):\n\n"
                     + markdown_table(list(FAILURE_COLUMNS), failures, [c == "seed" for c in FAILURE_COLUMNS]))
    return "\n\n".join(parts) + "\n", "\n".join(notes)


# ---- the plot ------------------------------------------------------------------------------------

def plot(df, path: str | Path) -> list[Path]:
    """samples/s per system (bars) grouped by model (and by workload variant and experiment where the
    runs differ in them); seeds averaged, with their standard deviation as error bars."""
    try:
        import matplotlib.pyplot as plt
        import seaborn as sns
    except ImportError as e:
        raise ReportError(f"--plot needs matplotlib and seaborn ({e}): pip install -e '.[plots]'") from None
    if df.empty or mk.SAMPLES_PER_S not in df:
        raise ReportError("--plot: no finished run with perf/samples_per_s to draw")
    df = sort_runs(df).copy()
    df["_workload"] = df["variant"].map(workload_variant)
    df["_sysvar"] = df["variant"].map(system_variant)
    differing = _differing_keys(df["_workload"])
    several_experiments = df["experiment"].nunique() > 1

    def group(r) -> str:
        parts = _variant_dict(r["_workload"])
        return "\n".join([r["experiment"]] * several_experiments + [r["model"]]
                         + [f"{k.rpartition('.')[2]}={parts.get(k, 'default')}" for k in differing])

    df["group"] = df.apply(group, axis=1)

    def hue(r) -> str:
        label = style.SYSTEM_LABELS.get(r["system"], r["system"])
        own = df.loc[df["system"] == r["system"], "_sysvar"].nunique() > 1
        return f"{label} [{r['_sysvar']}]" if own and r["_sysvar"] else label

    df["System"] = df.apply(hue, axis=1)
    groups = list(dict.fromkeys(df["group"]))
    hues = list(dict.fromkeys(df["System"]))
    palette = style.palette()
    style.setup()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(groups) * len(hues) + 2.5), 4.0))
    sns.barplot(df, x="group", y=mk.SAMPLES_PER_S, hue="System", order=groups, hue_order=hues,
                palette=palette if set(hues) <= set(palette) else "colorblind",
                errorbar="sd" if df.groupby(["group", "System"]).size().max() > 1 else None, ax=ax)
    ax.set(xlabel="model", ylabel="throughput (samples/s)", title=plot_title(df))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="system")
    return _save(fig, Path(path))


def plot_title(df) -> str:
    """The experiment(s), then the model pair(s), cluster and workload the bars share (from the runs'
    resolved configs where recorded: ``info``/``run`` fields of summary.json)."""
    parts = [", ".join(dict.fromkeys(df["experiment"]))]
    models = list(dict.fromkeys(df["model"]))
    parts.append("model " + ", ".join(models) if len(models) <= 3 else f"{len(models)} model pairs")
    for column, what in (("run/cluster", "cluster"), ("run/workload", "workload")):
        if column in df.columns:
            values = [v for v in dict.fromkeys(df[column]) if isinstance(v, str) and v]
            if values:
                parts.append(f"{what} {', '.join(values)}")
    return " | ".join(parts)


def _variant_dict(variant: str) -> dict[str, str]:
    return dict(p.partition("=")[::2] for p in variant.split(results.VARIANT_SEPARATOR) if p)


def _differing_keys(variants) -> list[str]:
    """Variant keys whose value (or presence) is not the same in every one of ``variants``."""
    parsed = [_variant_dict(v) for v in variants]
    keys = sorted({k for d in parsed for k in d})
    return [k for k in keys if len({d.get(k) for d in parsed}) > 1]


def _save(fig, path: Path) -> list[Path]:
    """``path``.png and .pdf through :func:`harness.figures.style.save` (which writes
    ``<root>/figures/<name>.*``): saved in a hidden folder next to ``path``, then renamed into place."""
    import shutil
    import tempfile

    if path.suffix.lower() in (".png", ".pdf"):
        path = path.with_suffix("")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        out = []
        for saved in style.save(fig, tmp, path.name):
            final = path.with_name(path.name + saved.suffix)
            os.replace(saved, final)
            out.append(final)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- command line --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m harness.report",
                                     description="One table of finished runs (and failed jobs) of experiments.",
                                     epilog="Speedup rule and row order: see the module docstring "
                                            "(python -c 'import harness.cli.report; help(harness.cli.report)').")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="results/<experiment> folder(s), or a results root holding several")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help=f"system the speedup column divides by (default {DEFAULT_BASELINE})")
    parser.add_argument("--format", choices=("markdown", "csv"), default="markdown")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout")
    parser.add_argument("--plot", metavar="PATH", help="also draw samples/s per system as PATH.png and PATH.pdf")
    parser.add_argument("--full", action="store_true",
                        help="every column (ids, all stage times, every bubble, busy fraction), as --format csv has")
    parser.add_argument("--metrics", nargs="+", metavar="KEY", default=[],
                        help="extra columns: metric keys or info/... (wildcards allowed, e.g. 'perf/mfu/*')")
    return parser.parse_args(argv)


def check_outputs(args: argparse.Namespace) -> None:
    """``--output`` and ``--plot`` can be written (ReportError), checked before anything is read."""
    from harness.checks.consistency import check_output_file
    from harness.errors import ConfigError

    try:
        if args.output:
            check_output_file(args.output, "--output")
        if args.plot:
            stem = Path(args.plot)
            stem = stem.with_suffix("") if stem.suffix.lower() in (".png", ".pdf") else stem
            for suffix in (".png", ".pdf"):
                check_output_file(stem.with_name(stem.name + suffix), "--plot")
    except ConfigError as e:
        raise ReportError(str(e)) from None


@interrupt_is_one_line
def main(argv: list[str] | None = None) -> int:
    """The command line; Ctrl-C ends it with one line ``interrupted`` and exit code 130."""
    args = parse_args(argv)
    try:
        check_outputs(args)
        experiments = find_experiments(args.paths)
        df = load_runs(experiments)
        text, notes = render(experiments, df, args.baseline, args.format, args.metrics, args.full)
        plotted = plot(df, args.plot) if args.plot else []
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    else:
        sys.stdout.write(text)
    if notes:
        print(notes, file=sys.stderr)
    for p in plotted:
        print(f"[report] wrote {p}", file=sys.stderr)
    if args.output:
        print(f"[report] wrote {args.output}", file=sys.stderr)
    return 0

