"""PPO math for RLHF (docs/DESIGN.md section 6), shared by every system so they all compute the same update.

Owns, for right-padded (B, T) response tensors with a 0/1 ``mask`` whose valid tokens are one
contiguous run per row:

* the per-token reward with a KL penalty against the reference model (Ouyang et al. 2022,
  section 3.5 / eq. 2, in the per-token form of Ziegler et al. 2019): ``r_t = -beta (logp_t -
  ref_logp_t)``, plus the reward model's score on the last response token;
* generalised advantage estimation (Schulman et al. 2016): ``delta_t = r_t + gamma V_{t+1} - V_t``
  (``V`` = 0 after the last token), ``A_t = sum_{s>=t} (gamma lam)^(s-t) delta_s``, in two forms
  that agree: the usual backward recursion and ONE matrix product ``A = delta @ M^T`` with
  ``M[t, s] = (gamma lam)^(s-t)`` for ``s >= t`` (RLHFuse section 6: one GEMM instead of a
  sequential loop over tokens); returns ``= A + V``;
* the clipped surrogate policy loss and clipped value loss (Schulman et al. 2017, eq. 7 and
  section 5), averaged over tokens; ``num_tokens`` lets micro-batches of one mini-batch divide
  by the mini-batch's token count, so gradient accumulation equals the full mini-batch's mean;
  their clip fractions (:func:`pg_clipped`, :func:`vf_clipped`): the share of tokens whose
  clipped term the loss takes, which is where the gradient is cut;
* splitting a batch (a dict of tensors whose first dimension is the sample) into shuffled
  mini-batches and sequential micro-batches.
"""
from __future__ import annotations

import torch
from torch import Tensor

Batch = dict[str, Tensor]


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last valid token of each row of ``mask`` (B, T)."""
    valid = mask.bool()
    if not valid.any(-1).all():
        raise ValueError("every sample needs at least one valid response token")
    t = mask.shape[-1]
    return t - 1 - valid.flip(-1).long().argmax(-1)


def kl_penalized_rewards(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                         kl_coef: float) -> Tensor:
    """Per-token rewards (B, T): ``-kl_coef * (logprobs - ref_logprobs)`` on valid tokens, plus
    ``scores`` (B,) on each row's last valid token; 0 on padding."""
    mask = mask.to(logprobs.dtype)
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards


def _deltas(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float) -> Tensor:
    mask = mask.to(values.dtype)
    next_values = torch.zeros_like(values)
    next_values[:, :-1] = values[:, 1:] * mask[:, 1:]
    return (rewards + gamma * next_values - values) * mask


