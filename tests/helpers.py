"""Helpers shared by test modules (fixtures live in tests/conftest.py)."""
from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def flat_weights(state: Mapping[str, "torch.Tensor"] | Path | str) -> "torch.Tensor":
    """A state dict's tensors (or those of one saved with ``torch.save`` at a path) as one float64
    vector in name order: two sets of weights of the same model compare as vectors (a distance, a
    norm), whatever their layout was when they were saved."""
    import torch  # heavy; only the tests of real weights need it

    if isinstance(state, (str, Path)):
        state = torch.load(state)
    return torch.cat([state[name].reshape(-1).double() for name in sorted(state)])


def algo(name: str, *overrides: str):
    """The :class:`~harness.core.algorithm.AlgorithmConfig` of ``algo=<name>`` (conf/algo/) with
    ``overrides`` (``algo.group_size=2``), as a run composes it."""
    from harness.testing import run_config

    return run_config(["+system=rlhfuse_base", f"algo={name}", *overrides]).algo


def readme_command(system: str) -> list[str]:
    """The README's CPU command for ``system`` (``model=tiny workload=tiny backend=ray`` on 4 devices),
    as ``python -m harness`` arguments."""
    pattern = re.compile(rf"^python -m harness \+system={system} model=tiny workload=tiny backend=ray "
                         rf"cluster=h100_8x cluster\.num_nodes=1 cluster\.gpus_per_node=4( [^#\n]*)?$", re.M)
    found = [m.group(0).strip() for m in pattern.finditer(README.read_text())]
    assert len(found) == 1, (system, found)
    return shlex.split(found[0])[3:]


def run_folder(cwd: Path) -> Path:
    """The one run folder a ``python -m harness`` run of ``model=tiny`` started in ``cwd`` wrote
    (``results/default/<variant>/tiny/seed<k>``)."""
    [summary] = Path(cwd).glob("results/default/*/tiny/seed*/summary.json")
    return summary.parent
