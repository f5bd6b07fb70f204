"""A LLaMA-style decoder in plain torch that can be cut into pipeline stages (docs/DESIGN.md section 6).

Owns the model arithmetic of real execution: RMSNorm (Zhang & Sennrich 2019), rotary position
embeddings (Su et al. 2021, "RoFormer"), SwiGLU MLP (Shazeer 2020), grouped-query attention
(Ainslie et al. 2023) as in LLaMA (Touvron et al. 2023, section 2.2), an LM head or a scalar value
head (critic / reward, Ouyang et al. 2022 section 3.5), and a slot-based KV cache for decoding.

Rotary embeddings pair dimension ``i`` with ``i + head_dim/2`` (the "half split" layout of
Hugging Face LLaMA checkpoints), so those checkpoints load without permuting weights.

Pipeline stages (:class:`PipelineStage`) own a contiguous range of layers; the first owns the
embedding, the last the final norm and head. Parameter names use global layer indices
(``layers.7.attn.wq.weight``), so a stage's ``state_dict`` is a subset of the full model's.
Running the stages of :meth:`LlamaModel.split` in sequence equals :meth:`LlamaModel.forward`.

Only the LLaMA architecture is built: a config asking for another one (``LlamaConfig.mlp="gelu"``,
``tied_embeddings``, ``learned_positions``: the OPT and GPT configs the simulator also costs;
``num_experts`` > 0: the mixture-of-experts configs; ``kv_lora_rank`` > 0: latent attention) is refused with a ConfigError naming the field
(:func:`check_architecture`, called by :meth:`ModelArgs.from_llama_config`), before any module is built.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.core.config import LlamaConfig
from harness.errors import ConfigError

# LlamaConfig architecture fields and the only value this module builds (LLaMA's: dense).
LLAMA_ARCHITECTURE = {"mlp": "swiglu", "tied_embeddings": False, "learned_positions": False, "num_experts": 0,
                      "kv_lora_rank": 0}


def _field(cfg, name: str, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def unsupported_architecture(cfg) -> list[str]:
    """``field=value`` for each architecture field of ``cfg`` (a ``LlamaConfig``, a DictConfig of
    one, or a mapping) that this LLaMA implementation cannot build; empty when it can."""
    out = []
    for name, built in LLAMA_ARCHITECTURE.items():
        value = _field(cfg, name, built)
        if value != built:
            out.append(f"{name}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def check_architecture(cfg, where: str | None = None) -> None:
    """Raise :class:`ConfigError` naming every field of ``cfg`` this module cannot build (a GeLU MLP,
    a tied LM head, learned positions, mixture-of-experts layers, latent attention). ``where`` is the config's key
    (``model.actor``), which prefixes the fields in the message; by default the message names the model."""
    bad = unsupported_architecture(cfg)
    if not bad:
        return
    prefix = f"{where}." if where else ""
    subject = where or f"model {_field(cfg, 'name', '?')}"
    raise ConfigError(f"{subject}: backend=ray builds LLaMA modules only (dense SwiGLU MLP, untied LM head, "
                      f"rotary positions) and cannot run {', '.join(prefix + b for b in bad)}; use backend=sim for "
                      f"this model, or a LLaMA model on backend=ray")


def check_models_architecture(models) -> None:
    """:func:`check_architecture` of the four PPO roles of ``models`` (``RunConfig.model``), one
    ConfigError for the first role that fails, named ``model.<role>``."""
    for role in ("actor", "critic", "ref", "reward"):
        check_architecture(getattr(models, role), f"model.{role}")


@dataclass(frozen=True)
class ModelArgs:
    """Everything needed to build a :class:`LlamaModel`: ``LlamaConfig`` fields plus extras."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    value_head: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None  # None: hidden_size // num_heads

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.dim_per_head % 2:
            raise ValueError("rotary embeddings need an even head dimension")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @classmethod
    def from_llama_config(cls, cfg: LlamaConfig, **extra) -> "ModelArgs":
        """Take the dimensions of ``cfg`` (a ``LlamaConfig`` or a DictConfig of one) plus ``extra``
        (``rope_theta``, ``rms_norm_eps``, ``head_dim``, or overrides such as ``value_head``).
        Raises :class:`ConfigError` for an architecture other than LLaMA's (:func:`check_architecture`)."""
        check_architecture(cfg)
        fields = {f.name for f in dataclasses.fields(cls)}
        base = {name: getattr(cfg, name) for name in fields if name not in extra and hasattr(cfg, name)}
        return cls(**base, **extra)