def gae_matrix(length: int, gamma: float, lam: float, *, dtype=torch.float32, device=None) -> Tensor:
    """``M`` (T, T) with ``M[t, s] = (gamma lam)^(s-t)`` for ``s >= t`` and 0 below the diagonal."""
    idx = torch.arange(length, device=device)
    power = (idx[None, :] - idx[:, None]).to(torch.float64)
    m = torch.where(power >= 0, torch.tensor(gamma * lam, dtype=torch.float64, device=device) ** power.clamp(min=0),
                    torch.zeros((), dtype=torch.float64, device=device))
    return m.to(dtype)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)`` (B, T) by one matrix product ``delta @ M^T`` (RLHFuse section 6)."""
    deltas = _deltas(rewards, values, mask, gamma)
    m = gae_matrix(rewards.shape[-1], gamma, lam, dtype=deltas.dtype, device=deltas.device)
    advantages = (deltas @ m.T) * mask.to(deltas.dtype)
    return advantages, (advantages + values) * mask.to(deltas.dtype)


def gae_advantages_recursive(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                             lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """The same as :func:`gae_advantages` by the backward recursion ``A_t = delta_t + gamma lam A_{t+1}``."""
    deltas = _deltas(rewards, values, mask, gamma)
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[-1])):
        running = deltas[:, t] + gamma * lam * running * (mask[:, t + 1] if t + 1 < values.shape[-1] else 0.0)
        advantages[:, t] = running * mask[:, t]
    return advantages, (advantages + values) * mask


def masked_mean(x: Tensor, mask: Tensor, num_tokens: float | Tensor | None = None) -> Tensor:
    """Sum of ``x`` over valid tokens divided by their count (or by ``num_tokens``)."""
    mask = mask.to(x.dtype)
    denom = mask.sum() if num_tokens is None else num_tokens
    return (x * mask).sum() / denom


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / std`` over valid tokens (unbiased variance), 0 on padding."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    var = var * n / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


def pg_clipped(ratio: Tensor, advantages: Tensor, clip_eps: float, clip_eps_high: float | None = None) -> Tensor:
    """Where PPO's clipped surrogate takes the clipped term (bool, same shape as ``ratio``).

    The loss per token is ``max(-A r, -A clip(r, 1-eps, 1+eps))`` (the negated ``min`` of
    Schulman et al. 2017, eq. 7). The clipped term is the one taken, and the token's gradient is
    zero, exactly when ``-A clip(r) > -A r``, i.e. ``A > 0`` and ``r > 1 + eps`` or ``A < 0`` and
    ``r < 1 - eps``. A ratio outside the range on the other side (``A > 0`` and ``r < 1 - eps``,
    ``A < 0`` and ``r > 1 + eps``) is *not* clipped: the unclipped term is the smaller objective
    and its gradient flows. Tokens with ``A = 0`` are never clipped. This is the ``pg_clipfrac``
    of verl (``torch.gt(pg_losses2, pg_losses)``) and OpenRLHF. ``clip_eps_high`` (DAPO's
    clip-higher, arXiv 2503.14476 section 3.1) replaces ``eps`` in the upper bound when given."""
    unclipped = -advantages * ratio
    clipped = -advantages * _clip_ratio(ratio, clip_eps, clip_eps_high)
    return clipped > unclipped


def _clip_ratio(ratio: Tensor, clip_eps: float, clip_eps_high: float | None) -> Tensor:
    return ratio.clamp(1.0 - clip_eps, 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high))


def vf_clipped(values: Tensor, old_values: Tensor, returns: Tensor, clip_eps: float) -> Tensor:
    """Where the clipped value loss takes the clipped term: ``(V_clip - R)^2 > (V - R)^2`` with
    ``V_clip = old + clip(V - old, -eps, eps)`` (verl's ``vf_clipfrac``): the loss then takes the
    clipped error and the token's gradient is zero. A value that moved more than ``eps`` from the
    old one is not clipped when its own error is the larger (e.g. it moved away from the return)."""
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return (clipped_values - returns) ** 2 > (values - returns) ** 2


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_eps: float = 0.2, num_tokens: float | Tensor | None = None,
                clip_eps_high: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate: mean over tokens of ``max(-A r, -A clip(r, 1-eps, 1+eps))``, r = exp(logp - old)
    (the upper bound ``1 + clip_eps_high`` when given: DAPO's decoupled clip range).

    Stats: ``actor/pg_clipfrac``, the fraction of valid tokens whose clipped term was taken
    (:func:`pg_clipped`), and ``actor/ppo_kl``, the mean of ``old - logp``; both divide by
    ``num_tokens`` when given, like the loss, so the stats of one mini-batch's micro-batches add up
    to the mini-batch's."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * _clip_ratio(ratio, clip_eps, clip_eps_high)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask, num_tokens)
    with torch.no_grad():
        clipped_at = pg_clipped(ratio, advantages, clip_eps, clip_eps_high).to(ratio.dtype)
        stats = {"actor/pg_loss": float(loss.detach()),
                 "actor/pg_clipfrac": float(masked_mean(clipped_at, mask, num_tokens)),
                 "actor/ppo_kl": float(masked_mean(old_logprobs - logprobs, mask, num_tokens))}
    return loss, stats


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float = 0.2,
               num_tokens: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: mean over tokens of ``0.5 max((V - R)^2, (V_clip - R)^2)`` with
    ``V_clip = old + clip(V - old, -eps, eps)``; ``critic/vf_clipfrac`` is the fraction of valid
    tokens whose clipped term was taken (:func:`vf_clipped`), over ``num_tokens`` when given."""
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    err, err_clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), mask, num_tokens)
    with torch.no_grad():
        stats = {"critic/vf_loss": float(loss.detach()),
                 "critic/vf_clipfrac": float(masked_mean(vf_clipped(values, old_values, returns, clip_eps)
                                                         .to(values.dtype), mask, num_tokens))}
    return loss, stats


# ---- batches: dicts of tensors split by sample (first dimension) ----

def batch_size(batch: Batch) -> int:
    sizes = {k: v.shape[0] for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on the number of samples: {sizes}")
    return next(iter(sizes.values()))


def select(batch: Batch, index: Tensor | slice) -> Batch:
    return {k: v[index] for k, v in batch.items()}


def concat_batches(batches: list[Batch]) -> Batch:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def split_batch(batch: Batch, chunk_size: int) -> list[Batch]:
    """Consecutive chunks of ``chunk_size`` samples (the last may be smaller)."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be positive")
    n = batch_size(batch)
    return [select(batch, slice(i, i + chunk_size)) for i in range(0, n, chunk_size)]


def minibatches(batch: Batch, num_minibatches: int, *, seed: int | None = None) -> list[Batch]:
    """``num_minibatches`` equal mini-batches, samples shuffled by ``seed`` (None: in order)."""
    n = batch_size(batch)
    if num_minibatches < 1 or n % num_minibatches:
        raise ValueError(f"{n} samples do not split into {num_minibatches} equal mini-batches")
    if seed is not None:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        batch = select(batch, order.to(next(iter(batch.values())).device))
    return split_batch(batch, n // num_minibatches)


def microbatches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Micro-batches of a mini-batch for gradient accumulation or pipeline schedules."""
    return split_batch(batch, micro_batch_size)
