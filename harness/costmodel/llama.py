"""Parameter, FLOP and byte arithmetic for LLaMA-style decoders (docs/DESIGN.md section 4).

Owns the closed-form counts that every other cost-model module builds on: parameters per
layer / embedding / head, forward FLOPs of a pass, and KV-cache bytes per token. It knows
nothing about hardware.

Architecture facts (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language
Models", Table 2; Touvron et al. 2023, "Llama 2", section 2.2 for grouped-query attention):
pre-norm decoder with RMSNorm (one weight vector per norm, no bias), rotary embeddings (no
parameters), SwiGLU MLP with three matrices (gate, up, down), no biases anywhere, untied
input embedding and LM head. Critic and reward models replace the vocab-sized LM head by a
scalar value head of ``hidden_size`` weights.

Other decoders (OPT: Zhang et al. 2022; GPT-3: Brown et al. 2020; Megatron GPT) differ from LLaMA
in three ways, each a :class:`ModelDims` field whose default is LLaMA's:

* ``mlp``: ``"swiglu"`` (gate, up, down: three ``h x ffn`` matrices) or ``"gelu"`` (up, down: two
  ``h x ffn`` matrices, ffn = 4h in OPT and GPT);
* ``tied_embeddings``: the LM head is the input embedding matrix. Its GEMM still runs (FLOPs and
  the bytes it streams are those of an untied head), but its weights, gradients and optimizer
  state exist once: :func:`num_params` counts them once, and so does a single pipeline stage that
  holds both ends (:mod:`.memory`; with ``pp > 1`` the last stage keeps its own copy, as
  Megatron-LM does). A scalar value head is never tied;
* ``learned_positions``: a ``max_seq_len x hidden_size`` position embedding (counted with the
  input embedding; a lookup, no FLOPs) instead of rotary embeddings (no parameters).

OPT and GPT also have biases in every linear layer and LayerNorm (weight + bias) instead of
RMSNorm; those biases are not counted (under 0.1% of the parameters: ``7h + ffn`` per layer
against ``12 h^2``).

FLOP convention. A matmul with ``P`` weights costs ``2 * P`` FLOPs per token (multiply +
add). Attention scores ``Q K^T`` and the weighted sum ``A V`` each cost ``2 * h`` FLOPs per
(query, key) pair, so ``4 * h * context_len`` FLOPs per token per layer, where
``context_len`` is the *average number of keys a query attends to*:

* causal training / prefill over a sequence of ``s`` tokens: ``context_len = s / 2`` (query
  ``i`` sees ``i + 1`` keys; the mean is ``(s + 1) / 2``, we round to ``s / 2``). This counts
  the work a causal-masked FlashAttention kernel actually does, not the ``s`` that dense
  MFU formulas (e.g. Narayanan et al. SC'21) count;
* one decode step of a sample whose cache holds ``p`` tokens: ``context_len = p``.

Mixture-of-experts decoders (``num_experts > 0``; Shazeer et al. 2017, Fedus et al. 2022; the
Qwen3-MoE models, Yang et al. 2025, "Qwen3 Technical Report", arXiv 2505.09388). The MLP of each of
the last ``num_layers - num_dense_layers`` layers is a router (an ``h x num_experts`` matrix) and
``num_experts`` routed experts, each an MLP of ``moe_ffn_hidden_size`` of the model's ``mlp`` kind,
of which each token uses ``num_experts_per_token`` (top-k), plus ``num_shared_experts`` experts of
the same width that every token uses. Two parameter counts follow, and each function says which it
counts:

* *stored* (total) parameters: every expert and the router. What weights, gradients, optimizer
  states and memory hold (:func:`params_per_layer`, :func:`matmul_params_per_layer`,
  :func:`num_params`);
* *active* parameters: the top-k routed experts, the shared experts and the router. What a token's
  FLOPs follow (:func:`active_matmul_params_per_layer`, :func:`num_active_params`,
  :func:`forward_flops`).

A decode step streams only the experts its tokens touch (:func:`expected_experts_touched`, under
uniform routing); prefill and training stream all of them. With ``num_dense_layers`` leading dense
layers, the per-layer counts are averages over all layers (dense and MoE), so that ``num_layers x
per-layer`` and a pipeline stage's ``layers x per-layer`` keep their meaning; a stage's true count
differs by where its layers sit. Dense models are unchanged: every function returns what it returned
before for ``num_experts = 0``.

Multi-head latent attention (``kv_lora_rank > 0``; DeepSeek-AI 2024, "DeepSeek-V2", arXiv 2405.04434,
section 2.1; DeepSeek-V3, arXiv 2412.19437, section 2.1.1). Each token's keys and values are
up-projected from one ``kv_lora_rank``-wide latent, which the KV cache holds with a
``qk_rope_head_dim``-wide rotary key shared by the heads; queries pass through a
``q_lora_rank``-wide latent. Each head's query and key are ``head_dim`` (DeepSeek's
``qk_nope_head_dim``) + ``qk_rope_head_dim`` wide, its value ``v_head_dim``. Parameters follow from
the projections (:func:`_attention_params`); the cache from the latent
(:meth:`ModelDims.kv_cache_width`, on every tensor-parallel rank); attention FLOPs from the
up-projected widths in prefill and training (:attr:`ModelDims.attention_width`) and from the latent
in a decode step, whose up-projections are absorbed (:attr:`ModelDims.decode_attention_width`).

Hot paths (the generation simulator calls the cost model ~1e5 times per iteration) must not
re-read configs: :meth:`ModelDims.of` turns any config into a small frozen, hashable record,
and the derived counts are memoised per record with :func:`functools.lru_cache`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from omegaconf import DictConfig

from harness.core.config import mla_config_problem, moe_config_problem

# Bytes per element of the bf16/fp16 tensors we store weights, activations and KV in.
BF16_BYTES = 2

# MLP variants (``ModelDims.mlp``, ``LlamaConfig.mlp``) and their number of ``h x ffn`` matrices.
MLP_MATRICES = {"swiglu": 3, "gelu": 2}
MLP_KINDS = tuple(MLP_MATRICES)


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of one decoder, hashable so derived counts can be memoised."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int = 32000
    value_head: bool = False
    mlp: str = "swiglu"  # "swiglu" (LLaMA) or "gelu" (OPT, GPT); see the module docstring
    tied_embeddings: bool = False  # LM head = input embedding (OPT, Megatron GPT)
    learned_positions: bool = False  # max_seq_len x hidden position embedding (OPT, GPT)
    max_seq_len: int = 4096  # only counted with learned_positions
    head_size: int = 0  # LlamaConfig.head_dim; 0: hidden_size // num_heads
    # mixture of experts (module docstring; LlamaConfig's fields of the same names); 0: dense
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_token: int = 0  # top-k
    moe_ffn_hidden_size: int = 0  # one expert's MLP width (LlamaConfig: None = 0)
    num_shared_experts: int = 0  # always-active experts of the same width
    num_dense_layers: int = 0  # leading layers with a dense MLP of ffn_hidden_size
    # multi-head latent attention (module docstring; LlamaConfig's fields of the same names); 0: standard
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0  # 0: head_dim

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return self.num_layers - self.num_dense_layers if self.num_experts > 0 else 0

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return self.num_moe_layers > 0

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP is gated (SwiGLU: gate and up projections), as Vidur's ``use_gated_mlp``."""
        return self.mlp == "swiglu"

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank > 0``, module docstring)."""
        return self.kv_lora_rank > 0

    @property
    def q_dim(self) -> int:
        """Width of the Q projection: ``num_heads * head_dim``, ``hidden_size`` unless the model sets
        its own head width; with latent attention each head's query also carries its rotary part."""
        return self.num_heads * (self.head_dim + self.qk_rope_head_dim)

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection: ``num_kv_heads * head_dim``; with latent
        attention, the mean of the up-projected keys' and values' widths (all heads)."""
        if self.is_mla:
            return self.num_heads * (self.head_dim + self.qk_rope_head_dim + (self.v_head_dim or self.head_dim)) / 2
        return self.num_kv_heads * self.head_dim

    @property
    def attention_width(self) -> float:
        """The attention core's FLOPs per (query, key) pair are ``4 x`` this: ``q_dim`` (scores and
        the weighted sum, ``2 x q_dim`` each); with latent attention computed on up-projected keys
        and values (prefill, training), ``heads x (qk width + v width) / 2``."""
        if self.is_mla:
            return self.num_heads * (self.head_dim + self.qk_rope_head_dim + (self.v_head_dim or self.head_dim)) / 2
        return self.q_dim

    @property
    def decode_attention_width(self) -> float:
        """:attr:`attention_width` of a decode step. With latent attention, decode runs on the
        cached latents with the up-projections absorbed into the query and output (DeepSeek-V2
        section 2.1.2, as vLLM's and SGLang's MLA kernels do): scores over ``kv_lora_rank +
        qk_rope_head_dim`` and the weighted sum over ``kv_lora_rank`` per head."""
        if self.is_mla:
            return self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) / 2
        return self.q_dim

    @property
    def kv_cache_heads(self) -> int:
        """How many ways tensor parallelism can shard the KV cache (its KV heads; replicated beyond):
        ``num_kv_heads``; 1 with latent attention, whose one latent per token every head reads."""
        return 1 if self.is_mla else self.num_kv_heads

    def kv_cache_width(self, tp: int = 1) -> int:
        """Elements one token's KV cache holds per layer on one of ``tp`` ranks: K and V of its
        ``max(1, num_kv_heads // tp)`` KV heads; with latent attention, the ``kv_lora_rank`` latent
        and the ``qk_rope_head_dim`` rotary key, on every rank."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim

    @staticmethod
    def of(cfg: Any) -> "ModelDims":
        """A :class:`ModelDims` from a ``LlamaConfig`` dataclass, an OmegaConf ``DictConfig``
        or a mapping. ``ModelDims`` passes through unchanged (the fast path).

        Reading a config costs microseconds (tens for a ``DictConfig``), so configs other than
        plain dicts are memoised by object identity (a strong reference is kept, so an id is never reused while cached). Model
        configs are treated as immutable once they have been handed to the cost model.
        """
        if type(cfg) is ModelDims:
            return cfg
        if not isinstance(cfg, dict):  # DictConfig or LlamaConfig dataclass: memoise by identity
            hit = _DICTCONFIG_CACHE.get(id(cfg))
            if hit is not None and hit[0] is cfg:
                return hit[1]
            dims = _dims_from(cfg)
            if len(_DICTCONFIG_CACHE) >= _DICTCONFIG_CACHE_MAX:
                _DICTCONFIG_CACHE.clear()
            _DICTCONFIG_CACHE[id(cfg)] = (cfg, dims)
            return dims
        return _dims_from(cfg)


_DICTCONFIG_CACHE: dict[int, tuple[Any, ModelDims]] = {}
_DICTCONFIG_CACHE_MAX = 1024


_FIELD_TYPES = {"name": str, "value_head": bool, "mlp": str, "tied_embeddings": bool,
                "learned_positions": bool}
_FIELD_TYPES.update(
    {f.name: int for f in dataclasses.fields(ModelDims) if f.name not in _FIELD_TYPES}
)


def _dims_from(cfg: Any) -> ModelDims:
    get = cfg.get if isinstance(cfg, (dict, DictConfig)) else lambda k, d=None: getattr(cfg, k, d)
    values = {}
    for f in dataclasses.fields(ModelDims):
        if f.name == "head_size":  # a config's head_dim (None or absent: derived from the width)
            values[f.name] = int(get("head_dim", None) or get("head_size", 0) or 0)
            continue
        if f.name in ("moe_ffn_hidden_size", "v_head_dim"):  # None or absent: unset (dense; the head width)
            values[f.name] = int(get(f.name, None) or 0)
            continue
        value = get(f.name, f.default)
        if value is dataclasses.MISSING or value == "???":
            raise ValueError(f"model config lacks required field {f.name!r}: {cfg!r}")
        values[f.name] = _FIELD_TYPES[f.name](value)
    dims = ModelDims(**values)
    if dims.mlp not in MLP_MATRICES:
        raise ValueError(f"model {dims.name!r}: mlp={dims.mlp!r} is not one of {', '.join(MLP_KINDS)} "
                         f"(swiglu: LLaMA's gate/up/down; gelu: OPT/GPT's up/down)")
    if (not dims.head_size and dims.hidden_size % dims.num_heads) or dims.num_heads % dims.num_kv_heads:
        raise ValueError(
            f"model {dims.name!r}: hidden_size {dims.hidden_size} must divide into "
            f"{dims.num_heads} heads (or head_dim be set), and heads into {dims.num_kv_heads} kv heads"
        )
    problem = moe_config_problem(dims) or mla_config_problem(dims)
    if problem:
        raise ValueError(f"model {dims.name!r}: {problem}")
    return dims


# ----------------------------------------------------------------------------------------
# Parameter counts
# ----------------------------------------------------------------------------------------


def _attention_params(d: ModelDims) -> int:
    """W_q: h x q_dim, W_o: q_dim x h; W_k, W_v: h x kv_dim. Latent attention (DeepSeek-V2 section
    2.1.2): W_DQ (h x q_lora_rank) and W_UQ (q_lora_rank x q_dim), or W_Q (h x q_dim) without a query
    latent; W_DKV with the rotary key (h x (kv_lora_rank + qk_rope_head_dim)); W_UK and W_UV
    (kv_lora_rank x heads x (head_dim + v_head_dim)); W_O (heads x v_head_dim x h)."""
    h = d.hidden_size
    if d.is_mla:
        query = d.q_lora_rank * (h + d.q_dim) if d.q_lora_rank else h * d.q_dim
        v_dim = d.num_heads * (d.v_head_dim or d.head_dim)
        return (query + h * (d.kv_lora_rank + d.qk_rope_head_dim)
                + d.kv_lora_rank * (d.num_heads * d.head_dim + v_dim) + v_dim * h)
    return 2 * h * d.q_dim + 2 * h * d.kv_dim


def norm_params_per_layer(d: ModelDims) -> int:
    """Norm weight vectors of one layer: before attention and before the MLP (``h`` each), and with
    latent attention those of the query and KV latents."""
    return 2 * d.hidden_size + (d.q_lora_rank + d.kv_lora_rank if d.is_mla else 0)


def _dense_layer_matmul_params(d: ModelDims) -> int:
    """Matmul weights of a layer with a dense MLP: attention, and the MLP's gate, up (h x ffn) and
    down (ffn x h) for SwiGLU, up and down for GeLU."""
    return _attention_params(d) + MLP_MATRICES[d.mlp] * d.hidden_size * d.ffn_hidden_size


def _per_layer(d: ModelDims, dense_layer: float, moe_layer: float) -> float:
    """The average over all layers of a count that is ``dense_layer`` in each dense-MLP layer and
    ``moe_layer`` in each MoE layer (an integer where it divides evenly)."""
    total = d.num_moe_layers * moe_layer + (d.num_layers - d.num_moe_layers) * dense_layer
    return total // d.num_layers if total % d.num_layers == 0 else total / d.num_layers


def expert_params(m: Any) -> int:
    """Weights of one expert (routed or shared): an MLP of ``moe_ffn_hidden_size`` of the model's
    ``mlp`` kind (0 for a dense model)."""
    d = ModelDims.of(m)
    return MLP_MATRICES[d.mlp] * d.hidden_size * d.moe_ffn_hidden_size if d.is_moe else 0


def router_params(m: Any) -> int:
    """Weights of one MoE layer's router: ``hidden_size x num_experts`` (0 for a dense model)."""
    d = ModelDims.of(m)
    return d.hidden_size * d.num_experts if d.is_moe else 0


def _moe_layer_matmul_params(d: ModelDims, routed_experts: float) -> float:
    """Matmul weights of one MoE layer with ``routed_experts`` of its routed experts: attention,
    router, shared experts and those routed experts."""
    return (_attention_params(d) + router_params(d)
            + (d.num_shared_experts + routed_experts) * expert_params(d))


@lru_cache(maxsize=None)
def _matmul_params_per_layer(d: ModelDims) -> float:
    if not d.is_moe:
        return _dense_layer_matmul_params(d)
    return _per_layer(d, _dense_layer_matmul_params(d), _moe_layer_matmul_params(d, d.num_experts))


@lru_cache(maxsize=None)
def _active_matmul_params_per_layer(d: ModelDims) -> float:
    if not d.is_moe:
        return _matmul_params_per_layer(d)
    return _per_layer(d, _dense_layer_matmul_params(d), _moe_layer_matmul_params(d, d.num_experts_per_token))


def matmul_params_per_layer(m: Any) -> float:
    """Stored weights of one layer that take part in matmuls (everything but the norm vectors):
    every expert of a MoE layer and its router. Averaged over the layers when some are dense-MLP
    layers and others MoE (module docstring)."""
    return _matmul_params_per_layer(ModelDims.of(m))


def active_matmul_params_per_layer(m: Any) -> float:
    """Matmul weights one token passes through in one layer: :func:`matmul_params_per_layer` of a
    dense model; attention, router, shared and top-k routed experts of a MoE layer (averaged over the
    layers like :func:`matmul_params_per_layer`). What FLOPs count."""
    return _active_matmul_params_per_layer(ModelDims.of(m))


def routed_expert_params_per_layer(m: Any) -> float:
    """Stored weights of the routed experts of one layer, averaged over all layers (0 for a dense
    model): the part of :func:`matmul_params_per_layer` that expert parallelism splits over ep ranks
    and that a decode step streams only where its tokens go."""
    d = ModelDims.of(m)
    if not d.is_moe:
        return 0
    return _per_layer(d, 0, d.num_experts * expert_params(d))


def params_per_layer(m: Any) -> float:
    """All stored weights of one decoder layer: attention, MLP (every expert and the router of a MoE
    layer; averaged over the layers when some are dense, module docstring) and two norm weight
    vectors (biases of OPT/GPT LayerNorms and linears not counted; see the module docstring)."""
    d = ModelDims.of(m)
    return _matmul_params_per_layer(d) + norm_params_per_layer(d)


def expected_experts_touched(num_experts: int, experts_per_token: int, num_tokens: float) -> float:
    """Expected number of distinct routed experts that ``num_tokens`` tokens use in one MoE layer when
    each token picks ``experts_per_token`` of ``num_experts`` uniformly at random (uniform routing:
    an expert is missed by one token with probability ``1 - k/E``, by all of them with ``(1 - k/E)^B``):
    ``E (1 - (1 - k/E)^B)``; ``k`` for one token, ``E`` as the tokens grow."""
    if num_tokens <= 0 or num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** num_tokens)


