"""Typed config of ``backend=sim`` (``conf/backend/sim.yaml`` extends it)."""
from __future__ import annotations

from dataclasses import dataclass

from harness.core.config import BackendConfig


@dataclass
class SimBackendConfig(BackendConfig):
    name: str = "sim"
    _target_: str = "harness.backends.sim.SimBackend"
    num_iterations: int = 5
