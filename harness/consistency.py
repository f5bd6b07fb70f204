"""Physical and logical consistency of a composed run, checked before any work (issue 28, item 3).

:func:`check_run` is the first thing :func:`harness.runner.build_context` does, so every input
below ends the run with one line naming the cause and the key to change (a
:class:`~harness.errors.ConfigError`: ``error: ...`` on stderr, exit code 2) before planning starts
and before anything is written:

- **models**: every dimension a positive integer, the hidden size divisible into the heads and the
  heads into the KV heads (:func:`check_models`);
- **context**: the longest prompt plus ``workload.max_gen_len`` within every model's
  ``max_seq_len`` (the four models all read prompt + response); a JSON-lines workload's records are
  checked one by one when the file is read (:func:`harness.workload.resolve_workload`);
- **hardware**: every datasheet number finite and positive, every efficiency a fraction in (0, 1]
  (:func:`check_cluster`): ``inf`` TFLOPs, ``nan`` or negative memory, a zero-bandwidth link;
- **run options**: ``seed`` >= 0 (numpy seeds are non-negative), ``planning_budget_s`` finite and
  >= 0, fewer warm-up iterations than iterations (else the summary would average nothing), an
  ``experiment_name`` that stays inside ``results_dir``;
- **sizes that would take unreasonably long**: at most :data:`MAX_SAMPLES_PER_ITERATION` samples per
  iteration and :data:`MAX_DEVICES` devices; ``allow_large=true`` lifts both;
- **system options by their names** (docs/DESIGN.md's naming rule: counts ``num_*``, units as
  suffixes): every ``num_*``, ``*_steps`` and ``*_workers`` field a non-negative integer, every
  ``*_s``, ``*_frac`` and ``*_effort`` field finite and >= 0 (None where allowed means "the
  default"); options that are out of range or have no effect in the chosen configuration are the
  system's own check (:meth:`harness.system.System.check_config`), which refuses them rather than
  warn: a run whose printed config says something it did not do is not a result.

Failures that can only happen later are checked here too: a ``results_dir`` that cannot be written
(:func:`check_results_dir_writable`) and W&B online mode without credentials
(:func:`harness.loggers.resolve_mode`).
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any, Iterator

from harness.errors import ConfigError

MAX_SAMPLES_PER_ITERATION = 65536  # 8x the largest batch in the paper's experiments (8,192 at 4,096 GPUs)
MAX_DEVICES = 16384  # 4x the paper's largest simulated cluster (4,096 GPUs)
MODEL_DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
              "max_seq_len")
ROLES = ("actor", "critic", "ref", "reward")


def check_run(run: Any) -> None:
    """Every check of the module docstring on a typed :class:`~harness.config.RunConfig`."""
    check_models(run.model)
    check_cluster(run.cluster)
    check_context(run.model, run.workload)
    check_run_options(run)
    check_sizes(run)
    check_option_ranges(run.system, "system")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_models(models: Any) -> None:
    for role in ROLES:
        m = getattr(models, role)
        for key in MODEL_DIMS:
            value = getattr(m, key)
            if not _positive_int(value):
                raise ConfigError(f"model.{role}.{key}={value} ({m.name}): must be a positive integer")
        if m.hidden_size % m.num_heads:
            raise ConfigError(f"model.{role}.hidden_size={m.hidden_size} ({m.name}) does not divide into "
                              f"num_heads={m.num_heads} heads")
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.{role}.num_heads={m.num_heads} ({m.name}) is not a multiple of "
                              f"num_kv_heads={m.num_kv_heads} (grouped-query attention shares each KV head "
                              f"among a whole number of query heads)")


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _fraction(value: Any) -> bool:
    return _finite_positive(value) and value <= 1.0


def check_cluster(cluster: Any) -> None:
    gpu = cluster.gpu
    for key in ("peak_bf16_tflops", "hbm_gb", "hbm_bandwidth_gbps"):
        value = getattr(gpu, key)
        if not _finite_positive(value):
            raise ConfigError(f"cluster.gpu.{key}={value} ({gpu.name}): must be a finite positive number")
    for key in ("matmul_efficiency_frac", "memory_efficiency_frac", "usable_memory_frac"):
        value = getattr(gpu, key)
        if not _fraction(value):
            raise ConfigError(f"cluster.gpu.{key}={value} ({gpu.name}): must be a fraction in (0, 1]")
    for link in ("intra_node", "inter_node", "host_to_device"):
        cfg = getattr(cluster, link)
        if not _finite_positive(cfg.bandwidth_gbps):
            raise ConfigError(f"cluster.{link}.bandwidth_gbps={cfg.bandwidth_gbps}: must be a finite positive "
                              f"number of GB/s")
        if not (isinstance(cfg.latency_us, (int, float)) and math.isfinite(cfg.latency_us) and cfg.latency_us >= 0):
            raise ConfigError(f"cluster.{link}.latency_us={cfg.latency_us}: must be a finite number >= 0")
        if not _fraction(cfg.efficiency_frac):
            raise ConfigError(f"cluster.{link}.efficiency_frac={cfg.efficiency_frac}: must be a fraction in (0, 1]")
    if not _finite_positive(cluster.host_memory_gb):
        raise ConfigError(f"cluster.host_memory_gb={cluster.host_memory_gb}: must be a finite positive number")
    for key in ("num_nodes", "gpus_per_node"):
        if not _positive_int(getattr(cluster, key)):
            raise ConfigError(f"cluster.{key}={getattr(cluster, key)}: must be a positive integer")


def check_context(models: Any, workload: Any) -> None:
    """The longest prompt plus the generation limit fit every model's context (synthetic workloads;
    a file's records are checked as it is read)."""
    if workload.path is not None:
        return
    longest = int(workload.prompt_len.max) + int(workload.max_gen_len)
    for role in ROLES:
        m = getattr(models, role)
        if longest > m.max_seq_len:
            raise ConfigError(
                f"workload.prompt_len.max={workload.prompt_len.max} + workload.max_gen_len={workload.max_gen_len} "
                f"= {longest} tokens exceeds the {role} model's context, model.{role}.max_seq_len="
                f"{m.max_seq_len} ({m.name}); lower one of them")