def streamed_matmul_params_per_layer(m: Any, routed_experts: float) -> float:
    """Matmul weights one device reads from HBM per layer when its MoE layers use ``routed_experts``
    of their routed experts (the stored ones but the routed experts left unread; dense layers whole;
    averaged over the layers). :func:`matmul_params_per_layer` at ``routed_experts = num_experts``."""
    d = ModelDims.of(m)
    if not d.is_moe:
        return _matmul_params_per_layer(d)
    return _per_layer(d, _dense_layer_matmul_params(d), _moe_layer_matmul_params(d, routed_experts))


def embedding_params(m: Any) -> int:
    """Input embedding: tokens (``vocab_size x hidden_size``) plus, with ``learned_positions``,
    positions (``max_seq_len x hidden_size``)."""
    d = ModelDims.of(m)
    positions = d.max_seq_len if d.learned_positions else 0
    return (d.vocab_size + positions) * d.hidden_size


def head_params(m: Any) -> int:
    """Weights of the output head's GEMM: the LM head (``vocab x h``; the input embedding
    matrix itself when ``tied_embeddings``) or a scalar value head (``h``). What the head costs
    in FLOPs and streamed bytes; :func:`stored_head_params` is what it adds to the model."""
    d = ModelDims.of(m)
    return d.hidden_size if d.value_head else d.vocab_size * d.hidden_size


