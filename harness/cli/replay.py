"""Replay published measurements of real RLHF runs in the simulator.

    python -m harness.replay data/published/replay.jsonl                  # table + summaries
    python -m harness.replay data/published/replay.jsonl --json out.json  # and records for machines
    python -m harness.replay data/published/replay.jsonl --ids P037 P042  # some points only
    python -m harness.replay data/published/replay.jsonl --gpu-class Hopper  # one GPU generation only

A replay file has one published measurement per line (JSON)::

    {"id": "P037", "overrides": ["+system=deepspeed_chat", ...], "metric": "step_s",
     "value": 1189.13, "source": "...", "assumptions": "..."}

``overrides`` are the Hydra overrides of ``python -m harness`` that express the measured setup,
``metric`` one of :data:`METRICS` (what the simulator's summary reports it as), ``value`` the
measured number in that metric's unit, ``source`` where it was published (points are grouped by
it), ``assumptions`` (optional) what the line had to assume where the source is silent.

Every line is read and every config composed before the first simulation, so a malformed line (or
a file that is not UTF-8 text), an unknown metric, a line whose overrides choose no ``+system=<name>``
or an override the harness does not know ends the command with one line on stderr naming the file
and line, and exit code 2, before any work; so does a ``--json`` path that cannot be written. Ctrl-C
ends it with one line ``interrupted`` and exit code 130. Then each setup is planned and simulated (``backend=sim``, its
iterations and warm-up) and the command prints predicted vs measured per point, then per source, per
GPU generation (:data:`GPU_CLASSES`) with dense and mixture-of-experts actors apart, and overall: the
median and 90th percentile of predicted/measured as times (``time x``: a throughput point's ratio is
measured/predicted, so > 1 always means the simulator is slower than the real run), and the worst
points (furthest from 1 on a log scale). Deterministic: the same file gives the same numbers.

    python -m harness.replay data/published/replay.jsonl --fit --cv --write --jobs 2  # fit

By default it measures with the engines' constants as ``data/engines/fitted.json`` has them
(``--prior``: every fitted constant at its prior). ``--fit`` fits the shared per-engine constants on
the file's points that run the calibrated cost model (:func:`fitted_on`; a point on a GPU without
kernel profiles is replayed on the roofline and reported, not fitted) with
:mod:`harness.costmodel.engine_fit`, prints them and the replay under them; ``--cv`` adds
leave-one-source-out cross-validation; ``--write`` stores the constants; ``--jobs N`` simulates each
fitting iteration's points on N processes (the constants do not depend on N). What the replay file says
about each point (and which points it leaves out, and why) is data, documented in docs/VALIDATION.md.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from harness.checks.consistency import check_output_file
from harness.errors import ConfigError, HarnessError, interrupt_is_one_line
from harness.core import metrics as mk
from harness.core.files import file_kind
from harness.run.pipeline import compose, simulate_summary
from harness.system import discover_systems

# replay metric -> the simulator summary's key (harness.core.metrics)
METRICS = {
    "step_s": "timing_s/step",
    "samples_per_s": "perf/samples_per_s",
    "gen_s": "timing_s/gen",
    "gen_inference_s": "timing_s/gen_inference",
    "train_s": "timing_s/train",
    "realloc_s": "timing_s/realloc",
}
# Metrics where more is faster: their ratio is measured / predicted, so that every ratio reads as the
# simulator's time over the measured time (> 1: the simulator is slower than the real run).
THROUGHPUT_METRICS = ("samples_per_s",)
REQUIRED_FIELDS = ("id", "overrides", "metric", "value", "source")
WORST_SHOWN = 5
FITTED_REL = "data/engines/fitted.json"


@dataclass(frozen=True)
class ReplayPoint:
    id: str
    overrides: tuple[str, ...]
    metric: str
    value: float
    source: str
    assumptions: str = ""
    where: str = ""  # <file>:<line> it was read from


def read_replay(path: Path) -> list[ReplayPoint]:
    """The points of a replay file; ConfigError naming the line for anything malformed."""
    if not path.is_file():
        if path.exists():
            raise ConfigError(f"replay file {path} is {file_kind(path)}, not a file")
        raise ConfigError(f"replay file {path} does not exist")
    points, seen = [], set()
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line); a replay file "
                              f"has one JSON object per line") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        missing = [f for f in REQUIRED_FIELDS if f not in record]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {missing} (a line needs {list(REQUIRED_FIELDS)})")
        unknown = sorted(set(record) - set(REQUIRED_FIELDS) - {"assumptions"})
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}")
        if record["metric"] not in METRICS:
            raise ConfigError(f"{where}: metric {record['metric']!r} is not one of {', '.join(METRICS)}")
        if not isinstance(record["overrides"], list) or not all(isinstance(o, str) for o in record["overrides"]):
            raise ConfigError(f"{where}: overrides must be a list of strings")
        value = record["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{where}: value must be a positive number, got {value!r}")
        if record["id"] in seen:
            raise ConfigError(f"{where}: id {record['id']!r} appears twice")
        seen.add(record["id"])
        points.append(ReplayPoint(str(record["id"]), tuple(record["overrides"]), record["metric"], float(value),
                                  str(record["source"]), str(record.get("assumptions", "")), where))
    if not points:
        raise ConfigError(f"replay file {path} has no points")
    return points


def _composed(point: ReplayPoint):
    label = f"point {point.id}" + (f" ({point.where})" if point.where else "")
    overrides = [o for o in point.overrides if not o.startswith(("backend=", "logger="))]
    if not any(o.partition("=")[0] in ("+system", "++system", "system") for o in overrides):
        raise ConfigError(f"{label}: no system chosen: its overrides need +system=<name> "
                          f"(available: {', '.join(sorted(discover_systems()))})")
    try:
        cfg = compose([*overrides, "backend=sim", "logger=none", "logger.progress_bar=false"])
    except Exception as e:  # Hydra's errors: unknown keys and options, wrong types
        raise ConfigError(f"{label}: its overrides do not compose: {str(e).splitlines()[0]}") from None
    if "system" not in cfg or cfg.system is None:
        raise ConfigError(f"{label}: no system chosen (add +system=<name> to its overrides)")
    return cfg


def _stats(ratios: list[float]) -> dict[str, float]:
    r = np.asarray(ratios)
    return {"n": len(r), "median": float(np.median(r)), "p90": float(np.percentile(r, 90)),
            "within_0.5_2x_frac": float(np.mean((r >= 0.5) & (r <= 2.0)))}


def time_ratio(metric: str, predicted: float, measured: float) -> float:
    """Predicted over measured, as times: > 1 means the simulator is slower than the measured run."""
    return measured / predicted if metric in THROUGHPUT_METRICS else predicted / measured


# GPU generations the report groups points by (the name of the cluster's GPU, by prefix)
GPU_CLASSES = {"A100-class": ("A100", "A800"), "Hopper": ("H100", "H800", "H200", "H20"), "Blackwell": ("GB200", "B200")}


def gpu_class(cfg) -> str:
    """The GPU generation a composed run config runs on (:data:`GPU_CLASSES`), else the GPU's name."""
    name = str(cfg.cluster.gpu.name)
    return next((cls for cls, prefixes in GPU_CLASSES.items() if name.startswith(prefixes)), name)


