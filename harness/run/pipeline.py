"""The run pipeline: compose -> prepare (checks) -> plan (checks) -> iterate on a backend -> record.

Every tool that turns overrides into numbers goes through these steps, in this order, with the same
checks: ``python -m harness`` (:func:`execute`), the replay of published runs, the experiment
runners (:func:`run_experiment`), :mod:`harness.testing`, the benchmarks and the scripts under
``data/``. The runner never branches on which system runs: it builds the system named by
``system.impl`` and the backend named by ``backend._target_``.

- :func:`compose`: the config ``python -m harness <overrides>`` runs with.
- :func:`prepare` -> :class:`PreparedRun`: every check of the input that needs no plan, in this
  order: a system is chosen, batch sizes, options set without effect, the consistency checks of
  :func:`build_context`, then the backend's own (:meth:`~harness.backends.base.Backend.check_before_planning`).
- :func:`plan` -> :class:`PlannedRun`: the system's plan and the seconds it took, after the checks
  of :func:`make_plan` (the system's options, the plan IR, tensor parallelism, device memory).
- :func:`iterations` / :func:`simulate`: each iteration's StepTrace and metrics row, on a backend
  already set up, or on the simulator.
- :func:`execute`: all of it for one benchmark run, recorded in its results folder
  (:mod:`harness.run.runner` writes the files) and W&B.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from hydra.utils import get_class, get_method
from omegaconf import DictConfig, OmegaConf

from harness.backends import register_backend_configs
from harness.backends.base import Backend
from harness.backends.sim import SimBackend
from harness.backends.sim.config import SimBackendConfig
from harness.checks.command_line import check_batch_sizes
from harness.checks.consistency import check_results_dir_writable, check_run
from harness.core import metrics as mk
from harness.core.algorithm import sample_workload
from harness.core.config import RunConfig, register_configs
from harness.core.engines import engine_group_overrides, select_engines
from harness.core.option_effects import check_option_effects
from harness.core.plan import Plan
from harness.core.trace import StepTrace, trace_devices
from harness.core.workload import draw_batch, resolve_workload, validate_workload
from harness.costmodel import CostModel
from harness.costmodel.profile import load_profile_table
from harness.errors import ConfigError
from harness.planning.collector import full_collections_deferred
from harness.planning.memory import MemoryReport, check_plan_memory
from harness.planning.packing import check_plan_packing
from harness.planning.strategies import check_expert_parallel, check_tensor_parallel
from harness.run import provenance, results, runner
from harness.run.loggers import WandbLogger, resolve_mode
from harness.run.progress import planning_progress
from harness.system import PlanContext, System, discover_systems

IterationRow = tuple[StepTrace, dict[str, float]]  # one iteration's trace and its metrics row


def compose(overrides: Sequence[str]) -> DictConfig:
    """The config ``python -m harness <overrides>`` would run with (schemas registered, systems
    discovered)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    register_backend_configs()
    discover_systems()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=engine_group_overrides(overrides))


def build_context(run: RunConfig) -> PlanContext:
    """The planning context of ``run``, after every consistency check (:mod:`harness.checks.consistency`)."""
    validate_workload(run.workload, run.algo.group_size)
    check_run(run)
    max_context = min(getattr(run.model, role).max_seq_len for role in ("actor", "critic", "ref", "reward"))
    # a JSON-lines file: read and checked now
    run.workload = resolve_workload(run.workload, run.model.actor.vocab_size, max_context)
    workload = sample_workload(run.workload, run.algo)  # what an iteration puts through: samples
    cluster = run.cluster
    profile = None
    if run.backend.profile_table:
        profile = load_profile_table(run.backend.profile_table)
    resolve_mode(run.logger)  # a bad logger.mode fails here, before any folder exists
    try:
        cost_model = CostModel(cluster, workload, profile)
    except ValueError as e:  # cluster.cost_model / calibration / recompute read from the config
        raise ConfigError(str(e)) from None
    engines = select_engines(run.engine, run.system)  # an unknown engine or key fails here
    return PlanContext(models=run.model, cluster=cluster, workload=workload,
                       cost_model=cost_model, seed=run.seed, planning_budget_s=run.planning_budget_s,
                       engines=engines, algorithm=run.algo)


@dataclass(frozen=True)
class PreparedRun:
    """A composed config that passed every check before planning, with what planning needs."""

    cfg: DictConfig
    run: RunConfig
    ctx: PlanContext
    system: System
    backend_class: type[Backend]  # the class ``backend._target_`` names

    def new_backend(self) -> Backend:
        """A backend of the configured kind for this run (not set up)."""
        return self.backend_class(self.run.backend, self.ctx)