def stored_head_params(m: Any) -> int:
    """Parameters the head adds to the model: :func:`head_params`, or 0 for an LM head tied to
    the input embedding (a value head is never tied)."""
    d = ModelDims.of(m)
    return 0 if d.tied_embeddings and not d.value_head else head_params(d)


@lru_cache(maxsize=None)
def _num_params(d: ModelDims) -> int:
    final_norm = d.hidden_size
    if d.is_moe:  # exact: the sum over layers, not num_layers x an average
        return (_layers_params(d, d.num_experts) + embedding_params(d) + final_norm
                + stored_head_params(d))
    return (d.num_layers * params_per_layer(d) + embedding_params(d) + final_norm
            + stored_head_params(d))


def _layers_params(d: ModelDims, routed_experts: int) -> int:
    """Weights of all decoder layers of a MoE model, each MoE layer with ``routed_experts`` routed
    experts (integer arithmetic)."""
    norms = norm_params_per_layer(d)
    dense_layer = _dense_layer_matmul_params(d) + norms
    moe_layer = (_attention_params(d) + router_params(d)
                 + (d.num_shared_experts + routed_experts) * expert_params(d) + norms)
    return d.num_moe_layers * moe_layer + (d.num_layers - d.num_moe_layers) * dense_layer


def num_params(m: Any) -> int:
    """Total (stored) parameters: layers (every expert and router of a MoE model) + embedding
    (+ learned positions) + final norm + head (once when tied to the embedding)."""
    return _num_params(ModelDims.of(m))


