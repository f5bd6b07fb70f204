"""Tiny models for the real-execution tests (conf/llama/tiny.yaml, tiny2.yaml; random init)."""
from __future__ import annotations

import pytest
import torch

from harness.real.model import LlamaModel, load_llama_config


@pytest.fixture(scope="session")
def tiny_model() -> LlamaModel:
    return LlamaModel.from_config(load_llama_config("tiny"), seed=1).eval()


@pytest.fixture(scope="session")
def tiny2_model() -> LlamaModel:
    return LlamaModel.from_config(load_llama_config("tiny2"), seed=2).eval()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models run fastest on one thread; with more, OpenMP workers spin against other
    processes on a shared CPU and the suite slows down by an order of magnitude."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