def is_moe(cfg) -> bool:
    return int(cfg.model.actor.get("num_experts", 0) or 0) > 0


def record(point: ReplayPoint, predicted: float, cfg=None, off_policy: bool = False) -> dict[str, Any]:
    """A replayed point; with its composed config, the GPU generation, whether the actor is a
    mixture of experts, whether the run was off-policy (its trained samples stale) and the key of
    its twins (:func:`twin_key`): what the report groups by besides the source."""
    out = {"id": point.id, "source": point.source, "metric": point.metric, "predicted": predicted,
           "measured": point.value, "ratio": time_ratio(point.metric, predicted, point.value)}
    if cfg is not None:
        out.update({"gpu_class": gpu_class(cfg), "moe": is_moe(cfg), "off_policy": off_policy,
                    "twin": twin_key(point, cfg)})
    return out


def twin_key(point: ReplayPoint, cfg) -> str:
    """What a point shares with its on-policy or off-policy twin: the source (one table of one
    release), the actor, the number of GPUs, the algorithm, the batch and the metric."""
    num_gpus = int(cfg.cluster.num_nodes) * int(cfg.cluster.gpus_per_node)
    return (f"{point.source} | {cfg.model.actor.name} | {num_gpus} GPUs | {cfg.algo.name} | "
            f"{cfg.workload.global_batch_size}x{cfg.algo.group_size} | {point.metric}")