def num_active_params(m: Any) -> int:
    """Parameters one token uses: :func:`num_params` of a dense model; with the top-k routed
    experts (plus the shared experts and the router) in place of all of them for a MoE model. The
    embedding and head are counted, as the model cards' "activated parameters" count them."""
    d = ModelDims.of(m)
    if not d.is_moe:
        return num_params(d)
    return _layers_params(d, d.num_experts_per_token) + embedding_params(d) + d.hidden_size + stored_head_params(d)


# ----------------------------------------------------------------------------------------
# FLOPs and bytes
# ----------------------------------------------------------------------------------------


def forward_flops(
    m: Any,
    num_tokens: float,
    context_len: float,
    num_layers: Optional[float] = None,
    include_head: bool = True,
    decode: bool = False,
) -> float:
    """FLOPs of one forward pass over ``num_tokens`` tokens through ``num_layers`` layers
    (all of them when ``None``), each token attending to ``context_len`` keys on average
    (see the module docstring for the convention). Matmuls count the *active* weights
    (:func:`active_matmul_params_per_layer`: a MoE layer's top-k and shared experts and
    router). ``include_head`` adds the LM / value head matmul (tied or not); the embedding
    lookups (tokens, learned positions) cost no FLOPs. A decode step (``decode``) counts the
    attention core by :attr:`ModelDims.decode_attention_width` (latent attention's absorbed form)."""
    d = ModelDims.of(m)
    layers = d.num_layers if num_layers is None else num_layers
    width = d.decode_attention_width if decode else d.attention_width
    per_token_layer = 2.0 * _active_matmul_params_per_layer(d) + 4.0 * width * context_len
    flops = per_token_layer * num_tokens * layers
    if include_head:
        flops += 2.0 * head_params(d) * num_tokens
    return flops


