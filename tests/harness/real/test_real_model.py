"""The LLaMA decoder: config, init, masks, KV cache, GQA, rotary, pipeline stages."""
from __future__ import annotations

import pytest
import torch

from harness.core.config import LlamaConfig
from harness.real.model import KVCache, LlamaModel, ModelArgs, load_llama_config, rotary, split_layers


def _tokens(b, t, seed=0, vocab=256):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_args_from_tiny_configs():
    tiny = ModelArgs.from_llama_config(load_llama_config("tiny"))
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads) == (2, 64, 4, 2)
    assert (tiny.ffn_hidden_size, tiny.vocab_size, tiny.rope_theta, tiny.dim_per_head) == (172, 256, 10000.0, 16)
    tiny2 = ModelArgs.from_llama_config(load_llama_config("tiny2"), rope_theta=500.0, value_head=True)
    assert (tiny2.num_layers, tiny2.num_kv_heads, tiny2.rope_theta, tiny2.value_head) == (4, 4, 500.0, True)
    direct = LlamaConfig(name="x", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=1, ffn_hidden_size=64)
    assert ModelArgs.from_llama_config(direct).vocab_size == 32000
    with pytest.raises(ValueError, match="multiple"):
        ModelArgs.from_llama_config(direct, num_kv_heads=3)


def test_seeded_init_and_shapes(tiny_model):
    cfg = load_llama_config("tiny")
    same = LlamaModel.from_config(cfg, seed=1)
    other = LlamaModel.from_config(cfg, seed=2)
    states = zip(tiny_model.state_dict().items(), same.state_dict().values(), other.state_dict().values())
    for (name, a), b, c in states:
        assert torch.equal(a, b), name
        assert name.endswith("norm.weight") or not torch.equal(a, c), name
    x = _tokens(3, 7)
    assert tiny_model(x).shape == (3, 7, 256)
    critic = LlamaModel.from_config(cfg, seed=1, value_head=True)
    assert critic(x).shape == (3, 7)


def test_causal(tiny_model):
    x = _tokens(2, 10)
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 256
    with torch.no_grad():
        a, b = tiny_model(x), tiny_model(y)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_single_samples(tiny_model, side):
    lengths = [5, 9, 3]
    seqs = [_tokens(1, n, seed=i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    tokens = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        tokens[i, cols], mask[i, cols] = s, 1
    with torch.no_grad():
        out = tiny_model(tokens, attention_mask=mask)
        for i, s in enumerate(seqs):
            valid = mask[i].bool()
            torch.testing.assert_close(out[i, valid], tiny_model(s[None])[0], atol=1e-5, rtol=1e-5)
            assert torch.isfinite(out[i]).all()


def test_packed_segments_equal_separate_sequences(tiny_model):
    parts = [_tokens(1, n, seed=10 + n)[0] for n in (4, 7, 5)]
    packed = torch.cat(parts)[None]
    segments = torch.cat([torch.full((len(p),), i) for i, p in enumerate(parts)])[None]
    with torch.no_grad():
        out = tiny_model(packed, segment_ids=segments)[0]
        expected = torch.cat([tiny_model(p[None])[0] for p in parts])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kv_cache_decode_equals_full_forward(tiny_model):
    x = _tokens(2, 12, seed=3)
    cache = KVCache(num_slots=4, capacity=4)  # grows while decoding
    slots = torch.tensor([2, 0])
    with torch.no_grad():
        full = tiny_model(x)
        # prefill of different lengths per row (right padded), then one token at a time
        mask = torch.tensor([[1] * 5 + [0] * 2, [1] * 7])
        pre = tiny_model(x[:, :7] * mask, attention_mask=mask, cache=cache, slots=slots)
        cache.advance(slots, mask.sum(1))
        torch.testing.assert_close(pre[0, :5], full[0, :5], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pre[1, :7], full[1, :7], atol=1e-5, rtol=1e-5)
        pos = [5, 7]
        for _ in range(4):
            step = torch.stack([x[0, pos[0]], x[1, pos[1]]])[:, None]
            out = tiny_model(step, cache=cache, slots=slots)
            cache.advance(slots, 1)
            for row in range(2):
                torch.testing.assert_close(out[row, 0], full[row, pos[row]], atol=1e-5, rtol=1e-5)
            pos = [p + 1 for p in pos]
    assert cache.lengths.tolist() == [11, 0, 9, 0]
    exported = cache.export(2)
    assert set(exported) == {0, 1} and exported[0][0].shape == (2, 9, 16)
    other = KVCache(num_slots=1)
    other.load(0, exported)
    assert int(other.lengths[0]) == 9 and torch.equal(other.export(0)[1][1], exported[1][1])


def test_grouped_query_attention_equals_repeated_kv_heads():
    gqa_args = ModelArgs(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                         vocab_size=128, max_seq_len=64)
    mha_args = ModelArgs(**{**gqa_args.__dict__, "num_kv_heads": 4})
    gqa, mha = LlamaModel(gqa_args, seed=5), LlamaModel(mha_args, seed=5)
    state = gqa.state_dict()
    for name, tensor in state.items():
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):  # query head h reads kv head h // 2
            tensor = tensor.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
        mha.state_dict()[name].copy_(tensor)
    x = _tokens(2, 9, vocab=128)
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)


