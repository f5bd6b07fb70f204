"""Per-device memory footprints, in GB of 1e9 bytes (docs/DESIGN.md section 4, "Memory").

Owns the sizes a planner checks against HBM capacity: inference weights, training state
(weights, gradients, optimizer states, with ZeRO sharding), activations kept for the
backward pass, and the KV cache. Every function returns the footprint of the *most loaded*
device of its layout.

Layout assumptions. Model parallelism (``tp * pp``) splits the model first: ``pp`` stages of
``num_layers / pp`` layers each (uniform, possibly fractional), the input embedding on the
first stage, the final norm and head on the last; each stage is split evenly over ``tp``
ranks (Megatron-LM also shards the embedding and LM head over tp; the few norm vectors that
are in truth replicated are divided too -- negligible). Data-parallel ZeRO sharding then
divides what it shards over ``dp``. An LM head tied to the input embedding
(``tied_embeddings``: OPT, Megatron GPT) is held once when one stage has both ends (``pp = 1``);
with ``pp > 1`` the last stage keeps its own copy of the matrix, with its own gradients and
optimizer state (Megatron-LM's ``initialize_word_embeddings``, whose gradients are all-reduced
between the first and last stage), so the heaviest stage is as if untied.

Training state follows the ZeRO paper (Rajbhandari et al., SC'20, section 3.1): mixed-
precision Adam keeps 2 bytes/param of bf16 weights, 2 of bf16 gradients and K = 12 of fp32
master weights, momentum and variance. ZeRO-1 shards the 12, ZeRO-2 also the gradients,
ZeRO-3 the weights as well. ZeRO-Offload (Ren et al., ATC'21, section 4) moves the 12 to host
memory and with them the gradients: each reduced gradient bucket is copied to the host, so the
device keeps only the bucket being reduced (``OFFLOAD_GRAD_BUCKET_PARAMS``), not the gradients.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Table 2 (bytes per layer, ``s`` sequence, ``b`` micro-batch, ``h``
hidden, ``a`` heads, ``t`` tensor-parallel size). Their coefficients are derived for GPT
(4h GeLU MLP, dropout); we apply them to LLaMA (``mlp="swiglu"``) unchanged as an
approximation (SwiGLU with ffn ~ 8h/3 stores a similar amount, and LLaMA has no dropout masks,
so this errs high). For a GeLU MLP (``mlp="gelu"``) we keep their derivation but with the
model's ``f = ffn_hidden_size`` in place of ``4h`` (the GeLU input and the second linear's input
are ``2 s b f`` bytes each): the tensor-parallel part ``24 s b h`` becomes ``8 s b h + 4 s b f``,
exactly their numbers when ``f = 4h`` (OPT, GPT).
Pipeline schedules multiply these per-micro-batch numbers by the micro-batches in flight;
that is the schedule simulator's job, not this module's.

Mixture-of-experts models (:mod:`.llama`) hold every expert: weights, gradients and optimizer
states count the total parameters. Expert parallelism (``ep``; Megatron-core's convention) splits
each MoE layer's routed experts over ``ep`` ranks carved from the data-parallel group, each expert
further sharded over the ``tp`` ranks (expert tensor parallelism = tp): routed-expert weights per
device are ``/ (ep * tp)``, the rest ``/ tp`` as for a dense model. Each expert is then replicated
on ``dp / ep`` ranks (the expert-data-parallel group), which is what ZeRO shards the experts'
states over (the dense parts' over ``dp``), so under ZeRO-1/2/3 the sharded states per device are
the same as at ep = 1 and ep saves what ZeRO leaves whole. With expert tensor parallelism ``etp``
(Megatron-core's ``expert_tensor_parallel_size``, :class:`harness.core.plan.ParallelStrategy`)
each expert is split over ``etp`` ranks instead of ``tp``: routed-expert weights per device are
``/ (ep * etp)`` and replicated on ``dp * tp / (ep * etp)`` ranks; ``etp=None`` is ``etp = tp``.
Per-layer counts are averages over the layers (:mod:`.llama`). The activation coefficients above
are kept for MoE layers (the SwiGLU ones, which do not depend on the MLP width): the k copies of a
token through its experts are not counted separately.
"""
from __future__ import annotations

from typing import Any, Optional

from harness.costmodel.llama import (
    BF16_BYTES,
    ModelDims,
    embedding_params,
    head_params,
    kv_bytes_per_token,
    params_per_layer,
    routed_expert_params_per_layer,
    stored_head_params,
)

GB = 1e9

# ZeRO paper (Rajbhandari et al. SC'20), mixed-precision Adam: bytes per parameter.
WEIGHT_BYTES = 2  # bf16 weights
GRAD_BYTES = 2  # bf16 gradients
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam momentum + variance ("K = 12")
# ZeRO-Offload's gradient buffer on the device: DeepSpeed's default ``reduce_bucket_size``, 5e8
# elements (deepspeed.ai/docs/config-json, "zero_optimization"), which neither DeepSpeed-Chat nor
# OpenRLHF change. Gradients beyond one bucket leave the device as they are reduced.
OFFLOAD_GRAD_BUCKET_PARAMS = 5e8