def load_llama_config(name_or_path: str | Path) -> LlamaConfig:
    """Read ``conf/llama/<name>.yaml`` (or a YAML path) into a :class:`LlamaConfig`."""
    from omegaconf import OmegaConf

    import conf

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = Path(conf.__file__).parent / "llama" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no LLaMA config at {path}")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    raw.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LlamaConfig), raw))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight is left undrawn (on the ambient device: meta while a module is
    being laid out). Every module here is built on the meta device and filled by
    :func:`init_values` or a loader, so ``nn.Embedding``'s own ``normal_`` init would be wasted; on
    the meta device it is also costly, as torch 2.x runs it through its Python reference kernels, whose
    first call imports ``torch._dynamo`` (about 1.3 s in a process that has not imported it: the Ray
    driver, which builds the initial weights it digests)."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


def rotary(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate ``x`` (B, heads, T, D) by angle ``pos * theta^(-2i/D)`` in the plane of dims (i, i + D/2)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions[:, None, :, None].float() * inv_freq  # (B, 1, T, D/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class KVCache:
    """Key/value cache with one slot per sequence: per layer, buffers (slots, kv_heads, capacity, D).

    ``lengths[s]`` tokens of slot ``s`` are cached. A forward with ``cache`` and ``slots`` writes the
    new keys/values after them and attends to everything cached; the caller then calls
    :meth:`advance` once per pass (after the last pipeline stage). Capacity doubles on demand.
    """

    def __init__(self, num_slots: int, capacity: int = 64):
        self.num_slots = num_slots
        self.capacity = capacity
        self.lengths = torch.zeros(num_slots, dtype=torch.long)
        self.layers: dict[int, tuple[Tensor, Tensor]] = {}

    def _buffers(self, layer: int, like: Tensor, needed: int) -> tuple[Tensor, Tensor]:
        if layer not in self.layers:
            shape = (self.num_slots, like.shape[1], self.capacity, like.shape[3])
            self.layers[layer] = (like.new_zeros(shape), like.new_zeros(shape))
        k_buf, v_buf = self.layers[layer]
        if needed > k_buf.shape[2]:
            cap = max(needed, 2 * k_buf.shape[2])
            pad = (0, 0, 0, cap - k_buf.shape[2])
            k_buf, v_buf = F.pad(k_buf, pad), F.pad(v_buf, pad)
            self.layers[layer] = (k_buf, v_buf)
        return k_buf, v_buf

    def update(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store ``k, v`` (B, KV, T, D) of rows ``slots``; return all keys, values (B, KV, L, D) and
        the (B, 1, T, L) mask of keys each new query may see (causal over cached + new)."""
        start = self.lengths.to(slots.device)[slots]  # (B,)
        t = k.shape[2]
        pos = start[:, None] + torch.arange(t, device=k.device)  # (B, T)
        total = int(pos.max()) + 1
        k_buf, v_buf = self._buffers(layer, k, total)
        k_buf[slots[:, None], :, pos] = k.transpose(1, 2)
        v_buf[slots[:, None], :, pos] = v.transpose(1, 2)
        mask = torch.arange(total, device=k.device)[None, None, :] <= pos[:, :, None]
        return k_buf[slots, :, :total], v_buf[slots, :, :total], mask[:, None]

    def advance(self, slots: Tensor, num_new: Tensor | int) -> None:
        self.lengths[slots.cpu()] += torch.as_tensor(num_new).cpu()

    def clear(self, slot: int) -> None:
        self.lengths[slot] = 0

    def export(self, slot: int) -> dict[int, tuple[Tensor, Tensor]]:
        """Copies of the cached (KV, length, D) keys and values of ``slot`` per layer."""
        n = int(self.lengths[slot])
        return {i: (k[slot, :, :n].clone(), v[slot, :, :n].clone()) for i, (k, v) in self.layers.items()}

    def load(self, slot: int, kv: dict[int, tuple[Tensor, Tensor]]) -> None:
        """Put exported keys/values into ``slot`` (replacing what it held)."""
        n = None
        for layer, (k, v) in kv.items():
            k_buf, v_buf = self._buffers(layer, k[None], k.shape[1])
            k_buf[slot, :, : k.shape[1]] = k.to(k_buf)
            v_buf[slot, :, : v.shape[1]] = v.to(v_buf)
            n = k.shape[1]
        self.lengths[slot] = n or 0


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions; query head h reads kv head h // (H/KV)."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id, self.theta = layer_id, args.rope_theta
        self.h, self.kv, self.d = args.num_heads, args.num_kv_heads, args.dim_per_head
        self.wq = nn.Linear(args.hidden_size, self.h * self.d, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.kv * self.d, bias=False)
        self.wv = nn.Linear(args.hidden_size, self.kv * self.d, bias=False)
        self.wo = nn.Linear(self.h * self.d, args.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None,
                cache: KVCache | None, slots: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv, self.d).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv, self.d).transpose(1, 2)
        q, k = rotary(q, positions, self.theta), rotary(k, positions, self.theta)
        if cache is not None:
            k, v, mask = cache.update(self.layer_id, slots, k, v)
        rep = self.h // self.kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.h * self.d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer 2020; Touvron et al. 2023 section 2.2)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w_gate = nn.Linear(args.hidden_size, args.ffn_hidden_size, bias=False)
        self.w_up = nn.Linear(args.hidden_size, args.ffn_hidden_size, bias=False)
        self.w_down = nn.Linear(args.ffn_hidden_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer_id)
        self.mlp_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, positions, mask, cache, slots):
        h = x + self.attn(self.attn_norm(x), positions, mask, cache, slots)
        return h + self.mlp(self.mlp_norm(h))


def build_positions_and_mask(shape: tuple[int, int], device, attention_mask: Tensor | None,
                             segment_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Positions (B, T) and the (B, 1, T, T) boolean attention mask of a batch without a cache.

    ``attention_mask`` (B, T), 1 for real tokens, covers right- or left-padded batches (positions
    count real tokens); ``segment_ids`` (B, T) packs several sequences per row (positions restart
    and attention stays inside a segment). Every query sees itself, so padded rows give no NaNs.
    """
    b, t = shape
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None]
    if segment_ids is not None:
        seg = segment_ids.to(device)
        same = seg[:, :, None] == seg[:, None, :]
        start = torch.ones_like(seg, dtype=torch.bool)
        start[:, 1:] = seg[:, 1:] != seg[:, :-1]
        idx = torch.arange(t, device=device).expand(b, t)
        seg_start = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
        return idx - seg_start, (causal & same)[:, None]
    if attention_mask is None:
        return torch.arange(t, device=device).expand(b, t), causal[:, None]
    valid = attention_mask.to(device).bool()
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    mask = causal & valid[:, None, :]
    mask |= torch.eye(t, dtype=torch.bool, device=device)[None]
    return positions, mask[:, None]


class PipelineStage(nn.Module):
    """Layers ``[start_layer, end_layer)`` of a model, plus the embedding if first and the final
    norm + head if last. Input is token ids (first stage) or hidden states (B, T, hidden); output
    is hidden states, logits (B, T, vocab) or values (B, T) (value head)."""

    def __init__(self, args: ModelArgs, start_layer: int, end_layer: int, embed: nn.Embedding | None,
                 layers: dict[str, DecoderLayer], norm: RMSNorm | None, head: nn.Linear | None):
        super().__init__()
        if not 0 <= start_layer <= end_layer <= args.num_layers:
            raise ValueError(f"bad layer range [{start_layer}, {end_layer}) for {args.num_layers} layers")
        if (norm is None) != (head is None):
            raise ValueError("the final norm and the head go together")
        self.args, self.start_layer, self.end_layer = args, start_layer, end_layer
        self.embed = embed
        self.layers = nn.ModuleDict(layers)
        self.norm, self.head = norm, head

    @property
    def has_embedding(self) -> bool:
        return self.embed is not None

    @property
    def has_head(self) -> bool:
        return self.head is not None

    def forward(self, x: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, cache: KVCache | None = None,
                slots: Tensor | None = None, output_index: Tensor | None = None) -> Tensor:
        """``cache``/``slots``: decode against a :class:`KVCache` (right padding only, via
        ``attention_mask``; call ``cache.advance(slots, attention_mask.sum(1))`` after the pass).
        ``output_index`` (B,): run the head on that position of each row only (output (B, vocab)
        or (B,)), as generation needs just the last token's logits."""
        b, t = x.shape[:2]
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("packed sequences (segment_ids) are not supported with a KV cache")
            if attention_mask is not None and (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
                raise ValueError("with a KV cache, batches must be right-padded")
            slots = torch.arange(b) if slots is None else slots.long()
            mask = None
            if positions is None:
                start = cache.lengths[slots.cpu()].to(x.device)
                positions = start[:, None] + torch.arange(t, device=x.device)
            slots = slots.to(x.device)
        else:
            default_pos, mask = build_positions_and_mask((b, t), x.device, attention_mask, segment_ids)
            positions = default_pos if positions is None else positions
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h, positions, mask, cache, slots)
        if self.head is None:
            return h
        if output_index is not None:
            h = h[torch.arange(b, device=h.device), output_index.to(h.device)]
        out = self.head(self.norm(h))
        return out.squeeze(-1) if self.args.value_head else out


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges, earlier stages taking the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        end = start + base + (s < extra)
        bounds.append((start, end))
        start = end
    return bounds


INIT_STD = 0.02
INIT_BLOCK_NUMEL = 1 << 16  # elements (whole rows) drawn from one seeded generator


def init_seed(seed: int, name: str, block: int) -> int:
    """The 63-bit seed of rows block ``block`` of parameter ``name`` (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def init_rows_per_block(shape: tuple[int, ...]) -> int:
    """Rows (along dim 0) of a parameter of ``shape`` drawn per seeded block: whole rows, about
    :data:`INIT_BLOCK_NUMEL` elements; a function of the full shape only, never of a layout."""
    row = 1
    for size in shape[1:]:
        row *= size
    return max(1, INIT_BLOCK_NUMEL // max(row, 1))


def init_values(name: str, shape: tuple[int, ...], seed: int, rows: tuple[int, int] | None = None,
                cols: tuple[int, int] | None = None) -> Tensor:
    """Initial float32 values of rows ``[r0, r1)`` and columns ``[c0, c1)`` (dim 1) of parameter
    ``name`` whose full shape is ``shape``; None = the whole range.

    Norm weights are 1; every other weight is N(0, 0.02^2) (GPT-2 / LLaMA-style init), drawn on the
    CPU in blocks of whole rows, each block from its own generator seeded by (``seed``, ``name``,
    block index). Any slice of a parameter is therefore computed from the blocks it overlaps only,
    and equals the same slice of the whole parameter: a worker materialises its tensor- and
    pipeline-parallel shard without ever holding the full model (at most one block more)."""
    shape = tuple(int(s) for s in shape)
    r0, r1 = rows if rows is not None else (0, shape[0])
    if not 0 <= r0 <= r1 <= shape[0]:
        raise ValueError(f"{name}: rows [{r0}, {r1}) outside {shape}")
    out_shape = (r1 - r0,) + shape[1:]
    if cols is not None:
        c0, c1 = cols
        if len(shape) < 2 or not 0 <= c0 <= c1 <= shape[1]:
            raise ValueError(f"{name}: columns [{c0}, {c1}) outside {shape}")
        out_shape = (r1 - r0, c1 - c0) + shape[2:]
    if name.endswith("norm.weight"):
        return torch.ones(out_shape)
    out = torch.empty(out_shape)
    per = init_rows_per_block(shape)
    for block in range(r0 // per, -(-r1 // per) if r1 > r0 else r0 // per):
        b0, b1 = block * per, min((block + 1) * per, shape[0])
        gen = torch.Generator().manual_seed(init_seed(seed, name, block))
        values = torch.randn((b1 - b0,) + shape[1:], generator=gen).mul_(INIT_STD)
        lo, hi = max(b0, r0), min(b1, r1)
        part = values[lo - b0:hi - b0]
        if cols is not None:
            part = part[:, cols[0]:cols[1]]
        out[lo - r0:hi - r0] = part
    return out


class LlamaModel(PipelineStage):
    """The whole decoder (one stage holding every layer), randomly initialised from ``seed`` by
    :func:`init_values` (the same numbers on any device and in any layout: a sharded replica built
    with :func:`harness.real.parallel.layout.init_local_module` holds exactly the matching slices).
    ``init=False`` leaves memory uninitialised for loaders."""

    def __init__(self, args: ModelArgs, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", init: bool = True):
        with torch.device("meta"):
            layers = {str(i): DecoderLayer(args, i) for i in range(args.num_layers)}
            out_dim = 1 if args.value_head else args.vocab_size
            super().__init__(args, 0, args.num_layers, token_embedding(args.vocab_size, args.hidden_size), layers,
                             RMSNorm(args.hidden_size, args.rms_norm_eps),
                             nn.Linear(args.hidden_size, out_dim, bias=False))
        self.to_empty(device=device)
        self.to(dtype=dtype)
        if init:
            self.reset_parameters(seed)

    def reset_parameters(self, seed: int, names: list[str] | None = None) -> None:
        """Draw the named parameters (default: all) from ``seed`` (:func:`init_values`)."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name in sorted(params if names is None else names):
                p = params[name]
                p.copy_(init_values(name, tuple(p.shape), seed))

    @classmethod
    def from_config(cls, cfg: LlamaConfig, *, seed: int = 0, **extra) -> "LlamaModel":
        return cls(ModelArgs.from_llama_config(cfg, **extra), seed=seed)

    def stage(self, start_layer: int, end_layer: int, has_embedding: bool | None = None,
              has_head: bool | None = None) -> PipelineStage:
        """A stage sharing this model's modules (not a copy) for layers ``[start_layer, end_layer)``."""
        has_embedding = start_layer == 0 if has_embedding is None else has_embedding
        has_head = end_layer == self.args.num_layers if has_head is None else has_head
        layers = {str(i): self.layers[str(i)] for i in range(start_layer, end_layer)}
        return PipelineStage(self.args, start_layer, end_layer, self.embed if has_embedding else None, layers,
                             self.norm if has_head else None, self.head if has_head else None)

    def split(self, num_stages: int) -> list[PipelineStage]:
        return [self.stage(s, e) for s, e in split_layers(self.args.num_layers, num_stages)]
