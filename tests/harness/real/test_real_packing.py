"""Packed micro-batches of real execution (harness/real/packing.py): laid out from a right-padded
batch, their forward passes and losses equal the padded batch's sample by sample.

Oracles: the padded batch itself (its log-probs, values, scores and PPO loss gradient, computed
row by row without packing), and hand-worked layouts."""
from __future__ import annotations

import pytest
import torch

from harness.real import packing
from harness.real.model import LlamaModel, load_llama_config
from harness.real.ppo import policy_loss

LENGTHS = [5, 9, 3, 7]
WIDTH = 10


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch of LENGTHS tokens in a width of WIDTH, responses after 2 prompt tokens."""
    g = torch.Generator().manual_seed(seed)
    b = len(LENGTHS)
    tokens = torch.zeros(b, WIDTH, dtype=torch.long)
    attn = torch.zeros(b, WIDTH, dtype=torch.long)
    mask = torch.zeros(b, WIDTH - 1)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = torch.randint(1, 256, (n,), generator=g)
        attn[i, :n] = 1
        mask[i, 1:n - 1] = 1.0  # predictions of tokens 2 .. n-1 (the response)
    return {"tokens": tokens, "attn": attn, "action_mask": mask,
            "old_logprobs": -torch.rand(b, WIDTH - 1, generator=g) * mask,
            "advantages": torch.randn(b, WIDTH - 1, generator=g) * mask}


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]


def test_a_packed_row_by_hand():
    data = _batch()
    mb = packing.pack(data, [2, 0])
    assert mb["tokens"].shape == (1, 8) and mb["lengths"].tolist() == [3, 5]
    assert mb["tokens"][0].tolist() == data["tokens"][2, :3].tolist() + data["tokens"][0, :5].tolist()
    assert mb["segment_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert mb["attn"].sum() == 8
    # per-prediction arrays: each sample's first n - 1 entries, then the cross-sample one, masked
    assert mb["action_mask"][0].tolist() == [0, 1, 0, 0, 1, 1, 1]
    assert torch.equal(mb["advantages"][0, :2], data["advantages"][2, :2])
    assert mb["advantages"][0, 2] == 0 and torch.equal(mb["advantages"][0, 3:], data["advantages"][0, :4])


def test_a_full_width_row_packs_its_missing_last_prediction_as_zero():
    data = _batch()
    data["tokens"][1, :] = 7
    data["attn"][1, :] = 1  # 10 tokens: no entry 9 in its (B, 9) per-prediction row
    mb = packing.pack(data, [1, 3])
    assert mb["tokens"].shape == (1, 17) and mb["action_mask"].shape == (1, 16)
    assert mb["action_mask"][0, 9] == 0


def test_bad_rows_are_refused():
    data = _batch()
    data["attn"][0] = 0
    with pytest.raises(ValueError, match=r"rows \[0\] hold no tokens"):
        packing.pack(data, [0, 1])
    data = _batch()
    data["scores"] = torch.zeros(len(LENGTHS))
    with pytest.raises(ValueError, match="neither per token"):
        packing.pack(data, [0, 1])


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 1], [2]])
def test_packed_log_probs_equal_the_padded_batch_row_by_row(tiny_model, rows):
    data = _batch()
    with torch.no_grad():
        padded = _logprobs(tiny_model(data["tokens"], attention_mask=data["attn"]), data["tokens"])
        mb = packing.pack(data, rows)
        packed = _logprobs(tiny_model(mb["tokens"], segment_ids=mb["segment_ids"]), mb["tokens"])
    back = packing.unpack(packed, mb["lengths"].tolist(), WIDTH)
    for j, r in enumerate(rows):
        n = LENGTHS[r]
        torch.testing.assert_close(back[j, :n - 1], padded[r, :n - 1], rtol=0, atol=2e-5)
        assert not back[j, n - 1:].any()


def test_packed_values_and_scores_equal_the_padded_batch():
    critic = LlamaModel.from_config(load_llama_config("tiny"), seed=3, value_head=True).eval()
    data = _batch(1)
    rows = [1, 3, 0]
    with torch.no_grad():
        padded = critic(data["tokens"], attention_mask=data["attn"])
        mb = packing.pack(data, rows)
        packed = critic(mb["tokens"], segment_ids=mb["segment_ids"])
    values = packing.unpack(packed[:, :-1], mb["lengths"].tolist(), WIDTH)
    scores = packed[0, packing.last_positions(mb["lengths"].tolist())]
    for j, r in enumerate(rows):
        n = LENGTHS[r]
        torch.testing.assert_close(values[j, :n - 1], padded[r, :n - 1], rtol=0, atol=2e-5)
        torch.testing.assert_close(scores[j], padded[r, n - 1], rtol=0, atol=2e-5)


def test_the_packed_loss_has_the_padded_batch_gradient():
    """The PPO loss over a mini-batch, divided by its masked tokens, cut into two packed
    micro-batches, accumulates the gradient of the padded batch's loss in one pass."""
    data = _batch(2)
    num_tokens = float(data["action_mask"].sum())
    model = LlamaModel.from_config(load_llama_config("tiny"), seed=4)

    def grad_of(micro_batches):
        model.zero_grad()
        for mb in micro_batches:
            kw = {"segment_ids": mb["segment_ids"]} if "segment_ids" in mb else {"attention_mask": mb["attn"]}
            logp = _logprobs(model(mb["tokens"], **kw), mb["tokens"])
            loss, _ = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["action_mask"], 0.2, num_tokens)
            loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    reference = grad_of([data])
    packed = grad_of([packing.pack(data, [0, 2]), packing.pack(data, [1, 3])])
    assert reference.norm() > 0
    torch.testing.assert_close(packed, reference, rtol=1e-4, atol=1e-6)