# Logits are kept in fp32 for a numerically stable softmax / cross-entropy.
LOGIT_BYTES = 4

RECOMPUTE_MODES = ("none", "selective", "full")


def max_stage_params(model: Any, pp: int = 1, ep: int = 1) -> float:
    """Parameters of the heaviest of ``pp`` uniform pipeline stages (before tp sharding) that one
    device of an expert-parallel group of ``ep`` holds: its stage's share of the routed experts is
    ``1 / ep`` (every expert at ep = 1). A tied LM head counts once at ``pp = 1`` and as the last
    stage's own copy at ``pp > 1``."""
    d = ModelDims.of(model)
    layers = d.num_layers / pp * params_per_layer(d)
    if ep != 1:
        layers -= stage_expert_params(d, pp) * (ep - 1) / ep
    first = embedding_params(d)
    if pp == 1:
        return layers + first + (d.hidden_size + stored_head_params(d))  # final norm + head
    last = d.hidden_size + head_params(d)  # final norm + head (a tied head's copy)
    return layers + max(first, last)


def stage_expert_params(model: Any, pp: int = 1) -> float:
    """Routed-expert parameters of one of ``pp`` uniform pipeline stages, all its experts (before
    ep and tp sharding; 0 for a dense model)."""
    d = ModelDims.of(model)
    return d.num_layers / pp * routed_expert_params_per_layer(d)


def expert_shards(tp: int, ep: int, etp: Optional[int] = None) -> int:
    """The devices one MoE layer's routed experts are split over: ``ep`` ranks, each expert over
    ``etp`` (``tp`` when None) of them."""
    return ep * (tp if etp is None else etp)


def expert_replicas(dp: int, tp: int, ep: int, etp: Optional[int] = None) -> int:
    """The ranks of one stage that hold the same expert shard (the expert-data-parallel group):
    ``dp * tp / (ep * etp)``, ``dp / ep`` when ``etp`` is unset."""
    return dp * tp // expert_shards(tp, ep, etp)


def expert_tp_extra_params(expert_params: float, tp: int, ep: int, etp: Optional[int] = None) -> float:
    """Of ``expert_params`` routed-expert parameters, what one device holds beyond its
    ``1 / (ep * tp)`` when each expert is split over ``etp`` ranks rather than ``tp`` (0 when
    ``etp`` is None or ``tp``): its ``1 / (ep * etp)`` in place of ``1 / (ep * tp)``."""
    if etp is None or etp == tp:
        return 0.0
    return expert_params * (1.0 / (ep * etp) - 1.0 / (ep * tp))


def weights_gb(model: Any, tp: int = 1, pp: int = 1, dtype_bytes: int = BF16_BYTES, ep: int = 1,
               etp: Optional[int] = None) -> float:
    """Inference weights on one device (routed experts split over ``ep`` ranks, each over ``etp``)."""
    gb = max_stage_params(model, pp, ep) / tp * dtype_bytes / GB
    if etp is None or etp == tp:
        return gb
    return gb + expert_tp_extra_params(stage_expert_params(model, pp), tp, ep, etp) * dtype_bytes / GB


def expert_weights_gb(model: Any, tp: int = 1, pp: int = 1, ep: int = 1, dtype_bytes: int = BF16_BYTES,
                      etp: Optional[int] = None) -> float:
    """The routed-expert part of :func:`weights_gb` (0 for a dense model)."""
    return stage_expert_params(model, pp) / expert_shards(tp, ep, etp) * dtype_bytes / GB


def training_state_gb(model: Any, dp: int = 1, tp: int = 1, pp: int = 1,
                      zero_stage: int = 0, optimizer_offload: bool = False, ep: int = 1,
                      etp: Optional[int] = None) -> float:
    """Weights + gradients + Adam states on one device under ZeRO stage 0-3. With
    ``optimizer_offload`` (ZeRO-Offload) the Adam states live in host memory and the gradients
    follow them there, one reduce bucket at a time: the device keeps at most one bucket. With
    expert parallelism (``ep``) the routed experts' states are ``/ (ep * etp)`` and ZeRO shards them
    over the ranks that hold the same experts (module docstring)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    if ep != 1:
        return _expert_parallel_state_gb(model, dp, tp, pp, zero_stage, optimizer_offload, ep, etp)
    params = max_stage_params(model, pp) / tp
    weights = WEIGHT_BYTES / (dp if zero_stage >= 3 else 1)
    grads = params * GRAD_BYTES / (dp if zero_stage >= 2 else 1)
    if optimizer_offload:
        return (params * weights + min(grads, OFFLOAD_GRAD_BUCKET_PARAMS * GRAD_BYTES)) / GB
    optimizer = OPTIMIZER_BYTES / (dp if zero_stage >= 1 else 1)
    return (params * (weights + optimizer) + grads) / GB


def _state_bytes(params: float, shards: int, zero_stage: int) -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes of ``params`` parameters that ZeRO at
    ``zero_stage`` shards over ``shards`` ranks."""
    return (params * WEIGHT_BYTES / (shards if zero_stage >= 3 else 1),
            params * GRAD_BYTES / (shards if zero_stage >= 2 else 1),
            params * OPTIMIZER_BYTES / (shards if zero_stage >= 1 else 1))