def kv_bytes_per_token(m: Any, dtype_bytes: int = BF16_BYTES) -> int:
    """KV-cache bytes one token occupies over all layers: K and V of ``kv_dim`` each; with latent
    attention its latent and rotary key (:meth:`ModelDims.kv_cache_width`)."""
    d = ModelDims.of(m)
    return d.num_layers * d.kv_cache_width() * dtype_bytes


@lru_cache(maxsize=None)
def activation_io_elems_per_token_layer(d: ModelDims) -> float:
    """Elements of activations read or written from HBM per token per layer in a forward
    pass, assuming each matmul reads its input and writes its output once and the
    attention core is a fused (FlashAttention-style) kernel that keeps scores on chip.

    Our own count: norm 1 (read h, write h), QKV (read h, write q + 2 kv_dim), attention
    core (read q + 2 kv_dim, write q), output projection (read q, write h), residual add
    (read 2h, write h), norm 2 (2h), gate/up (read h, write 2 ffn), SwiGLU (read 2 ffn,
    write ffn), down (read ffn, write h), residual add (3h); ``q`` is the query width
    (``h`` unless the model sets its own head width). A GeLU MLP: up (read h, write
    ffn), GeLU (read ffn, write ffn), down (read ffn, write h). A MoE layer's MLP block:
    :func:`_moe_mlp_io_elems`; averaged over the layers when some are dense.
    """
    h, kv, f, q = d.hidden_size, d.kv_dim, d.ffn_hidden_size, d.q_dim
    attention_block = 2 * h + (h + q + 2 * kv) + (2 * q + 2 * kv) + (q + h) + 3 * h
    if d.gated_mlp:
        mlp_block = 2 * h + (h + 2 * f) + 3 * f + (f + h) + 3 * h
    else:
        mlp_block = 2 * h + (h + f) + 2 * f + (f + h) + 3 * h
    if d.is_moe:
        return _per_layer(d, attention_block + mlp_block, attention_block + _moe_mlp_io_elems(d))
    return attention_block + mlp_block


