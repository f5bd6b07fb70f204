"""The record of one run: the files of its results folder, its ``summary.json`` and the table it prints.

:func:`harness.run.pipeline.execute` runs the pipeline and calls these writers; the folder's layout
and its staging are :mod:`harness.run.results`'.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.core import metrics as mk
from harness.core.plan import Plan
from harness.core.trace import PARAM_DIGEST, UNITS, StepTrace, write_chrome_trace
from harness.planning.memory import MemoryReport
from harness.run import results
from harness.schedule import to_csv


@dataclass
class RunOutcome:
    """A run's folder, its averaged metrics and plan facts; ``skipped``: it had finished before."""

    path: Path
    summary: dict[str, float]
    skipped: bool
    info: dict[str, Any] | None = None


def model_label(models) -> str:
    """``13b`` when all four roles match, ``<actor>_<critic>`` for paper pairs, else all four."""
    a, c, r, w = (getattr(models, role).name for role in ("actor", "critic", "ref", "reward"))
    if a == c == r == w:
        return a
    if a == r and c == w:
        return f"{a}_{c}"
    return f"a{a}_c{c}_r{r}_w{w}"


def plan_info(plan: Plan, memory: MemoryReport) -> dict[str, Any]:
    """Facts about the plan worth seeing next to the numbers (strategies, memory peaks)."""
    info: dict[str, Any] = {"system": plan.system, "num_devices": len(plan.devices())}
    for t in plan.tasks:
        info[f"strategy/{t.name}"] = f"{t.allocation.strategy} on {len(t.allocation.mesh)} devices"
        if t.name in memory.task_peak_gb:
            info[f"memory_gb/{t.name}"] = round(memory.task_peak_gb[t.name], 2)
    info["generation/batching"] = plan.generation.batching
    info.update({f"notes/{k}": v for k, v in plan.notes.items()})
    return info


def final_weights(trace: StepTrace) -> dict[str, Any] | None:
    """``summary.json``'s ``final_weights``: the digest of each trained model's full weights after
    the run's last iteration (``{"iteration": k, "models": {model: {num_params, sum, l2, update_l2,
    sha256}}}``, :func:`harness.real.digest.weights_digest`), from a backend that reports it
    (``StepTrace.extra[PARAM_DIGEST]``); None from one that holds no weights (``backend=sim``) or
    with ``backend.options.digest=false``. Not averaged: the metrics' ``rl/<model>_param_*`` are
    averages over the measured iterations."""
    digests = trace.extra.get(PARAM_DIGEST)
    if not digests:
        return None
    return {"iteration": trace.iteration, "models": {model: dict(d) for model, d in digests.items()}}


def write_static_files(folder: results.RunFolder, cfg: DictConfig, plan: Plan) -> None:
    """What is known before the first iteration: the resolved config, the plan, its training schedules."""
    folder.path(results.CONFIG_FILE).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    folder.path(results.PLAN_FILE).write_text(plan.to_json())
    for stage in plan.training:
        to_csv(stage.schedule, folder.path(f"schedules/{'+'.join(stage.tasks)}.csv"))


def write_iteration_files(folder: results.RunFolder, rows: list[dict[str, float]], traces: list[StepTrace],
                          devices: set[int] | None) -> None:
    """Per iteration its metrics row and its scheduler record; of the last iteration its samples and
    its Chrome trace (``devices``: those shown, :func:`harness.core.trace.trace_devices`)."""
    with open(folder.path(results.METRICS_FILE), "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    with open(folder.path(results.UNITS_FILE), "w") as f:
        for it, trace in enumerate(traces):
            f.write(json.dumps({"iteration": it, **trace.extra.get(UNITS, {})}) + "\n")
    last = traces[-1]
    results.write_table(folder.path(results.SAMPLES_FILE), [
        {"sample_id": r.sample_id, "prompt_len": r.prompt_len, "response_len": r.response_len,
         "finish_s": r.finish_s,  # generation's weights versions of its first and last token: staleness
         "first_version": last.iteration if r.first_version is None else r.first_version,
         "last_version": last.iteration if r.last_version is None else r.last_version} for r in last.samples])
    write_chrome_trace(traces[-1:], str(folder.path(results.TRACE_FILE)), devices)


def summary_record(summary: dict[str, float], info: dict[str, Any], prov: dict[str, Any],
                   weights: dict[str, Any] | None, run: dict[str, Any]) -> dict[str, Any]:
    """``summary.json``: the averaged metrics, the plan's facts (:func:`plan_info`), the provenance,
    the final weights' digest when the backend reports one (:func:`final_weights`), and what ran."""
    return {"metrics": summary, "info": info, "provenance": prov,
            **({"final_weights": weights} if weights else {}), "run": run}


def format_summary(outcome: RunOutcome, brief: bool = False) -> str:
    """What a run prints when it ends: its folder and a table of its averaged metrics and plan notes
    (a stage that ran at the same time as others, ``overlap_s/*``, is labelled: its time is a span
    of overlapped work); ``brief``: one line, the folder, samples/s and step time."""
    s = outcome.summary
    if brief:
        return (f"run: {outcome.path}  {s.get(mk.SAMPLES_PER_S, float('nan')):.3f} samples/s, "
                f"step {s.get(mk.STEP_TIME, float('nan')):.4g} s")
    lines = [f"run: {outcome.path}",
             f"  {'samples/s':<38}{s.get(mk.SAMPLES_PER_S, float('nan')):>12.3f}",
             f"  {'tokens/s/GPU':<38}{s.get(mk.THROUGHPUT, float('nan')):>12.1f}",
             f"  {'step (s)':<38}{s.get(mk.STEP_TIME, float('nan')):>12.2f}"]
    min_overlap_frac = 0.01  # of the stage's own time: shorter overlaps are not worth a label
    labelled = False
    for key in sorted(k for k in s if k.startswith("timing_s/") and k not in (mk.STEP_TIME,)):
        task = key.removeprefix("timing_s/")
        beside = [other for other in mk.TIMED_TASKS if task in mk.TIMED_TASKS and other != task
                  and s.get(mk.overlap_key(task, other), 0.0) > min_overlap_frac * s[key]]
        labelled = labelled or bool(beside)
        lines.append(f"  {key:<38}{s[key]:>12.3f}" + (f"  span, overlaps {', '.join(beside)}" if beside else ""))
    if labelled:
        lines.append("  (span: first start to last end of a stage that ran while the stages named ran too; "
                     "overlapping times do not add up)")
    for key in sorted(k for k in s if k.startswith("pipeline/bubble_frac/")):
        lines.append(f"  {key:<38}{s[key]:>12.3f}")
    for key in (mk.BUSY_MEAN, mk.MAX_MEMORY_GB, mk.GEN_TAIL_S, mk.MIGRATED_SAMPLES, mk.TAIL_INSTANCES,
                mk.MIGRATION_THRESHOLD_FRAC):
        if key in s:
            lines.append(f"  {key:<38}{s[key]:>12.3f}")
    notes = {k: v for k, v in (outcome.info or {}).items()
             if k.startswith("notes/") and not isinstance(v, dict) and not k.startswith("notes/search/")}
    if notes:
        lines.append("  plan notes:")
        lines += [f"    {k.removeprefix('notes/'):<36}{v!s:>12}" for k, v in notes.items()]
    return "\n".join(lines)
