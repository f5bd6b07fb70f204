"""Critic-free advantages and GRPO's KL loss (harness/real/advantages.py) against closed forms, and
DAPO's decoupled clip range in the policy loss (harness/real/ppo.py).

Oracles: hand-computed groups (mean, unbiased standard deviation, the mean of the others), the
returns-to-go of a known reward sequence, whitening's zero mean and unit variance, the k3
estimator's value at equal and at known log-probs, and the clipped surrogate's clip point."""
from __future__ import annotations

import math

import pytest
import torch

from harness.real.advantages import (batch_norm_advantages, group_norm_advantages, kl_loss_k3,
                                     leave_one_out_advantages, sequence_kl)
from harness.real.ppo import masked_mean, policy_loss

# 4 responses of lengths 3, 1, 2, 3 (two prompts, groups of 2), right-padded to 3 tokens
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)


def test_group_normalisation_is_each_groups_z_score_on_every_response_token():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_norm_advantages(scores, MASK, group_size=2)
    z = 0.5 / math.sqrt(0.5)  # group (1, 0): mean 0.5, unbiased std sqrt(0.5)
    expected = torch.tensor([z, -z, 0.0, 0.0])[:, None] * MASK  # an all-equal group learns nothing
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)


def test_group_normalisation_refuses_batches_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="do not form groups of 3"):
        group_norm_advantages(torch.zeros(4), MASK, group_size=3)


def test_leave_one_out_subtracts_the_mean_of_the_other_responses():
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0, 2.0, 0.0])
    mask = torch.ones(6, 2)
    adv = leave_one_out_advantages(scores, torch.zeros(6, 2), torch.zeros(6, 2), mask, group_size=3, kl_coef=0.1)
    # group (1, 0, 3): 1 - 1.5, 0 - 2, 3 - 0.5; group (1, 2, 0): 1 - 1, 2 - 0.5, 0 - 1.5
    expected = torch.tensor([-0.5, -2.0, 2.5, 0.0, 1.5, -1.5])[:, None] * mask
    torch.testing.assert_close(adv, expected)


def test_leave_one_out_penalises_each_responses_summed_log_ratio():
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    ref = logp - MASK * torch.tensor([[0.5], [0.0], [0.0], [0.0]])  # response 0 drifted 0.5 per token
    assert sequence_kl(logp, ref, MASK).tolist() == [1.5, 0.0, 0.0, 0.0]
    adv = leave_one_out_advantages(torch.zeros(4), logp, ref, MASK, group_size=2, kl_coef=0.2)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-0.3, 0.3, 0.0, 0.0]))


def test_reinforce_pp_returns_are_the_rewards_to_go_whitened_over_the_batch():
    scores = torch.tensor([1.0, 2.0, 0.0, -1.0])
    logp, ref = torch.zeros(4, 3), torch.zeros(4, 3)
    adv, returns = batch_norm_advantages(scores, logp, ref, MASK, kl_coef=0.05)
    # no KL drift: every token's return-to-go is its response's score
    torch.testing.assert_close(returns, scores[:, None] * MASK)
    assert abs(float(masked_mean(adv, MASK))) < 1e-6
    var = float(masked_mean(adv ** 2, MASK)) * MASK.sum() / (MASK.sum() - 1)  # unbiased, as masked_whiten
    assert float(var) == pytest.approx(1.0, rel=1e-5)
    assert float((adv * (1 - MASK)).abs().sum()) == 0.0


def test_reinforce_pp_returns_carry_the_kl_penalty_of_later_tokens():
    logp = torch.tensor([[0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, 0.0, -2.0]])  # log-ratios 1, 0, 2
    _, returns = batch_norm_advantages(torch.tensor([5.0]), logp, ref, torch.ones(1, 3), kl_coef=0.1)
    torch.testing.assert_close(returns, torch.tensor([[5.0 - 0.3, 5.0 - 0.2, 5.0 - 0.2]]))


def test_k3_kl_is_zero_at_the_reference_and_its_closed_form_elsewhere():
    logp = torch.tensor([[-1.0, -2.0]])
    assert float(kl_loss_k3(logp, logp, torch.ones(1, 2))) == 0.0
    ref = torch.tensor([[-1.5, -1.0]])  # ref - logp = -0.5, 1.0
    expected = ((math.exp(-0.5) + 0.5 - 1) + (math.exp(1.0) - 1.0 - 1)) / 2
    assert float(kl_loss_k3(logp, ref, torch.ones(1, 2))) == pytest.approx(expected)
    assert float(kl_loss_k3(logp, ref, torch.tensor([[1.0, 0.0]]))) == pytest.approx(math.exp(-0.5) - 0.5)


def test_clip_higher_moves_only_the_upper_clip_bound():
    """DAPO's clip-higher: ratio 1.25 with a positive advantage is clipped at 1.2 symmetrically and
    not at 1 + 0.28; ratio 0.75 with a negative advantage is clipped at 0.8 either way."""
    mask = torch.ones(1, 1)
    for ratio, adv, clipped_sym, clipped_high in ((1.25, 1.0, 1.0, 0.0), (0.75, -1.0, 1.0, 1.0)):
        logp, old, a = torch.tensor([[math.log(ratio)]]), torch.zeros(1, 1), torch.tensor([[adv]])
        loss_sym, s_sym = policy_loss(logp, old, a, mask, clip_eps=0.2)
        loss_high, s_high = policy_loss(logp, old, a, mask, clip_eps=0.2, clip_eps_high=0.28)
        assert s_sym["actor/pg_clipfrac"] == clipped_sym and s_high["actor/pg_clipfrac"] == clipped_high
        if adv > 0:
            assert float(loss_sym) == pytest.approx(-1.2) and float(loss_high) == pytest.approx(-1.25)
        else:
            assert float(loss_sym) == pytest.approx(0.8) and float(loss_high) == pytest.approx(0.8)
