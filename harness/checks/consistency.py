"""Physical and logical consistency of a composed run, checked before any work.

:func:`check_run` is the first thing :func:`harness.run.pipeline.build_context` does, so every input
below ends the run with one line naming the cause and the key to change (a
:class:`~harness.errors.ConfigError`: ``error: ...`` on stderr, exit code 2) before planning starts
and before anything is written:

- **models**: every dimension a positive integer, the hidden size divisible into the heads and the
  heads into the KV heads (:func:`check_models`);
- **context**: the longest prompt plus ``workload.max_gen_len`` within every model's
  ``max_seq_len`` (the four models all read prompt + response); a JSON-lines workload's records are
  checked one by one when the file is read (:func:`harness.core.workload.resolve_workload`);
- **hardware**: every datasheet number finite and positive, every efficiency a fraction in (0, 1]
  (:func:`check_cluster`): ``inf`` TFLOPs, ``nan`` or negative memory, a zero-bandwidth link;
- **run options**: ``seed`` >= 0 (numpy seeds are non-negative), ``planning_budget_s`` finite and
  >= 0, fewer warm-up iterations than iterations (else the summary would average nothing), an
  ``experiment_name`` that stays inside ``results_dir`` with folder names and a path within the file
  system's limits (255 bytes a name);
- **sizes that would take unreasonably long**: at most :data:`MAX_SAMPLES_PER_ITERATION` samples per
  iteration and :data:`MAX_DEVICES` devices; ``allow_large=true`` lifts both, but not the hard limits
  of what a run holds in memory (:data:`HARD_MAX_SAMPLES`, :data:`HARD_MAX_DEVICES`);
- **system options by their names** (docs/DESIGN.md's naming rule: counts ``num_*``, units as
  suffixes): every ``num_*``, ``*_steps`` and ``*_workers`` field a non-negative integer, every
  ``*_s``, ``*_frac`` and ``*_effort`` field finite and >= 0 (None where allowed means "the
  default"); other out-of-range options are the system's own check
  (:meth:`harness.system.System.check_config`), and options set without effect in the chosen
  configuration are refused by one rule over the conditions declared beside each field
  (:mod:`harness.core.option_effects`), not warned about: a run whose printed config says something it
  did not do is not a result.

Failures that can only happen later are checked here too: a ``results_dir`` that is empty, the
current folder, not a folder or cannot be written (:func:`check_results_dir_writable`), an output
file of ``python -m harness.replay`` / ``report`` that cannot be written
(:func:`check_output_file`) and W&B online mode without credentials
(:func:`harness.run.loggers.resolve_mode`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from harness.errors import ConfigError
from harness.core.files import file_kind

MAX_SAMPLES_PER_ITERATION = 65536  # 8x the largest batch in the paper's experiments (8,192 at 4,096 GPUs)
MAX_DEVICES = 16384  # 4x the paper's largest simulated cluster (4,096 GPUs)
# Limits allow_large=true does not lift: a plan lists every device of each task's mesh and a batch
# holds arrays over its samples, all in memory.
HARD_MAX_DEVICES = 2 ** 20  # 1,048,576 devices: 64x MAX_DEVICES
HARD_MAX_SAMPLES = 2 ** 24  # 16,777,216 samples per iteration: 256x MAX_SAMPLES_PER_ITERATION
NAME_MAX_BYTES = 255  # a folder name, where the file system does not say (POSIX NAME_MAX on Linux)
PATH_MAX_BYTES = 4096  # a whole path, where the file system does not say (Linux PATH_MAX)
# Bytes a run's path needs below results_dir/<experiment_name>: <system>[,<variant>] (at most
# harness.run.results.MAX_FOLDER_CHARS), <model>, its staging folder .seed<k>.partial-<host>-<pid>, a file.
RUN_PATH_RESERVE_BYTES = 512
MODEL_DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
              "max_seq_len")
ROLES = ("actor", "critic", "ref", "reward")


def check_run(run: Any) -> None:
    """Every check of the module docstring on a typed :class:`~harness.core.config.RunConfig`."""
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


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    while path.parent != path:
        try:
            if path.exists():
                return path
        except OSError:  # e.g. a name too long to look up
            pass
        path = path.parent
    return path


def _fs_limit(path: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(_nearest_existing(path), name))
    except (OSError, ValueError):
        return default


def _shown(text: str, chars: int = 40) -> str:
    return repr(text if len(text) <= chars else text[:chars] + "...")


def check_experiment_name(name: str, results_dir: str) -> None:
    """``experiment_name`` is a relative path that stays inside ``results_dir``, each of its folder
    names within the file system's limit on a name (255 bytes on Linux file systems) and the run
    folders below it within the limit on a whole path."""
    path = Path(str(name))
    if not str(name).strip() or path.is_absolute() or ".." in path.parts:
        raise ConfigError(f"experiment_name={name!r}: must be a relative name inside results_dir "
                          f"(no absolute path, no '..'); to write elsewhere set results_dir")
    root = Path(results_dir).absolute()
    name_max = _fs_limit(root, "PC_NAME_MAX", NAME_MAX_BYTES)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            raise ConfigError(f"experiment_name: the folder name {_shown(part)} is {size} bytes, over the file "
                              f"system's limit of {name_max} bytes for a name; choose a shorter experiment_name")
    path_max = _fs_limit(root, "PC_PATH_MAX", PATH_MAX_BYTES)
    size = len(os.fsencode(str(root / path))) + RUN_PATH_RESERVE_BYTES
    if size > path_max:
        raise ConfigError(f"experiment_name={_shown(str(name))}: the experiment's folder path is "
                          f"{size - RUN_PATH_RESERVE_BYTES} bytes long (results_dir {_shown(str(root))} and the "
                          f"name), leaving less than the {RUN_PATH_RESERVE_BYTES} bytes a run's folders need below "
                          f"it within the file system's limit of {path_max} bytes for a path; choose a shorter "
                          f"experiment_name or results_dir")
    root = root.resolve()
    if not (root / path).resolve().is_relative_to(root):
        raise ConfigError(f"experiment_name={name!r} resolves outside results_dir={results_dir!r}")


def check_sizes(run: Any) -> None:
    """Sizes that would take hours are refused unless ``allow_large=true``; sizes a run cannot hold
    in memory (:data:`HARD_MAX_DEVICES`, :data:`HARD_MAX_SAMPLES`) are refused regardless."""
    group = run.algo.group_size if getattr(run, "algo", None) is not None else 1
    samples = run.workload.global_batch_size * group  # prompts x responses per prompt
    what = (f"workload.global_batch_size={samples}" if group == 1 else
            f"workload.global_batch_size x algo.group_size = {run.workload.global_batch_size} x {group} = {samples}")
    devices = run.cluster.num_nodes * run.cluster.gpus_per_node
    if devices > HARD_MAX_DEVICES:
        raise ConfigError(f"cluster.num_nodes x cluster.gpus_per_node = {devices} devices is over the hard limit "
                          f"of {HARD_MAX_DEVICES:,} (a plan lists every device in memory; allow_large=true does "
                          f"not lift this limit)")
    if samples > HARD_MAX_SAMPLES:
        raise ConfigError(f"{what} is over the hard limit of {HARD_MAX_SAMPLES:,} "
                          f"samples per iteration (a batch holds arrays over its samples in memory; "
                          f"allow_large=true does not lift this limit)")
    if getattr(run, "allow_large", False):
        return
    if run.workload.path is None and samples > MAX_SAMPLES_PER_ITERATION:
        raise ConfigError(f"{what} is over the limit of {MAX_SAMPLES_PER_ITERATION} "
                          f"samples per iteration (planning and simulation grow with it: hours); "
                          f"set allow_large=true to run it anyway")
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
    """``results_dir`` names a folder other than the current one, and the results tree can be
    written: a file can be created, then removed, in ``results_dir`` or, where it does not exist
    yet, in its nearest existing parent (which the run would create it in). Leaves nothing behind;
    checked before planning, not after."""
    if results_dir is None or not str(results_dir).strip():
        raise ConfigError("results_dir is empty: name a folder for the results (e.g. results_dir=results)")
    if Path(results_dir).resolve() == Path.cwd().resolve():
        raise ConfigError(f"results_dir={results_dir!r} is the current folder ({Path.cwd()}): runs would be "
                          f"written among its files; name a folder for the results (e.g. results_dir=results)")
    target = Path(results_dir).absolute()
    probe = _nearest_existing(target)
    if not probe.is_dir():
        what = f"is {file_kind(probe)}" if probe == target else f"cannot be written: {probe} is {file_kind(probe)}"
        raise ConfigError(f"results_dir={results_dir!r} {what}, not a folder; choose another results_dir")
    cause = _cannot_create_in(probe)
    if cause:
        raise ConfigError(f"results_dir={results_dir!r} cannot be written: no file can be created in {probe} "
                          f"({cause}); choose another results_dir")


def check_output_file(path: str | os.PathLike, option: str) -> None:
    """A command's output file ``path`` (given as ``option``) can be written, checked before the
    command's work: it is not a directory, and a file can be created in its folder or, where that
    does not exist yet, in its nearest existing parent (which the command creates it in); an
    existing special file (``/dev/null``) only needs to be writable. Leaves nothing behind."""
    target = Path(path).absolute()
    if target.exists() and not target.is_file():
        if target.is_dir():
            raise ConfigError(f"{option} {path}: is a directory; name a file")
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{option} {path}: {file_kind(target)} that cannot be written")
        return
    probe = _nearest_existing(target.parent)
    if not probe.is_dir():
        raise ConfigError(f"{option} {path}: cannot be created: {probe} is {file_kind(probe)}, not a directory")
    if target.is_file() and not os.access(target, os.W_OK):
        raise ConfigError(f"{option} {path}: cannot be written (the file is read-only)")
    cause = _cannot_create_in(probe)
    if cause:
        raise ConfigError(f"{option} {path}: cannot be written: no file can be created in {probe} ({cause})")


def _cannot_create_in(folder: Path) -> str | None:
    """Why no file can be created in ``folder`` (tried, and removed), or None if one can."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".harness-write-check-"):
            return None
    except OSError as e:
        return str(e.strerror or e)