def check_run_options(run: Any) -> None:
    if not isinstance(run.seed, int) or run.seed < 0:
        raise ConfigError(f"seed={run.seed}: must be an integer >= 0")
    budget = run.planning_budget_s
    if budget is not None and not (math.isfinite(budget) and budget >= 0):
        raise ConfigError(f"planning_budget_s={budget}: must be a finite number of seconds >= 0 "
                          f"(or null for each system's default)")
    b = run.backend
    if b.num_iterations < 1 or b.num_warmup_iterations < 0:
        raise ConfigError(f"backend.num_iterations={b.num_iterations} must be >= 1 and "
                          f"backend.num_warmup_iterations={b.num_warmup_iterations} >= 0")
    if b.num_warmup_iterations >= b.num_iterations:
        raise ConfigError(f"backend.num_warmup_iterations={b.num_warmup_iterations} leaves no measured iteration "
                          f"of backend.num_iterations={b.num_iterations}; use fewer warm-up iterations or more "
                          f"iterations")
    check_experiment_name(run.experiment_name, run.results_dir)


def check_experiment_name(name: str, results_dir: str) -> None:
    """``experiment_name`` is a relative path that stays inside ``results_dir``."""
    path = Path(str(name))
    if not str(name).strip() or path.is_absolute() or ".." in path.parts:
        raise ConfigError(f"experiment_name={name!r}: must be a relative name inside results_dir "
                          f"(no absolute path, no '..'); to write elsewhere set results_dir")
    root = Path(results_dir).resolve()
    if not (root / path).resolve().is_relative_to(root):
        raise ConfigError(f"experiment_name={name!r} resolves outside results_dir={results_dir!r}")


def check_sizes(run: Any) -> None:
    if getattr(run, "allow_large", False):
        return
    samples = run.workload.global_batch_size
    if run.workload.path is None and samples > MAX_SAMPLES_PER_ITERATION:
        raise ConfigError(f"workload.global_batch_size={samples} is over the limit of {MAX_SAMPLES_PER_ITERATION} "
                          f"samples per iteration (planning and simulation grow with it: hours); "
                          f"set allow_large=true to run it anyway")
    devices = run.cluster.num_nodes * run.cluster.gpus_per_node
    if devices > MAX_DEVICES:
        raise ConfigError(f"cluster.num_nodes x cluster.gpus_per_node = {devices} devices is over the limit of "
                          f"{MAX_DEVICES}; set allow_large=true to run it anyway")


# ---- option ranges by name -----------------------------------------------------------------------
COUNT_SUFFIXES = ("_steps", "_workers")
AMOUNT_SUFFIXES = ("_s", "_frac", "_effort")


def _fields(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _fields(value, key)
        else:
            yield key, value


def check_option_ranges(obj: Any, prefix: str) -> None:
    """Counts (``num_*``, ``*_steps``, ``*_workers``) non-negative integers; amounts (``*_s``,
    ``*_frac``, ``*_effort``) finite and >= 0; None passes (a default)."""
    if not dataclasses.is_dataclass(obj):
        return
    for key, value in _fields(obj, prefix):
        name = key.rsplit(".", 1)[-1]
        if value is None or isinstance(value, bool):
            continue
        if name.startswith("num_") or name.endswith(COUNT_SUFFIXES):
            if isinstance(value, int) and value < 0:
                raise ConfigError(f"{key}={value}: a count, must be >= 0")
        elif name.endswith(AMOUNT_SUFFIXES) and isinstance(value, (int, float)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{key}={value}: must be a finite number >= 0")


def check_results_dir_writable(results_dir: str) -> None:
    """The results tree can be written: a file can be created, then removed, in ``results_dir`` or,
    where it does not exist yet, in its nearest existing parent (which the run would create it in).
    Leaves nothing behind; checked before planning, not after."""
    probe = Path(results_dir).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(str(probe))
        with tempfile.TemporaryFile(dir=probe, prefix=".harness-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"results_dir={results_dir!r} cannot be written ({probe}: {e.strerror or e}); choose "
                          f"another results_dir") from None


def check_tensor_parallel(plan: Any, models: Any) -> None:
    """Every task's tensor-parallel degree shards its model's heads
    (:func:`harness.planning.strategies.tp_splits_heads`); searched layouts only offer such degrees,
    so this catches pinned layouts and a system's fixed choices (PlanError naming the task)."""
    from harness.errors import PlanError
    from harness.planning.strategies import tp_splits_heads

    for task in plan.tasks:
        tp = task.allocation.strategy.tp
        model = getattr(models, task.model.value)
        if not tp_splits_heads(tp, [model]):
            raise PlanError(f"task {task.name} runs {model.name} ({model.num_heads} heads, {model.num_kv_heads} KV "
                            f"heads) at tp={tp}, which does not shard its heads; pin a layout whose tp divides "
                            f"the heads, or use nodes of GPUs that it divides (cluster.gpus_per_node)")