def replay(points: list[ReplayPoint], composed: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One record per point: id, source, metric, predicted, measured, ratio (predicted/measured as times:
    :func:`time_ratio`); each point planned and simulated as ``python -m harness`` would
    (:func:`harness.run.pipeline.simulate_summary`), without writing any results; points with the
    same overrides (a point and its stage lines) once. ``composed``: configs already composed from
    these points' overrides, by point id (composed again otherwise)."""
    composed = composed or {}
    configs = [(p, composed.get(p.id) or _composed(p)) for p in points]  # every config composes before any work
    records = []
    summaries: dict[tuple[str, ...], dict] = {}  # a point's stage lines run its setup: simulated once
    for point, cfg in configs:
        if point.overrides not in summaries:
            summaries[point.overrides] = simulate_summary(cfg)
        summary = summaries[point.overrides]
        records.append(record(point, summary[METRICS[point.metric]], cfg,
                              off_policy=summary.get(mk.STALENESS_MAX, 0.0) > 0))
    return records


# What the fit's worker processes simulate: the composed config of each point (set before the workers
# fork, so that they inherit it instead of receiving it with every job).
_FIT_CONFIGS: list[Any] = []


def _simulate_point(job: tuple[int, dict]) -> dict[str, float]:
    """The replayed metrics of point ``job[0]``'s config under the constants ``job[1]``."""
    from harness.costmodel import engine_fit as ef

    i, values = job
    summary = simulate_summary(ef.with_constants(_FIT_CONFIGS[i], values))
    return {key: summary[key] for key in (*METRICS.values(), mk.STALENESS_MAX) if key in summary}


def fitted_on(cfg) -> bool:
    """Whether a point informs the engines' fitted constants: only points whose cluster runs the
    calibrated cost model do, since the constants are relative to its measured kernel profiles (a
    point on a GPU without profiles runs the roofline, and is replayed but not fitted)."""
    return str(cfg.cluster.cost_model) == "calibrated"


def fit_and_cross_validate(points: list[ReplayPoint], cross_validate: bool, iterations: int = 4,
                           jobs: int = 1, composed: dict[str, Any] | None = None):
    """Fitted constants on the points :func:`fitted_on` admits and, when ``cross_validate``,
    leave-one-source-out records of every point (each source's points predicted with constants fitted
    without them; a source none of whose points is fitted is predicted with the full fit's); see
    :mod:`harness.costmodel.engine_fit`. ``jobs`` processes simulate the points of each fitting
    iteration side by side; the constants do not depend on how many. A point's stage lines (same
    overrides) share its simulations. ``composed`` as for :func:`replay`."""
    import multiprocessing

    from harness.costmodel import engine_fit as ef

    composed = composed or {}
    cfgs = [composed.get(p.id) or _composed(p) for p in points]
    deps = [ef.point_constants(c) for c in cfgs]
    measured = [p.value for p in points]
    fitted = [i for i, c in enumerate(cfgs) if fitted_on(c)]
    if not fitted:
        raise ConfigError("--fit: no point runs the calibrated cost model (cluster.cost_model=calibrated); "
                          "the engines' constants are fitted relative to measured kernel profiles")
    cache: dict[tuple, dict[str, float]] = {}

    def key_of(i: int, values: dict) -> tuple:
        return (points[i].overrides, tuple(sorted((c.label, round(values.get(c, c.prior), 12)) for c in deps[i])))

    def predict(i: int, values: dict) -> float:
        key = key_of(i, values)
        if key not in cache:  # point i's engines resolved with these constants (engine.constants)
            cache[key] = _simulate_point((i, values))
        return cache[key][METRICS[points[i].metric]]

    _FIT_CONFIGS[:] = cfgs
    pool = multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else None

    def simulate_in_pool(wanted: list[tuple[int, dict]]) -> None:
        todo: dict[tuple, tuple[int, dict]] = {}
        for i, values in wanted:
            key = key_of(i, values)
            if key not in cache:
                todo.setdefault(key, (i, values))
        if todo:
            for key, value in zip(todo, pool.map(_simulate_point, list(todo.values()), chunksize=1)):
                cache[key] = value

    try:
        # one process: nothing to simulate ahead, predict simulates each point as it is asked for
        prefetch = simulate_in_pool if pool is not None else None
        values = ef.fit(len(points), deps, measured, predict, include=fitted, iterations=iterations,
                        prefetch=prefetch)
        cv_records = []
        if cross_validate:
            for source in sorted({p.source for p in points}):
                train = [i for i in fitted if points[i].source != source]
                # from the priors, as the full fit: starting from the full fit's constants would carry
                # the left-out source's information into its own prediction
                fold = values if len(train) == len(fitted) else ef.fit(
                    len(points), deps, measured, predict, include=train, iterations=iterations, prefetch=prefetch)
                for i, p in enumerate(points):
                    if p.source == source:
                        predicted = predict(i, fold)
                        cv_records.append(record(p, predicted, cfgs[i],
                                                 off_policy=cache[key_of(i, fold)].get(mk.STALENESS_MAX, 0.0) > 0))
    finally:
        if pool is not None:
            pool.terminate()
        _FIT_CONFIGS.clear()
    return values, cv_records


def report(records: list[dict[str, Any]]) -> str:
    lines = [f"{'id':<12}{'metric':<17}{'predicted':>12}{'measured':>12}{'time x':>11}  source"]
    for r in records:
        lines.append(f"{r['id']:<12}{r['metric']:<17}{r['predicted']:>12.4g}{r['measured']:>12.4g}"
                     f"{r['ratio']:>11.3f}  {r['source'][:60]}")
    lines.append("")
    lines.append(f"{'group':<62}{'n':>4}{'median':>9}{'p90':>9}{'in 0.5-2x':>11}")
    by_source: dict[str, list[float]] = {}
    for r in records:
        by_source.setdefault(r["source"], []).append(r["ratio"])
    for source, ratios in sorted(by_source.items()):
        s = _stats(ratios)
        lines.append(f"{source[:60]:<62}{s['n']:>4}{s['median']:>9.3f}{s['p90']:>9.3f}{s['within_0.5_2x_frac']:>11.0%}")
    by_class: dict[str, list[float]] = {}
    for r in records:
        if "gpu_class" in r:
            by_class.setdefault(f"{r['gpu_class']}, {'MoE' if r['moe'] else 'dense'}", []).append(r["ratio"])
            if r["off_policy"]:
                by_class.setdefault(f"{r['gpu_class']}, {'MoE' if r['moe'] else 'dense'}, off-policy",
                                    []).append(r["ratio"])
    for group, ratios in sorted(by_class.items()):
        s = _stats(ratios)
        lines.append(f"{group:<62}{s['n']:>4}{s['median']:>9.3f}{s['p90']:>9.3f}{s['within_0.5_2x_frac']:>11.0%}")
    s = _stats([r["ratio"] for r in records])
    lines.append(f"{'overall':<62}{s['n']:>4}{s['median']:>9.3f}{s['p90']:>9.3f}{s['within_0.5_2x_frac']:>11.0%}")
    worst = sorted(records, key=lambda r: -abs(math.log(r["ratio"])))[:WORST_SHOWN]
    lines.append("worst: " + ", ".join(f"{r['id']} {r['ratio']:.2f}x" for r in worst))
    pairs = twins(records)
    if pairs:
        lines.append("")
        lines.append("off-policy / on-policy twins (same source, actor, GPUs, algorithm, batch): step-time ratio")
        lines.append(f"{'off':<8}{'on':<8}{'published':>10}{'predicted':>11}{'pred/pub':>10}  twin")
        for off, on in pairs:
            published, predicted = off["measured"] / on["measured"], off["predicted"] / on["predicted"]
            lines.append(f"{off['id']:<8}{on['id']:<8}{published:>10.3f}{predicted:>11.3f}{predicted / published:>10.3f}"
                         f"  {off['twin'].split(' | ', 1)[1][:60]}")
    return "\n".join(lines)


def twins(records: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(off-policy record, on-policy record) pairs with the same :func:`twin_key`, each off-policy
    record with every on-policy twin it has."""
    on: dict[str, list[dict]] = {}
    for r in records:
        if "twin" in r and not r["off_policy"]:
            on.setdefault(r["twin"], []).append(r)
    return [(r, twin) for r in records if r.get("off_policy") for twin in on.get(r["twin"], [])]


@interrupt_is_one_line
def main(argv: list[str] | None = None) -> int:
    """The command line; Ctrl-C ends it with one line ``interrupted`` and exit code 130."""
    p = argparse.ArgumentParser(prog="python -m harness.replay",
                                description="Replay published RLHF measurements in the simulator.")
    p.add_argument("file", type=Path, help="replay file (JSON lines)")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the records as a JSON list here")
    p.add_argument("--ids", nargs="+", metavar="ID", help="replay only these points")
    p.add_argument("--fit", action="store_true",
                   help="fit the engines' shared constants on these points, then replay with them")
    p.add_argument("--cv", action="store_true", help="with --fit: leave-one-source-out cross-validation")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="with --fit: simulate on N processes side by side (the constants do not depend on N)")
    p.add_argument("--write", action="store_true", help=f"with --fit: write the constants to {FITTED_REL}")
    p.add_argument("--prior", action="store_true",
                   help="replay with every fitted constant at its prior (engine.fitted=false)")
    p.add_argument("--gpu-class", choices=sorted(GPU_CLASSES), metavar="CLASS",
                   help=f"only the points on this GPU generation ({', '.join(sorted(GPU_CLASSES))})")
    args = p.parse_args(argv)
    if (args.cv or args.write) and not args.fit:
        p.error("--cv and --write need --fit")
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give a number of processes >= 1")
    try:
        if args.json:
            check_output_file(args.json, "--json")
        points = read_replay(args.file)
        if args.ids:
            unknown = sorted(set(args.ids) - {pt.id for pt in points})
            if unknown:
                raise ConfigError(f"--ids: no point(s) {unknown} in {args.file}")
            points = [pt for pt in points if pt.id in set(args.ids)]
        composed: dict[str, Any] = {}  # configs composed to filter, reused by what runs them
        if args.gpu_class:
            composed = {pt.id: _composed(pt) for pt in points}
            points = [pt for pt in points if gpu_class(composed[pt.id]) == args.gpu_class]
            if not points:
                raise ConfigError(f"--gpu-class {args.gpu_class}: no point of {args.file} runs on it")
        if args.prior:
            points = [replace(pt, overrides=pt.overrides + ("engine.fitted=false",)) for pt in points]
            composed = {}  # other overrides now
        cv_records: list[dict[str, Any]] = []
        if args.fit:
            from harness.costmodel import engine_fit as ef

            values, cv_records = fit_and_cross_validate(points, args.cv, jobs=args.jobs, composed=composed)
            print("fitted constants (prior -> fitted):")
            for c, v in sorted(values.items(), key=lambda kv: kv[0].label):
                print(f"  {c.label:<48}{c.prior:>10.4g} -> {v:.4g}")
            # the replay under the fitted constants: each point with engine.constants set to them
            records = replay([replace(pt, overrides=pt.overrides + (ef.constants_override(values),))
                              for pt in points])
        else:
            records = replay(points, composed)
    except HarnessError as e:  # bad input, or a point whose plan is impossible
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(records))
    if cv_records:
        print("\nleave-one-source-out (each source predicted with constants fitted without it):")
        print(report(cv_records))
    if args.fit and args.write:
        from harness.core.engines import FITTED_PATH

        cv = None
        if cv_records:
            cv = {source: _stats([r["ratio"] for r in cv_records if r["source"] == source])["median"]
                  for source in sorted({r["source"] for r in cv_records})}
        ef.write_fitted(values, FITTED_PATH, str(args.file), len(points), cv)
        print(f"wrote {FITTED_PATH}")
    if args.json:
        args.json.write_text(json.dumps(records + [{**r, "cross_validation": "leave_one_source_out"}
                                                   for r in cv_records], indent=1) + "\n")
    return 0

