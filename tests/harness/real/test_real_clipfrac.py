"""Clip fractions on hand-computed cases: the share of valid tokens whose *clipped* term PPO's loss
takes (harness.real.ppo.pg_clipped / vf_clipped), the same in the PPO math and in the Ray
backend's training pass (which used to count every ratio outside [1-eps, 1+eps], on either side
and for zero advantages alike)."""
from __future__ import annotations

import math

import pytest
import torch

from harness.real import ppo

EPS = 0.2
# Policy case, two rows of four tokens; the last token of row 1 is padding.
#   row 0: ratio 1.5, A +1  -> min(1.5, 1.2) takes the clip         -> clipped
#          ratio 0.5, A +1  -> min(0.5, 0.8) = 0.5 unclipped term    -> not clipped (gradient flows)
#          ratio 1.5, A -1  -> min(-1.5, -1.2) = -1.5 unclipped      -> not clipped
#          ratio 0.5, A -1  -> min(-0.5, -0.8) takes the clip        -> clipped
#   row 1: ratio 1.1, A +2  -> inside the range                      -> not clipped
#          ratio 1.3, A  0  -> both terms 0                          -> not clipped
#          ratio 0.7, A -.5 -> min(-0.35, -0.4) takes the clip       -> clipped
#          ratio 2.0, A +1  -> padding                               -> not counted
# 3 clipped of 7 valid tokens. Counting |ratio - 1| > eps instead gives 6 of 7.
# Loss terms max(-A r, -A clip(r)): row 0: -1.2, -0.5, 1.5, 0.8; row 1: -2.2, 0, 0.4 -> sum -1.2.
RATIO = torch.tensor([[1.5, 0.5, 1.5, 0.5], [1.1, 1.3, 0.7, 2.0]], dtype=torch.float64)
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0], [2.0, 0.0, -0.5, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
CLIPPED = [[True, False, False, True], [False, False, True, True]]  # pg_clipped before masking
# Value case (old values 0): V 0.5 towards R 1.0: clipped error (0.2-1)^2 = .64 > .25 -> clipped;
# V 0.5 past R 0.3: clipped error (0.2-.3)^2 = .01 < .04 -> not clipped; V -0.5 away from R 1.0:
# clipped error (-.2-1)^2 = 1.44 < 2.25 -> not clipped; V 0.1 inside the range -> not clipped.
# 1 of 4 (|V - old| > eps would give 3 of 4). Loss 0.5 * mean(.64, .04, 2.25, 24.01) = 3.3675.
VALUES = torch.tensor([[0.5, 0.5, -0.5, 0.1]], dtype=torch.float64)
RETURNS = torch.tensor([[1.0, 0.3, 1.0, 5.0]], dtype=torch.float64)


def test_pg_clipped_marks_only_tokens_whose_clipped_term_is_taken():
    assert ppo.pg_clipped(RATIO, ADV, EPS).tolist() == CLIPPED


def test_policy_clipfrac_hand_example():
    logprobs = RATIO.log().requires_grad_(True)
    old = torch.zeros_like(RATIO)
    loss, stats = ppo.policy_loss(logprobs, old, ADV, MASK, clip_eps=EPS)
    assert stats["actor/pg_clipfrac"] == pytest.approx(3 / 7)
    assert float(loss.detach()) == pytest.approx(-1.2 / 7)
    loss.backward()
    grad = logprobs.grad
    # no gradient exactly where the clipped term was taken (and at A = 0, and on padding)
    assert grad[0, 0] == 0 and grad[0, 3] == 0 and grad[1, 2] == 0 and grad[1, 1] == 0 and grad[1, 3] == 0
    assert grad[0, 1] != 0 and grad[0, 2] != 0 and grad[1, 0] != 0
    # divided by the mini-batch's token count, like the loss: micro-batch stats add up
    _, part0 = ppo.policy_loss(logprobs[:1], old[:1], ADV[:1], MASK[:1], EPS, num_tokens=7.0)
    _, part1 = ppo.policy_loss(logprobs[1:], old[1:], ADV[1:], MASK[1:], EPS, num_tokens=7.0)
    assert part0["actor/pg_clipfrac"] == pytest.approx(2 / 7) and part1["actor/pg_clipfrac"] == pytest.approx(1 / 7)


def test_value_clipfrac_hand_example():
    loss, stats = ppo.value_loss(VALUES, torch.zeros_like(VALUES), RETURNS, torch.ones_like(VALUES), clip_eps=EPS)
    assert ppo.vf_clipped(VALUES, torch.zeros_like(VALUES), RETURNS, EPS).tolist() == [[True, False, False, False]]
    assert stats["critic/vf_clipfrac"] == pytest.approx(1 / 4)
    assert float(loss) == pytest.approx(3.3675)


def test_ray_training_pass_reports_the_same_clip_fractions():
    """The backend's per-micro-batch stats (harness.backends.ray.worker.pipeline._loss) on the same cases,
    from model outputs: logits whose log-probabilities give exactly RATIO against old log-probs."""
    from harness.backends.ray.worker.passes import _head_output
    from harness.backends.ray.worker.pipeline import _loss
    from harness.backends.ray.protocol import Train

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 3, generator=gen)
    tokens = torch.randint(0, 3, (2, 5), generator=gen)
    logp = _head_output(logits, tokens, "logprobs", 1.0, None)
    mb = {"tokens": tokens, "action_mask": MASK.float(), "advantages": ADV.float(),
          "old_logprobs": logp - RATIO.float().log()}
    p = Train("t", "actor", None, temperature=1.0, clip_eps=EPS, value_clip_eps=EPS)
    _, stats = _loss(logits, mb, "actor", p, num_tokens=7.0)
    assert stats["clipfrac"] == pytest.approx(3 / 7, abs=1e-6)
    assert stats["approx_kl"] == pytest.approx(-float((RATIO.log() * MASK).sum()) / 7, abs=1e-5)

    out = torch.cat([VALUES, torch.zeros(1, 1, dtype=torch.float64)], 1).float()  # value head output (B, W)
    mb = {"tokens": torch.zeros(1, 5, dtype=torch.long), "action_mask": torch.ones(1, 4),
          "old_values": torch.zeros(1, 4), "returns": RETURNS.float()}
    loss, stats = _loss(out, mb, "critic", p, num_tokens=4.0)
    assert stats["clipfrac"] == pytest.approx(1 / 4)
    assert math.isclose(stats["loss"], 3.3675, rel_tol=1e-6)
