"""The programmatic reward of the learning task (harness/backends/ray/rewards.py, docs/LEARNING.md)
and its typed config (``backend.options.reward``), without Ray."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra.errors import ConfigCompositionException

from harness.backends.ray.config import RayOptions, RewardOptions
from harness.backends.ray.driver.experience import policy_reward
from harness.backends.ray.protocol import TaskReward
from harness.backends.ray.rewards import task_reward, task_scores
from harness.errors import ConfigError
from harness.testing import context, run_config

SPEC = {"kind": "token_range", "low": 0, "high": 32}
LEARN = ["+system=deepspeed_chat", "model=tiny", "workload=learn", "backend=ray"]


def test_token_range_score_counts_only_response_tokens():
    # row 0: prompt of 3 tokens, response [5, 40, 31, 32] -> 5 and 31 are in [0, 32): 2/4
    # row 1: prompt of 2 tokens, response [0, 200], then padding (the 7s are not counted): 1/2
    tokens = torch.tensor([[99, 1, 2, 5, 40, 31, 32], [3, 4, 0, 200, 7, 7, 7]])
    scores = task_scores(tokens, torch.tensor([3, 2]), torch.tensor([6, 3]), TaskReward(**SPEC))
    torch.testing.assert_close(scores, torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError):
        task_scores(tokens, torch.tensor([3, 2]), torch.tensor([6, 3]), TaskReward("model", 0, 32))


def test_pass_at_makes_the_score_a_verdict():
    """``pass_at``: 1 where the in-range fraction reaches it (0.5 >= 0.5, 0.75), 0 below (0.25)."""
    tokens = torch.tensor([[9, 1, 40, 41, 42], [9, 1, 2, 40, 41], [9, 1, 2, 3, 40]])
    prompt_lens, last = torch.tensor([1, 1, 1]), torch.tensor([4, 4, 4])
    fractions = task_scores(tokens, prompt_lens, last, TaskReward(**SPEC))
    torch.testing.assert_close(fractions, torch.tensor([0.25, 0.5, 0.75]))
    verdicts = task_scores(tokens, prompt_lens, last, TaskReward(**SPEC, pass_at=0.5))
    torch.testing.assert_close(verdicts, torch.tensor([0.0, 1.0, 1.0]))
    assert task_reward("reward", RewardOptions(**SPEC, pass_at=0.5)) == TaskReward("token_range", 0, 32, 0.5)
    with pytest.raises(ConfigError, match="pass_at=1.5"):
        RayOptions(reward=RewardOptions(**SPEC, pass_at=1.5))


def test_only_the_reward_pass_gets_the_task():
    options = RewardOptions(**SPEC)
    assert task_reward("reward", options) == TaskReward("token_range", 0, 32)
    assert task_reward("ref", options) is None and task_reward("critic", options) is None
    assert task_reward("reward", RewardOptions(kind="model")) is None


def test_reward_config_is_typed():
    assert run_config(LEARN).backend.options.reward.kind == "model"  # the default: the reward model's score
    run = run_config(LEARN + ["backend.options.reward.kind=token_range", "backend.options.reward.high=16"])
    assert (run.backend.options.reward.kind, run.backend.options.reward.high) == ("token_range", 16)
    with pytest.raises(ConfigCompositionException, match="backend.options.reward.colour"):
        run_config(LEARN + ["backend.options.reward.colour=1"])  # unknown keys are refused
    with pytest.raises(ConfigError, match=r"reward.kind='bogus'.*model, token_range"):
        run_config(LEARN + ["backend.options.reward.kind=bogus"])
    with pytest.raises(ConfigError, match="0 <= low < high"):
        run_config(LEARN + ["backend.options.reward.kind=token_range", "backend.options.reward.low=32"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['colour'\]"):
        RayOptions.from_config({"reward": {"kind": "token_range", "colour": 1}})


def test_reward_range_must_fit_the_vocabulary():
    from harness.backends.ray.driver.backend import RayBackend

    overrides = LEARN + ["backend.options.reward.kind=token_range", "backend.options.reward.high=300",
                         "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=2"]
    with pytest.raises(ConfigError, match=r"reward.high=300 exceeds the actor's vocabulary \(256"):
        RayBackend(run_config(overrides).backend, context(overrides))


def test_untrained_policy_scores_the_share_of_the_range():
    """The untrained tiny actor emits tokens of [0, 32) about as often as chance (32/256 = 1/8):
    the bar a learning run must clear (tests/harness/backends/ray/test_ray_learning.py)."""
    run = run_config(LEARN)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scores = [policy_reward(run.model.actor, run.workload, seed, 0, SPEC) for seed in range(4)]
    finally:
        torch.set_num_threads(threads)
    assert all(0.0 < s < 0.25 for s in scores), scores
    assert abs(np.mean(scores) - 1 / 8) < 0.05, scores