def _moe_mlp_io_elems(d: ModelDims) -> int:
    """Activation elements one token reads or writes in a MoE layer's MLP block (our count, as
    :func:`activation_io_elems_per_token_layer`): norm (2h), router (read h, write E logits),
    dispatch (read h, write k copies), each of the k routed and S shared experts' MLP of width
    ``f_e`` (gate/up, activation, down, as the dense MLP's), combine (read k h, write h) and the
    residual add (3h)."""
    h, f, k = d.hidden_size, d.moe_ffn_hidden_size, d.num_experts_per_token
    if d.gated_mlp:
        expert = (h + 2 * f) + 3 * f + (f + h)
    else:
        expert = (h + f) + 2 * f + (f + h)
    return (2 * h + (h + d.num_experts) + (h + k * h) + (k + d.num_shared_experts) * expert
            + (k * h + h) + 3 * h)


# ----------------------------------------------------------------------------------------
# Expert parallelism
# ----------------------------------------------------------------------------------------


def expert_parallel_problem(m: Any, ep: int) -> Optional[str]:
    """Why ``m`` cannot run with expert-parallel degree ``ep``, or None: ep > 1 needs a
    mixture-of-experts model whose routed experts ``ep`` divides (each rank holds ``num_experts /
    ep`` of every MoE layer's experts; Megatron-core asserts the same)."""
    d = ModelDims.of(m)
    if not isinstance(ep, int) or ep < 1:
        return f"ep={ep!r} must be an integer >= 1"
    if ep == 1:
        return None
    if not d.is_moe:
        return f"ep={ep} needs a mixture-of-experts model, and {d.name} is dense (num_experts=0); use ep=1"
    if d.num_experts % ep:
        return (f"ep={ep} does not divide {d.name}'s num_experts={d.num_experts} (each expert-parallel rank "
                f"holds num_experts / ep experts of every MoE layer)")
    return None


