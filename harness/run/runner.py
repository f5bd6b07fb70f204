"""One benchmark run: config -> plan -> checks -> backend iterations -> metrics -> results and W&B.

The runner never branches on which system runs: it builds the system named by ``system.impl`` and
the backend named by ``backend._target_``, asks the system for a Plan, checks the plan (structure,
device memory, features the backend executes) before anything is written, executes it, and
measures the StepTraces.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from harness.core import metrics as mk
from harness.run import provenance
from harness.run import results
from harness.core.config import RunConfig
from harness.checks.consistency import check_results_dir_writable, check_run
from harness.planning.strategies import check_tensor_parallel
from harness.costmodel import CostModel
from harness.costmodel.profile import load_profile_table
from harness.core.engines import select_engines
from harness.errors import ConfigError
from harness.run.loggers import WandbLogger, resolve_mode
from harness.core.option_effects import check_option_effects
from harness.system import discover_systems
from harness.planning.collector import full_collections_deferred
from harness.planning.memory import check_plan_memory
from harness.core.plan import Plan
from harness.run.progress import planning_progress
from harness.schedule import to_csv
from harness.system import PlanContext, System
from harness.core.trace import PARAM_DIGEST, UNITS, StepTrace, trace_devices, write_chrome_trace
from harness.checks.command_line import check_batch_sizes
from harness.core.workload import make_batch, resolve_workload, validate_workload


@dataclass
class RunOutcome:
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


def build_context(run: RunConfig) -> PlanContext:
    """The planning context of ``run``, after every consistency check (:mod:`harness.checks.consistency`)."""
    validate_workload(run.workload)
    check_run(run)
    max_context = min(getattr(run.model, role).max_seq_len for role in ("actor", "critic", "ref", "reward"))
    # a JSON-lines file: read and checked now
    run.workload = resolve_workload(run.workload, run.model.actor.vocab_size, max_context)
    cluster = run.cluster
    profile = None
    if run.backend.profile_table:
        profile = load_profile_table(run.backend.profile_table)
    resolve_mode(run.logger)  # a bad logger.mode fails here, before any folder exists
    try:
        cost_model = CostModel(cluster, run.workload, profile)
    except ValueError as e:  # cluster.cost_model / calibration / recompute read from the config
        raise ConfigError(str(e)) from None
    engines = select_engines(run.engine, run.system)  # an unknown engine or key fails here
    return PlanContext(models=run.model, cluster=cluster, workload=run.workload,
                       cost_model=cost_model, seed=run.seed, planning_budget_s=run.planning_budget_s,
                       engines=engines)


def plan_info(plan: Plan, memory) -> dict[str, Any]:
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


def _write_static_files(folder: results.RunFolder, cfg: DictConfig, plan: Plan) -> None:
    folder.path(results.CONFIG_FILE).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    folder.path(results.PLAN_FILE).write_text(plan.to_json())
    for stage in plan.training:
        to_csv(stage.schedule, folder.path(f"schedules/{'+'.join(stage.tasks)}.csv"))


def make_plan(system: System, ctx: PlanContext) -> tuple[Plan, float, Any]:
    """The system's plan for ``ctx``, the seconds planning took, and its memory check: a plan that
    breaks the IR or does not fit in device memory raises here, before any backend work."""
    system.check_config()
    start = time.perf_counter()
    with full_collections_deferred():
        plan = system.plan(ctx)
    plan_s = time.perf_counter() - start
    plan.validate(ctx.num_devices)
    check_tensor_parallel(plan, ctx.models)
    return plan, plan_s, check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)


def iteration_rows(run: RunConfig, plan: Plan, backend: Any,
                   iterations: Iterable[int]) -> Iterator[tuple[StepTrace, dict[str, float]]]:
    """Run ``plan`` on ``backend`` (already set up) for each of ``iterations``, each on its batch of
    the workload: the iteration's trace and its metrics row (:func:`harness.core.metrics.iteration_metrics`)."""
    task_models = {t.name: t.model for t in plan.tasks}
    peak_flops = run.cluster.gpu.peak_bf16_tflops * 1e12
    for it in iterations:
        batch = make_batch(run.workload, run.seed, it)
        trace = backend.run_iteration(plan, it, batch)
        yield trace, mk.iteration_metrics(trace, batch.total_num_tokens, task_models, peak_flops)


