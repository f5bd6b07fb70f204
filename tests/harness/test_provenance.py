"""Run provenance: summary.json's ``provenance`` says which code, packages, host, devices
and cost-model files produced the numbers, and collecting it never fails a run.

One in-process sim-backend run on the tiny model checks every field of summary.json's
``provenance``; unit tests of :func:`harness.run.provenance.collect` check a checkout that is not a git
repository (or a machine without git), a roofline run with a profile table, and a real backend's
devices.
"""
from __future__ import annotations

import hashlib
import platform
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from harness.run import provenance
from harness.run.pipeline import compose
from harness.backends.base import Backend
from harness.costmodel.calibrated import FITTED_DIR
from harness.run.pipeline import build_context, execute

TINY = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1",
        "logger=none", "logger.progress_bar=false", "backend.num_iterations=2", "experiment_name=provenance"]
FIELDS = {"git": {"commit", "dirty"}, "host": {"hostname", "platform"},
          "devices": {"simulated", "kind", "names", "count", "dtype"},
          "cost_model": {"kind", "calibration", "calibration_file", "calibration_sha256", "profile_table",
                         "profile_table_sha256"},
          "versions": {"python", "torch", "ray", "deepspeed", "vllm", "hydra-core", "omegaconf", "wandb", "numpy"}}


def _sha12(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _head() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(provenance.HARNESS_DIR), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _run_and_backend(overrides: list[str]):
    cfg = compose(overrides)
    run = OmegaConf.to_object(cfg)
    return run, get_class(cfg.backend._target_)(run.backend, build_context(run))


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    import json

    results_dir = tmp_path_factory.mktemp("provenance") / "results"
    outcome = execute(compose([*TINY, f"results_dir={results_dir}"]), [])
    return json.loads((outcome.path / "summary.json").read_text())


def test_summary_json_has_every_field(summary):
    prov = summary["provenance"]
    assert set(prov) == set(FIELDS) | {"workload_file"}
    assert prov["workload_file"] is None  # a synthetic workload
    for part, keys in FIELDS.items():
        assert set(prov[part]) == keys, part


def test_git_commit_of_this_checkout(summary):
    git = summary["provenance"]["git"]
    head = _head()
    if head is None:
        pytest.skip("the harness is not a git checkout here")
    assert re.fullmatch(r"[0-9a-f]{40}", git["commit"])
    assert git["commit"] == head
    assert isinstance(git["dirty"], bool)


def test_versions_host_and_devices(summary):
    import torch

    prov = summary["provenance"]
    versions = prov["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["python"] == platform.python_version()
    assert versions["omegaconf"] == metadata.version("omegaconf")
    assert all(v is None or isinstance(v, str) for v in versions.values())
    assert prov["host"]["hostname"] == socket.gethostname()
    assert prov["host"]["platform"]
    devices = prov["devices"]
    assert devices == {"simulated": True, "kind": "gpu", "names": ["H100-SXM5-80GB"], "dtype": None,
                       "count": summary["run"]["num_devices"]}
    assert devices["count"] == 8


def test_cost_model_identity(summary):
    cost = summary["provenance"]["cost_model"]
    fitted = FITTED_DIR / "h100.json"
    assert cost == {"kind": "calibrated", "calibration": "h100", "calibration_file": str(fitted),
                    "calibration_sha256": _sha12(fitted), "profile_table": None, "profile_table_sha256": None}


def test_roofline_with_a_profile_table(tmp_path):
    table = tmp_path / "ops.csv"
    table.write_text("op,model,tp,num_tokens,time_s\n")
    run, backend = _run_and_backend([*TINY, "cluster.cost_model=roofline", f"backend.profile_table={table}"])
    cost = provenance.collect(run, backend)["cost_model"]
    assert cost["kind"] == "roofline"
    assert cost["calibration_file"] is None and cost["calibration_sha256"] is None  # not read by roofline
    assert cost["profile_table"] == str(table) and cost["profile_table_sha256"] == _sha12(table)


def test_outside_a_git_checkout(tmp_path, monkeypatch):
    run, backend = _run_and_backend(TINY)
    monkeypatch.setattr(provenance, "HARNESS_DIR", tmp_path)
    assert provenance.collect(run, backend)["git"] == {"commit": None, "dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert provenance.collect(run, backend, repo=Path(__file__).parent)["git"] == {"commit": None, "dirty": None}


def test_missing_packages_are_none_and_heavy_ones_are_not_imported(monkeypatch):
    monkeypatch.setitem(provenance.PACKAGES, "no-such-package", ("no-such-package-xyz",))
    heavy = [m for m in ("vllm", "deepspeed") if m not in sys.modules]
    versions = provenance.versions()
    assert versions["no-such-package"] is None
    assert not [m for m in heavy if m in sys.modules]


def test_real_backend_devices():
    """A real backend's resolved device and dtype (``backend.opts``, as backend=ray sets them in
    setup) and the count of its workers, one per device."""
    run, sim = _run_and_backend(TINY)

    class Real(Backend):
        def run_iteration(self, plan, iteration, batch):
            raise NotImplementedError

    real = Real(run.backend, sim.ctx)
    real.opts = type("Opts", (), {"device": "cpu", "dtype": "fp32"})()
    devices = provenance.devices(run, real)
    assert devices["simulated"] is False and devices["kind"] == "cpu" and devices["dtype"] == "fp32"
    assert devices["count"] == sim.ctx.num_devices == 8
    assert len(devices["names"]) == 1 and devices["names"][0]


def test_workload_file_is_hashed(tmp_path):
    """A JSON-lines workload's file is recorded with its content hash: edit it, the hash changes."""
    from harness.run.provenance import _workload_file

    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_len": 4, "response_len": 3}\n')

    class Run:
        class workload:  # noqa: N801 - stands in for the config group
            pass
    Run.workload.path = str(path)
    first = _workload_file(Run)
    path.write_text('{"prompt_len": 4, "response_len": 5}\n')
    second = _workload_file(Run)
    assert first["path"] == second["path"] == str(path)
    assert len(first["sha256"]) == 12 and first["sha256"] != second["sha256"]