def test_rotary_scores_depend_on_relative_position():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)
    def score(pq, pk):
        return (rotary(q, torch.tensor([[pq]]), 10000.0) * rotary(k, torch.tensor([[pk]]), 10000.0)).sum()
    torch.testing.assert_close(score(7, 3), score(104, 100))
    torch.testing.assert_close(rotary(q, torch.tensor([[0]]), 10000.0), q)
    assert not torch.allclose(score(7, 3), score(7, 4))


def test_split_layers():
    assert split_layers(4, 1) == [(0, 4)]
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        split_layers(2, 3)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_pipeline_stages_equal_full_model(tiny2_model, num_stages):
    stages = tiny2_model.split(num_stages)
    assert stages[0].has_embedding and stages[-1].has_head
    assert not any(s.has_head for s in stages[:-1]) and not any(s.has_embedding for s in stages[1:])
    keys = [set(s.state_dict()) for s in stages]
    assert set().union(*keys) == set(tiny2_model.state_dict())
    assert sum(len(k) for k in keys) == len(tiny2_model.state_dict())  # disjoint
    x = _tokens(2, 11, seed=4)
    mask = torch.ones_like(x)
    mask[1, 8:] = 0
    with torch.no_grad():
        h = x
        for s in stages:
            h = s(h, attention_mask=mask)
        torch.testing.assert_close(h, tiny2_model(x, attention_mask=mask), atol=0, rtol=0)


def test_stage_gradients_equal_full_model_gradients():
    model = LlamaModel.from_config(load_llama_config("tiny2"), seed=3, value_head=True)
    x = _tokens(2, 6, seed=5)
    model(x).square().mean().backward()
    full = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    first, last = model.stage(0, 1), model.stage(1, 4)
    hidden = first(x).detach().requires_grad_(True)  # point-to-point boundary
    last(hidden).square().mean().backward()
    first(x).backward(hidden.grad)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, full[name], atol=1e-6, rtol=1e-5)


def test_output_index_and_cache_padding_check(tiny_model):
    x = _tokens(3, 8, seed=6)
    idx = torch.tensor([7, 0, 3])
    with torch.no_grad():
        full = tiny_model(x)
        torch.testing.assert_close(tiny_model(x, output_index=idx), full[torch.arange(3), idx])
        with pytest.raises(ValueError, match="right-padded"):
            tiny_model(x, attention_mask=torch.tensor([[0, 1] * 4] * 3), cache=KVCache(3))
