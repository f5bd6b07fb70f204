"""backend=ray on a CUDA GPU: the path CPU runs cannot take (``torch.cuda.set_device`` before
anything touches CUDA, NCCL with the device bound, bf16 by default, the CUDA allocator's peak as the
worker's memory). Marked ``gpu``: skipped where ``torch.cuda.is_available()`` is False.

The other tests that name CUDA run without a GPU: they replace ``torch.cuda`` and
``torch.distributed`` with recording fakes (test_ray_worker_setup.py, test_ray_options.py) or check
what a CUDA run would be refused for (test_ray_options.py, test_ray_precision.py).
"""
from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ray")

pytestmark = [pytest.mark.gpu, pytest.mark.ray,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() "
                                 "is False on this machine)")]

# one device: every task of RLHFuse-Base's plan on the one GPU
ARGS = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "backend=ray", "backend.options.device=cuda",
        "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=1", "backend.num_iterations=2",
        "logger=none", "logger.progress_bar=false"]


def test_one_gpu_runs_ppo_iterations_in_bf16_with_nccl(run_harness, tmp_path):
    proc = run_harness(ARGS, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 workers (cuda, nccl, bf16)" in proc.stdout, proc.stdout[-2000:]
    assert "workers shut down cleanly" in proc.stdout
    [summary] = tmp_path.glob("results/default/*/tiny/seed*/summary.json")
    metrics = json.loads(summary.read_text())["metrics"]
    for key in ("rl/reward_mean", "rl/policy_loss", "rl/value_loss", "rl/actor_update_l2"):
        assert math.isfinite(metrics[key]), key
    assert metrics["rl/actor_update_l2"] > 0  # training moved the weights
    rows = [json.loads(line) for line in (summary.parent / "metrics.jsonl").read_text().splitlines()]
    assert all(row["perf/peak_allocated_gb/dev0"] > 0 for row in rows)  # the CUDA allocator's peak
