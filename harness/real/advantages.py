"""Critic-free advantages and the KL loss term (harness/core/algorithm.py names the algorithms).

Owns, for right-padded (B, T) response tensors with a 0/1 ``mask`` (one contiguous run of valid
tokens per row) and samples laid out in groups of ``group_size`` consecutive rows that answer one
prompt (:func:`harness.core.workload.make_batch`):

* **group normalisation** (GRPO, DeepSeekMath arXiv 2402.03300 section 4.1.2, outcome supervision;
  DAPO arXiv 2503.14476 eq. 9): every token of response ``i`` gets
  ``(r_i - mean(r_group)) / (std(r_group) + eps)``, the standard deviation unbiased over the ``G``
  responses to the prompt (a group whose rewards are all equal gets advantage 0);
* **leave-one-out** (RLOO, arXiv 2402.14740 section 3): ``R_i - mean_{j != i} R_j`` over the group,
  with ``R_i`` the score minus ``kl_coef`` times the response's summed log-ratio to the reference
  model (the sequence-level KL penalty of RLHF rewards);
* **batch normalisation** (REINFORCE++, arXiv 2501.03262 section 3): per-token rewards with the
  KL penalty and the score on the last token (:func:`harness.real.ppo.kl_penalized_rewards`),
  returns-to-go with gamma = 1, whitened over every valid token of the batch;
* the **KL loss** of GRPO (DeepSeekMath eq. 4, the unbiased "k3" estimator of Schulman's
  approximating-KL note): ``exp(ref - logp) - (ref - logp) - 1`` per token, which is >= 0 and 0
  where the policy equals the reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from harness.real.ppo import kl_penalized_rewards, masked_mean, masked_whiten

GROUP_STD_EPS = 1e-6  # verl's and DeepSeekMath's epsilon under the group's standard deviation


def _groups(values: Tensor, group_size: int) -> Tensor:
    if values.dim() != 1 or values.shape[0] % group_size:
        raise ValueError(f"{tuple(values.shape)} scores do not form groups of {group_size} responses")
    return values.reshape(-1, group_size)


def _per_token(per_sample: Tensor, mask: Tensor) -> Tensor:
    return per_sample[:, None].to(torch.float32) * mask.to(torch.float32)


def group_norm_advantages(scores: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """(B, T) GRPO advantages: each response's score normalised over its group (module docstring)."""
    if group_size < 2:
        raise ValueError("group normalisation needs at least 2 responses per prompt")
    g = _groups(scores.to(torch.float32), group_size)
    normed = (g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + GROUP_STD_EPS)
    return _per_token(normed.reshape(-1), mask)


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(B,) each response's summed log-ratio ``logp - ref`` over its valid tokens."""
    return ((logprobs - ref_logprobs) * mask.to(logprobs.dtype)).sum(-1)


def leave_one_out_advantages(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                             group_size: int, kl_coef: float) -> Tensor:
    """(B, T) RLOO advantages: the KL-penalised sequence reward minus the mean of the group's others."""
    if group_size < 2:
        raise ValueError("a leave-one-out baseline needs at least 2 responses per prompt")
    rewards = scores.to(torch.float32) - kl_coef * sequence_kl(logprobs.float(), ref_logprobs.float(), mask)
    g = _groups(rewards, group_size)
    baseline = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    return _per_token((g - baseline).reshape(-1), mask)


def batch_norm_advantages(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                          kl_coef: float) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)`` (B, T) of REINFORCE++: returns-to-go of the KL-penalised token rewards,
    and those returns whitened over the batch's valid tokens."""
    rewards = kl_penalized_rewards(scores.float(), logprobs.float(), ref_logprobs.float(), mask, kl_coef)
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * mask.to(rewards.dtype)
    return masked_whiten(returns, mask), returns


def kl_loss_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
               num_tokens: float | Tensor | None = None) -> Tensor:
    """Mean over valid tokens (or over ``num_tokens``) of ``exp(ref - logp) - (ref - logp) - 1``."""
    log_ratio = ref_logprobs - logprobs
    return masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask, num_tokens)
