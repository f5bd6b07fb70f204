"""backend=ray builds dense LLaMA modules only: a mixture-of-experts model is refused before any
work starts, with one ConfigError naming the field (harness/real/model.py's check_architecture)."""
import pytest

from harness.errors import ConfigError
from harness.real.model import check_architecture, check_models_architecture, load_llama_config
from harness.run import pipeline
from harness.testing import run_config


def test_moe_models_are_refused_by_the_llama_builder():
    with pytest.raises(ConfigError, match=r"model qwen3_30b_a3b: backend=ray builds LLaMA modules only .* cannot "
                                          r"run num_experts=128; use backend=sim"):
        check_architecture(load_llama_config("qwen3_30b_a3b"))
    run = run_config(["+system=rlhfuse_base", "model=qwen3_235b_a22b"])
    with pytest.raises(ConfigError, match=r"model\.actor\.num_experts=128"):
        check_models_architecture(run.model)
    check_architecture(load_llama_config("qwen3_32b"))  # dense Qwen3: built


def test_backend_ray_refuses_a_moe_model_before_planning():
    """The refusal comes from the backend's construction in ``prepare``, before a system plans or a
    worker starts (the CLI prints it as one line, exit code 2)."""
    cfg = pipeline.compose(["+system=rlhfuse_base", "model=qwen3_30b_a3b", "backend=ray", "logger=none"])
    with pytest.raises(ConfigError, match=r"model\.actor\.num_experts=128") as refused:
        pipeline.prepare(cfg)
    assert "\n" not in str(refused.value)