def local_experts_streamed(m: Any, tokens_per_rank: float, ep: int = 1, decode: bool = False) -> float:
    """Routed experts of one MoE layer whose weights one device reads in one pass of
    ``tokens_per_rank`` tokens (each of the ``ep`` ranks of its expert-parallel group passing as
    many): all ``num_experts / ep`` of its own in prefill and training (tokens far outnumber
    experts), and in a decode step (``decode``) its share of the experts the group's
    ``ep x tokens_per_rank`` tokens touch under uniform routing (:func:`expected_experts_touched`)."""
    d = ModelDims.of(m)
    if not d.is_moe:
        return 0.0
    if not decode:
        return d.num_experts / ep
    return expected_experts_touched(d.num_experts, d.num_experts_per_token, ep * tokens_per_rank) / ep


def moe_dispatch_bytes(m: Any, num_tokens: float, dtype_bytes: int = BF16_BYTES) -> float:
    """Bytes of one device's buffer in one all-to-all of a MoE layer (the dispatch of its
    ``num_tokens`` tokens' hidden states to their top-k experts' ranks, or the combine that brings
    them back): ``num_tokens x k x h x dtype_bytes``. Under uniform routing ``(ep - 1) / ep`` of it
    leaves the device (:func:`harness.costmodel.comm.alltoall_s` applies that factor). 0 for a
    dense model."""
    d = ModelDims.of(m)
    if not d.is_moe or num_tokens <= 0:
        return 0.0
    return num_tokens * d.num_experts_per_token * d.hidden_size * dtype_bytes