def prepare(cfg: DictConfig, overrides: Sequence[str] = ()) -> PreparedRun:
    """Check ``cfg`` before any planning (ConfigError or OverrideError naming the cause):
    ``overrides`` are the command line's, which the rule on options without effect reads."""
    if OmegaConf.is_missing(cfg, "system"):
        raise ConfigError("no system chosen: add +system=<name> to the command line "
                          f"(available: {', '.join(sorted(discover_systems()))})")
    check_batch_sizes(cfg)
    check_option_effects(cfg, list(overrides))  # options set without effect: refused before any work
    run: RunConfig = OmegaConf.to_object(cfg)
    ctx = build_context(run)
    system: System = get_class(run.system.impl)(run.system)
    backend_class = get_class(cfg.backend._target_)
    backend_class(run.backend, ctx).check_before_planning()  # e.g. too many workers here
    return PreparedRun(cfg, run, ctx, system, backend_class)


def make_plan(system: System, ctx: PlanContext) -> tuple[Plan, float, MemoryReport]:
    """The system's plan for ``ctx``, the seconds planning took, and its memory check: a plan that
    breaks the IR or does not fit in device memory raises here, before any backend work."""
    system.check_config()
    start = time.perf_counter()
    with full_collections_deferred():
        new_plan = system.plan(ctx)
    plan_s = time.perf_counter() - start
    new_plan.validate(ctx.num_devices)
    check_tensor_parallel(new_plan, ctx.models)
    check_expert_parallel(new_plan, ctx.models)
    check_plan_packing(new_plan, ctx.workload.micro_batch_tokens)
    return new_plan, plan_s, check_plan_memory(new_plan, ctx.cost_model, ctx.models, ctx.workload)


@dataclass(frozen=True)
class PlannedRun:
    """A prepared run and its checked plan."""

    prepared: PreparedRun
    plan: Plan
    plan_s: float  # wall-clock seconds the system took to plan
    memory: MemoryReport


def plan(prepared: PreparedRun, progress: Callable[[str], None] | None = None) -> PlannedRun:
    """Plan ``prepared`` with its system (:func:`make_plan`: every plan check); ``progress`` hears
    the planning phases (:mod:`harness.run.progress`)."""
    new_plan, plan_s, memory = make_plan(prepared.system, dataclasses.replace(prepared.ctx, progress=progress))
    return PlannedRun(prepared, new_plan, plan_s, memory)


def iteration_row(ctx: PlanContext, plan: Plan, backend: Backend, iteration: int) -> IterationRow:
    """Iteration ``iteration`` of ``plan`` on ``backend`` (already set up), on its batch of the
    workload: the trace and its metrics row (:func:`harness.core.metrics.iteration_metrics`)."""
    batch = draw_batch(ctx.workload, ctx.seed, iteration, ctx.algorithm)
    trace = backend.run_iteration(plan, iteration, batch)
    return trace, mk.iteration_metrics(trace, batch.total_num_tokens, {t.name: t.model for t in plan.tasks},
                                       ctx.cluster.gpu.peak_bf16_tflops * 1e12)


def iterations(planned: PlannedRun, backend: Backend, indices: Iterable[int]) -> Iterator[IterationRow]:
    """Each of ``indices`` as an iteration of the planned run on ``backend`` (checked and set up by
    the caller, who also closes it)."""
    for it in indices:
        yield iteration_row(planned.prepared.ctx, planned.plan, backend, it)


def simulator(ctx: PlanContext) -> SimBackend:
    """``backend=sim`` on ``ctx``, whatever backend the run is configured with."""
    return SimBackend(SimBackendConfig(), ctx)


def simulate(planned: PlannedRun, num_iterations: int | None = None) -> list[IterationRow]:
    """The first ``num_iterations`` (default: ``backend.num_iterations``) iterations of the planned
    run on the simulator."""
    count = planned.prepared.run.backend.num_iterations if num_iterations is None else num_iterations
    backend = simulator(planned.prepared.ctx)
    backend.check(planned.plan)
    backend.setup(planned.plan)
    try:
        return list(iterations(planned, backend, range(count)))
    finally:
        backend.close()


def simulate_summary(cfg: DictConfig) -> dict[str, float]:
    """Plan and simulate ``cfg`` as ``python -m harness`` would (every check; no option-effect rule,
    there being no command line), without writing anything: the summary metrics averaged after the
    warm-up iterations."""
    planned = plan(prepare(cfg))
    rows = [row for _, row in simulate(planned)]
    return mk.summarize(rows, planned.prepared.run.backend.num_warmup_iterations)


# ---- one benchmark run, recorded ------------------------------------------------------------------

