"""Shared data of the cost-model tests: real LLaMA dimensions and the cluster YAMLs.

(A uniquely named module rather than conftest, so test files can import it unambiguously.)
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from harness.core.config import ClusterConfig, WorkloadConfig
from harness.costmodel import ModelDims

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
CLUSTER_NAMES = ("rlhfuse_testbed", "h100_8x", "a100_8x")

# LLaMA-1 (Touvron et al. 2023, Table 2; ffn sizes from the released checkpoints' configs)
# and Llama-2-70B (grouped-query attention with 8 KV heads).
LLAMA = {
    "7b": ModelDims("7b", 32, 4096, 32, 32, 11008),
    "13b": ModelDims("13b", 40, 5120, 40, 40, 13824),
    "33b": ModelDims("33b", 60, 6656, 52, 52, 17920),
    "65b": ModelDims("65b", 80, 8192, 64, 64, 22016),
    "70b": ModelDims("70b", 80, 8192, 64, 8, 28672),
}


def load_cluster(name: str):
    """A cluster YAML merged onto the typed schema, as Hydra would (defaults key dropped)."""
    raw = OmegaConf.load(CONF_DIR / "cluster" / f"{name}.yaml")
    raw.pop("defaults")
    return OmegaConf.merge(OmegaConf.structured(ClusterConfig), raw)


def workload(recompute: str = "selective"):
    return OmegaConf.structured(WorkloadConfig(name="test", activation_recompute=recompute))
