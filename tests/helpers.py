"""Helpers shared by test modules (fixtures live in tests/conftest.py)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def flat_weights(state: Mapping[str, "torch.Tensor"] | Path | str) -> "torch.Tensor":
    """A state dict's tensors (or those of one saved with ``torch.save`` at a path) as one float64
    vector in name order: two sets of weights of the same model compare as vectors (a distance, a
    norm), whatever their layout was when they were saved."""
    import torch  # heavy; only the tests of real weights need it

    if isinstance(state, (str, Path)):
        state = torch.load(state)
    return torch.cat([state[name].reshape(-1).double() for name in sorted(state)])
