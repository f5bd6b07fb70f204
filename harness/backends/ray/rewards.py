"""Programmatic rewards: a learning task whose reward is computed from the response tokens, so
that a run shows whether PPO learns (``backend.options.reward``, docs/LEARNING.md).

With random tiny models and the default ``reward.kind=model`` the reward model's scores are noise
that no policy can improve, so a reward curve cannot tell a working pipeline from a broken one.
``token_range`` is a task with a known optimum and a dense signal: the score of a sample is the
fraction of its response tokens whose id lies in ``[low, high)`` (or, with ``pass_at``, whether that
fraction reaches it: a pass/fail verdict, as a math verifier gives). A policy that ignores the task
scores about ``(high - low) / vocab_size`` (1/8 with the defaults and the 256-token tiny models);
one that emits only tokens of the range scores 1. It does not depend on the prompt.

The reward stage still runs the reward model's forward pass (its time is part of the plan's
reward stage); :func:`task_scores` replaces its output on the device that reports it. Both sides
use this module: the driver names the task in the reward pass's request (:func:`task_reward`),
the worker scores with it. The untrained policy's reward on a run's batches, the bar a learning run
must clear, is :func:`harness.backends.ray.driver.experience.policy_reward`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from harness.backends.ray.config import RewardOptions
from harness.backends.ray.protocol import TaskReward


def task_scores(tokens: Tensor, prompt_lens: Tensor, last_index: Tensor, reward: TaskReward) -> Tensor:
    """Per-sample scores (B,) float32 of the task ``reward`` for rows of ``tokens`` (B, W) whose
    response occupies positions ``prompt_lens`` .. ``last_index`` (inclusive)."""
    if reward.kind != "token_range":
        raise ValueError(f"no programmatic reward {reward.kind!r}")
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    response = (pos[None, :] >= prompt_lens[:, None]) & (pos[None, :] <= last_index[:, None])
    hit = (tokens >= int(reward.low)) & (tokens < int(reward.high)) & response
    frac = hit.sum(-1).float() / response.sum(-1).clamp(min=1).float()
    return frac if reward.pass_at is None else (frac >= float(reward.pass_at)).float()


def task_reward(role: str, options: RewardOptions) -> Optional[TaskReward]:
    """The programmatic reward an inference pass of ``role`` computes: for the reward model under
    ``backend.options.reward.kind=token_range``, that task; None otherwise (the model's own output).
    A run without a reward model (``algo.reward=rule``) verifies with the reward role's task on the
    driver; :meth:`~harness.backends.ray.driver.backend.RayBackend.check_before_planning` has
    refused ``kind=model`` there."""
    if role != "reward" or options.kind == "model":
        return None
    return TaskReward(options.kind, options.low, options.high, options.pass_at)
