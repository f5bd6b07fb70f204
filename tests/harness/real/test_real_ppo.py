"""PPO math: closed forms on hand examples, GAE matrix == recursion, batching helpers."""
from __future__ import annotations

import pytest
import torch

from harness.real import ppo


def _padded(batch=6, length=11, seed=0, offsets=False):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    starts = torch.zeros(batch, dtype=torch.long)
    if offsets:  # contiguous valid runs that do not start at 0
        starts = torch.randint(0, length, (batch,), generator=gen) % (length - lengths + 1)
    idx = torch.arange(length)
    mask = ((idx >= starts[:, None]) & (idx < (starts + lengths)[:, None])).float()
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return rewards, values, mask.double()


def test_kl_penalized_rewards_hand_example():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-2.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = ppo.kl_penalized_rewards(torch.tensor([1.0, 2.0]), logprobs, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.1], [-0.1, 2.0, 0.0]]))
    assert ppo.last_token_index(torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]])).tolist() == [2, 0]
    with pytest.raises(ValueError):
        ppo.last_token_index(torch.tensor([[0, 0]]))


def test_gae_hand_example():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 0.0, 7.0]])
    values = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1 ends after two tokens
    for fn in (ppo.gae_advantages, ppo.gae_advantages_recursive):
        adv, ret = fn(rewards, values, mask, gamma=0.9, lam=0.8)
        # deltas row 0: 1 + .9*1 - .5 = 1.4, 0 + .9*1.5 - 1 = .35, 2 - 1.5 = .5; gamma*lam = .72
        # row 1: 1.4, 0 + 0 - 1 = -1 (no value after the last token), padding 0
        torch.testing.assert_close(adv, torch.tensor([[1.4 + 0.72 * 0.71, 0.71, 0.5], [1.4 - 0.72, -1.0, 0.0]]))
        torch.testing.assert_close(ret, (adv + values) * mask)


def test_gae_closed_forms():
    rewards, values, mask = _padded(seed=1)
    adv, _ = ppo.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    future = rewards.mul(mask).flip(-1).cumsum(-1).flip(-1)  # sum_{s>=t} r_s (telescoping)
    torch.testing.assert_close(adv, (future - values) * mask)
    adv0, _ = ppo.gae_advantages(rewards, values, mask, gamma=0.7, lam=0.0)
    nxt = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros_like(values[:, :1])], 1)
    torch.testing.assert_close(adv0, (rewards + 0.7 * nxt - values) * mask)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 1.0), (1.0, 0.0)])
@pytest.mark.parametrize("offsets", [False, True], ids=["right-padded", "offset"])
def test_gae_matrix_equals_recursion(gamma, lam, offsets):
    for seed in range(3):
        rewards, values, mask = _padded(batch=8, length=17, seed=seed, offsets=offsets)
        adv_m, ret_m = ppo.gae_advantages(rewards, values, mask, gamma, lam)
        adv_r, ret_r = ppo.gae_advantages_recursive(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(adv_m, adv_r)
        torch.testing.assert_close(ret_m, ret_r)
        assert (adv_m[mask == 0] == 0).all()


def test_gae_matrix_shape():
    m = ppo.gae_matrix(4, 0.5, 1.0, dtype=torch.float64)
    expected = torch.tensor([[1, .5, .25, .125], [0, 1, .5, .25], [0, 0, 1, .5], [0, 0, 0, 1]], dtype=torch.float64)
    torch.testing.assert_close(m, expected)


def test_policy_loss_hand_example():
    ratio = torch.tensor([[1.5, 0.5, 1.1]])
    old = torch.zeros(1, 3)
    logprobs = ratio.log().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, stats = ppo.policy_loss(logprobs, old, adv, torch.ones(1, 3), clip_eps=0.2)
    # t0 clipped at 1.2 -> -1.2; t1 unclipped (-0.5 > -0.8); t2 inside the range -> 1.1
    torch.testing.assert_close(loss, torch.tensor(-0.2))
    assert stats["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] != 0  # no gradient through the clip
    masked, _ = ppo.policy_loss(logprobs, old, adv, torch.tensor([[1, 1, 0]]), clip_eps=0.2)
    torch.testing.assert_close(masked, torch.tensor(-0.85))


def test_value_loss_hand_example():
    values, old = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 2.0]])
    returns = torch.tensor([[2.0, 1.0]])
    loss, stats = ppo.value_loss(values, old, returns, torch.ones(1, 2), clip_eps=0.2)
    # clipped values (0.7, 2.0): errors max((1, 1.69), (1, 1)) -> 0.5 * mean(1.69, 1)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (1.69 + 1.0) / 2))
    assert stats["critic/vf_clipfrac"] == 0.5


def test_micro_batch_accumulation_equals_mini_batch_token_mean():
    gen = torch.Generator().manual_seed(0)
    b, t = 8, 9
    mask = (torch.arange(t) < torch.randint(1, t + 1, (b, 1), generator=gen)).float()
    batch = {"old": torch.randn(b, t, generator=gen), "adv": torch.randn(b, t, generator=gen), "mask": mask}
    logits = torch.randn(b, t, generator=gen).requires_grad_(True)

    def loss_of(rows, num_tokens=None):
        lp = torch.nn.functional.logsigmoid(logits[rows])
        return ppo.policy_loss(lp, batch["old"][rows], batch["adv"][rows], batch["mask"][rows], 0.2, num_tokens)[0]

    loss_of(slice(None)).backward()
    full = logits.grad.clone()
    logits.grad = None
    total = mask.sum()
    for start in range(0, b, 3):
        loss_of(slice(start, start + 3), num_tokens=total).backward()
    torch.testing.assert_close(logits.grad, full)


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 50.0], [4.0, 5.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    w = ppo.masked_whiten(x, mask)
    valid = w[mask.bool()]
    assert abs(float(valid.mean())) < 1e-6 and float(valid.std()) == pytest.approx(1.0, abs=1e-4)
    assert (w[~mask.bool()] == 0).all()


def test_batch_splitting():
    batch = {"x": torch.arange(12).view(6, 2), "y": torch.arange(6)}
    assert [c["y"].tolist() for c in ppo.split_batch(batch, 4)] == [[0, 1, 2, 3], [4, 5]]
    in_order = ppo.minibatches(batch, 3)
    assert [m["y"].tolist() for m in in_order] == [[0, 1], [2, 3], [4, 5]]
    shuffled = ppo.minibatches(batch, 2, seed=3)
    assert shuffled[0]["y"].tolist() == ppo.minibatches(batch, 2, seed=3)[0]["y"].tolist()
    merged = ppo.concat_batches(shuffled)
    assert sorted(merged["y"].tolist()) == list(range(6))
    for m in shuffled:  # rows stay together across keys
        assert torch.equal(m["x"][:, 0], 2 * m["y"])
    micro = ppo.microbatches(shuffled[0], 2)
    assert [ppo.batch_size(m) for m in micro] == [2, 1]
    with pytest.raises(ValueError, match="equal"):
        ppo.minibatches(batch, 4)
    with pytest.raises(ValueError, match="disagree"):
        ppo.batch_size({"a": torch.zeros(2), "b": torch.zeros(3)})