def execute(cfg: DictConfig, overrides: Sequence[str] | None = None) -> runner.RunOutcome:
    """Run one benchmark; ``overrides`` (the command line's) define the results variant. A finished
    run of the same variant is not run again (unless ``overwrite=true``)."""
    overrides = list(overrides or [])
    prepared = prepare(cfg, overrides)
    run = prepared.run
    label = runner.model_label(run.model)
    variant = results.variant_label(overrides)
    path = results.run_path(run.results_dir, run.experiment_name, prepared.system.name, label, run.seed, variant)
    check_results_dir_writable(run.results_dir)  # before planning, not when the first file is written
    with results.run_lock(path):  # an identical run in progress: wait for it, then find its result
        if results.is_finished(path) and not run.overwrite:
            stored = json.loads((path / results.SUMMARY_FILE).read_text())
            print(f"[harness] skip {path}: already finished (overwrite=true to re-run)")
            return runner.RunOutcome(path, stored["metrics"], skipped=True, info=stored.get("info"))
        return _plan_and_record(prepared, label, variant, path)


def _plan_and_record(prepared: PreparedRun, label: str, variant: str, path: Path) -> runner.RunOutcome:
    """Plan, execute and write the run at ``path`` (its lock held by :func:`execute`)."""
    cfg, run, ctx, system = prepared.cfg, prepared.run, prepared.ctx, prepared.system
    progress = planning_progress(run.logger.progress_bar)
    if progress is not None:
        progress(f"planning {system.name} on {label}, {ctx.num_devices} devices")
    planned = plan(prepared, progress)

    backend = prepared.new_backend()
    backend.check(planned.plan)  # features the backend cannot execute: refused before anything is written
    with results.RunFolder(path, tree=Path(run.results_dir) / run.experiment_name) as folder:
        runner.write_static_files(folder, cfg, planned.plan)
        run_name = f"{system.name}-{label}-seed{run.seed}" + (f"-{variant}" if variant else "")
        prov = provenance.collect(run, backend)
        logger = WandbLogger(run.logger, folder.staging, run.experiment_name, run_name,
                             {**OmegaConf.to_container(cfg, resolve=True), "provenance": prov})
        rows, traces = [], []
        try:
            backend.setup(planned.plan)
            indices: Iterable[int] = range(run.backend.num_iterations)
            if run.logger.progress_bar:
                from tqdm import tqdm

                indices = tqdm(indices, desc=f"{system.name} {label}", unit="it", leave=False)
            for it, (trace, row) in enumerate(iterations(planned, backend, indices)):
                row[mk.PLAN_TIME] = planned.plan_s
                logger.log(row, step=it)
                rows.append(row)
                traces.append(trace)
        except BaseException:
            logger.finish(exit_code=1)
            raise
        finally:
            backend.close()
        summary = mk.summarize(rows, run.backend.num_warmup_iterations)
        runner.write_iteration_files(folder, rows, traces, trace_devices(ctx.num_devices, run.cluster.gpus_per_node))
        devices = provenance.devices(run, backend)  # a real backend resolves its devices in setup
        if devices != prov["devices"]:
            prov["devices"] = devices
            logger.update_config({"provenance": prov})
        logger.log_summary(summary)
        logger.finish()
        info = runner.plan_info(planned.plan, planned.memory)
        results.write_json(folder.path(results.SUMMARY_FILE), runner.summary_record(
            summary, info, prov, runner.final_weights(traces[-1]),
            {"experiment": run.experiment_name, "system": system.name, "variant": variant, "model": label,
             "seed": run.seed, "backend": run.backend.name, "cluster": run.cluster.name,
             "workload": run.workload.name, "num_devices": ctx.num_devices, "wandb_mode": logger.mode}))
        final = folder.commit()
    return runner.RunOutcome(final, summary, skipped=False, info=info)


# ---- experiments that are not benchmark runs ------------------------------------------------------

@dataclass(frozen=True)
class ExperimentTools:
    """What the harness hands an experiment runner (``experiment_runner`` of ``conf/experiment/``):
    the experiment's results folder, the planning context of a command line, a table writer."""

    folder: Path  # <results_dir>/<experiment_name>

    def context(self, overrides: Sequence[str]) -> PlanContext:
        """The planning context ``python -m harness <overrides>`` would plan with (every check of
        :func:`prepare`)."""
        return prepare(compose(overrides), overrides).ctx

    def write_table(self, name: str, rows: list[dict[str, Any]]) -> Path:
        """``rows`` as the CSV file ``name`` of the experiment's folder (written atomically)."""
        path = self.folder / name
        results.write_table(path, rows)
        return path


def run_experiment(cfg: DictConfig) -> Path:
    """Call ``cfg.experiment_runner`` (``module.function(cfg, tools)``, :class:`ExperimentTools`):
    what it wrote."""
    tools = ExperimentTools(Path(cfg.results_dir) / cfg.experiment_name)
    return get_method(cfg.experiment_runner)(cfg, tools)