def execute(cfg: DictConfig, overrides: list[str] | None = None) -> RunOutcome:
    """Run one benchmark; ``overrides`` (the command line's) define the results variant."""
    if OmegaConf.is_missing(cfg, "system"):
        raise ConfigError("no system chosen: add +system=<name> to the command line "
                          f"(available: {', '.join(sorted(discover_systems()))})")
    check_batch_sizes(cfg)
    check_option_effects(cfg, overrides or [])  # options set without effect: refused before any work
    run: RunConfig = OmegaConf.to_object(cfg)
    ctx = build_context(run)
    system: System = get_class(run.system.impl)(run.system)
    get_class(cfg.backend._target_)(run.backend, ctx).check_before_planning()  # e.g. too many workers here
    label = model_label(run.model)

    variant = results.variant_label(overrides or [])
    path = results.run_path(run.results_dir, run.experiment_name, system.name, label, run.seed, variant)
    check_results_dir_writable(run.results_dir)  # before planning, not when the first file is written
    with results.run_lock(path):  # an identical run in progress: wait for it, then find its result
        if results.is_finished(path) and not run.overwrite:
            stored = json.loads((path / results.SUMMARY_FILE).read_text())
            print(f"[harness] skip {path}: already finished (overwrite=true to re-run)")
            return RunOutcome(path, stored["metrics"], skipped=True, info=stored.get("info"))
        return _plan_and_run(cfg, run, ctx, system, label, variant, path)


def _plan_and_run(cfg: DictConfig, run: RunConfig, ctx: PlanContext, system: System, label: str, variant: str,
                  path: Path) -> RunOutcome:
    """Plan, execute and write the run at ``path`` (its lock held by :func:`execute`)."""
    progress = planning_progress(run.logger.progress_bar)
    if progress is not None:
        progress(f"planning {system.name} on {label}, {ctx.num_devices} devices")
    plan, plan_s, memory = make_plan(system, dataclasses.replace(ctx, progress=progress))

    backend = get_class(cfg.backend._target_)(run.backend, ctx)
    backend.check(plan)  # features the backend cannot execute: refused before anything is written
    with results.RunFolder(path, tree=Path(run.results_dir) / run.experiment_name) as folder:
        _write_static_files(folder, cfg, plan)
        run_name = f"{system.name}-{label}-seed{run.seed}" + (f"-{variant}" if variant else "")
        prov = provenance.collect(run, backend)
        logger = WandbLogger(run.logger, folder.staging, run.experiment_name, run_name,
                             {**OmegaConf.to_container(cfg, resolve=True), "provenance": prov})
        rows, traces = [], []
        try:
            backend.setup(plan)
            iterations = range(run.backend.num_iterations)
            if run.logger.progress_bar:
                from tqdm import tqdm
                iterations = tqdm(iterations, desc=f"{system.name} {label}", unit="it", leave=False)
            for it, (trace, row) in enumerate(iteration_rows(run, plan, backend, iterations)):
                row[mk.PLAN_TIME] = plan_s
                logger.log(row, step=it)
                rows.append(row)
                traces.append(trace)
        except BaseException:
            logger.finish(exit_code=1)
            raise
        finally:
            backend.close()
        summary = mk.summarize(rows, run.backend.num_warmup_iterations)
        with open(folder.path(results.METRICS_FILE), "w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        with open(folder.path(results.UNITS_FILE), "w") as f:
            for it, trace in enumerate(traces):
                f.write(json.dumps({"iteration": it, **trace.extra.get(UNITS, {})}) + "\n")
        results.write_table(folder.path(results.SAMPLES_FILE), [
            {"sample_id": r.sample_id, "prompt_len": r.prompt_len, "response_len": r.response_len,
             "finish_s": r.finish_s} for r in traces[-1].samples])
        write_chrome_trace(traces[-1:], str(folder.path(results.TRACE_FILE)),
                           trace_devices(ctx.num_devices, run.cluster.gpus_per_node))
        devices = provenance.devices(run, backend)  # a real backend resolves its devices in setup
        if devices != prov["devices"]:
            prov["devices"] = devices
            logger.update_config({"provenance": prov})
        logger.log_summary(summary)
        logger.finish()
        info = plan_info(plan, memory)
        weights = final_weights(traces[-1])
        results.write_json(folder.path(results.SUMMARY_FILE), {
            "metrics": summary, "info": info, "provenance": prov,
            **({"final_weights": weights} if weights else {}),
            "run": {"experiment": run.experiment_name, "system": system.name, "variant": variant, "model": label,
                    "seed": run.seed,
                    "backend": run.backend.name, "cluster": run.cluster.name, "workload": run.workload.name,
                    "num_devices": ctx.num_devices, "wandb_mode": logger.mode}})
        final = folder.commit()
    return RunOutcome(final, summary, skipped=False, info=info)


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