def _expert_parallel_state_gb(model: Any, dp: int, tp: int, pp: int, zero_stage: int,
                              optimizer_offload: bool, ep: int, etp: Optional[int] = None) -> float:
    experts = stage_expert_params(model, pp)
    dense = (max_stage_params(model, pp) - experts) / tp
    parts = [_state_bytes(dense, dp, zero_stage),
             _state_bytes(experts / expert_shards(tp, ep, etp), expert_replicas(dp, tp, ep, etp), zero_stage)]
    weights, grads, optimizer = (sum(p[i] for p in parts) for i in range(3))
    if optimizer_offload:
        return (weights + min(grads, OFFLOAD_GRAD_BUCKET_PARAMS * GRAD_BYTES)) / GB
    return (weights + grads + optimizer) / GB


def updated_params_per_device(model: Any, dp: int = 1, tp: int = 1, pp: int = 1, zero_stage: int = 0,
                              ep: int = 1, etp: Optional[int] = None) -> float:
    """Parameters whose optimizer step one device runs (the most loaded stage): its stage's /
    tp, further / dp when ZeRO (any stage >= 1) shards the optimizer states; with expert
    parallelism the routed experts' / (ep * etp), sharded over the ranks holding the same experts."""
    if ep == 1:
        return max_stage_params(model, pp) / tp / (dp if zero_stage >= 1 else 1)
    experts = stage_expert_params(model, pp)
    dense = (max_stage_params(model, pp) - experts) / tp / (dp if zero_stage >= 1 else 1)
    replicas = expert_replicas(dp, tp, ep, etp) if zero_stage >= 1 else 1
    return dense + experts / expert_shards(tp, ep, etp) / replicas


def activation_bytes_per_layer(model: Any, micro_batch_size: float, seq_len: float,
                               tp: int = 1, recompute: str = "selective", fused_attention: bool = False) -> float:
    """Korthikanti et al. 2022 (Table 2) activation bytes of one layer, one micro-batch:

    * ``none`` (tensor parallel, no sequence parallel):
      ``s b h (10 + 24/t + 5 a s / (h t))``; with ``fused_attention`` (FlashAttention-style
      kernels, which never write the ``a s^2`` score and softmax matrices to memory; Dao et al.
      2022) the last term is dropped: ``s b h (10 + 24/t)``
    * ``selective`` (attention core recomputed, with sequence parallelism):
      ``34 s b h / t``
    * ``full`` (only each layer's input is kept): ``2 s b h``. With sequence
      parallelism that input would be sharded too (``/ t``); we keep the unsharded, larger
      figure, which is safe for feasibility checks.

    For ``mlp="gelu"`` the ``24`` is ``8 + 4 f / h`` and the ``34`` is ``18 + 4 f / h`` (the
    same at ``f = 4h``; module docstring); SwiGLU models keep the coefficients above.
    """
    d = ModelDims.of(model)
    sbh = seq_len * micro_batch_size * d.hidden_size
    if d.gated_mlp:
        sharded, selective = 24, 34
    else:
        ffn_ratio = d.ffn_hidden_size / d.hidden_size
        sharded, selective = 8 + 4 * ffn_ratio, 18 + 4 * ffn_ratio
    if recompute == "none":
        scores = 0.0 if fused_attention else 5 * d.num_heads * seq_len / (d.hidden_size * tp)
        return sbh * (10 + sharded / tp + scores)
    if recompute == "selective":
        return sbh * selective / tp
    if recompute == "full":
        return 2 * sbh
    raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, not {recompute!r}")


def activation_gb(
    model: Any,
    micro_batch_size: float,
    seq_len: float,
    tp: int = 1,
    num_layers: Optional[float] = None,
    recompute: str = "selective",
    include_logits: bool = False,
    fused_attention: bool = False,
) -> float:
    """Activations one micro-batch keeps for its backward pass on one device, over
    ``num_layers`` layers (all when ``None``). ``include_logits`` adds the last stage's
    fp32 logits (``4 s b v / t`` bytes; ``4 s b`` for a scalar value head); ``fused_attention``:
    :func:`activation_bytes_per_layer`."""
    d = ModelDims.of(model)
    layers = d.num_layers if num_layers is None else num_layers
    total = layers * activation_bytes_per_layer(d, micro_batch_size, seq_len, tp, recompute, fused_attention)
    if include_logits:
        width = 1 if d.value_head else d.vocab_size / tp
        total += LOGIT_BYTES * seq_len * micro_batch_size * width
    return total / GB


def kv_cache_gb(model: Any, num_tokens: float, tp: int = 1, pp: int = 1) -> float:
    """KV cache of ``num_tokens`` cached tokens on one device of a tp x pp instance. Layers
    split over pp; KV heads over at most ``num_kv_heads`` tp ranks (replicated beyond, as
    inference engines do for grouped-query attention); a latent-attention cache on every rank."""
    d = ModelDims.of(model)
    return kv_bytes_per_token(d) * num_tokens / (min(tp, d.kv_cache_heads) * pp) / GB
