"""Roofline time of the compute ops of RLHF on one GPU of a tensor-parallel group
(docs/DESIGN.md section 4, "Compute").

Owns the per-op-class estimates: forward, backward, prefill, decode step and optimizer step.
Each op is reduced to an :class:`OpCost` (FLOPs and HBM bytes *per device*, plus serial
communication seconds) and timed as

    time = max(flops / (peak * matmul_eff), bytes / (hbm_bw * mem_eff)) + comm_s

(Williams, Waterman and Patterson, "Roofline", CACM 2009). Tensor-parallel all-reduces
(Megatron-LM, Shoeybi et al. 2019: two per layer in the forward pass, two in the backward)
sit on the critical path and are added, not overlapped. Kernel-launch overheads and the
imperfect overlap of compute with memory traffic inside one op are not modelled; the
efficiency factors of ``conf/cluster`` absorb part of them.

The architecture enters through :mod:`.llama` (MLP kind, tied head, learned positions): an LM
head tied to the input embedding still runs its GEMM and streams its matrix.

Pipeline parallelism (``pp``) in generation: the batch is split into ``num_mbs = min(pp,
batch)`` micro-batches that chase each other through the ``pp`` stages. In steady state a
decode step of one micro-batch takes ``pp`` stage times, and during it each stage serves
every micro-batch once, so per device and step:

* weights: its stage's weights (``W / (tp pp)``) are streamed once per micro-batch, i.e.
  ``W / tp`` per step when ``num_mbs == pp`` -- pp adds memory, not decode speed;
* KV cache, FLOPs and activations: everything proportional to the batch is divided by
  ``tp * num_mbs`` (``tp * pp`` when the batch fills the pipeline; KV by at most
  ``num_kv_heads`` tp ranks, since grouped-query KV heads are replicated beyond that);
* ``2 * num_layers`` tensor-parallel all-reduces of one micro-batch's hidden states, and
  ``pp - 1`` point-to-point hops between stages.

When the batch is smaller than ``pp`` stages idle; the step time above already includes
that idling. Prefill is treated with the same steady-state formula (pipeline fill/drain of
a one-off prefill is not charged).

Mixture-of-experts models (:mod:`.llama`): FLOPs follow the active parameters; the bytes a pass
streams are the stored weights one device holds, all of them in training and prefill (every local
expert is used), and in a decode step only the routed experts the step's tokens touch under uniform
routing (:func:`~harness.costmodel.llama.local_experts_streamed`; the ``ep`` ranks of an
expert-parallel group are taken to step together with batches of the same size). With expert
parallelism (``ep > 1``: experts split over ``ep`` data-parallel ranks, each expert over ``tp``) a
device holds ``1 / ep`` of the routed experts, and every MoE layer's forward runs two all-to-alls
over the ep group (dispatch and combine, :func:`~harness.costmodel.llama.moe_dispatch_bytes` per
device), the backward two more; they sit on the critical path like the tp all-reduces.
``alltoall_s(bytes, ep, span)`` times one (the caller picks the tier from ``span``, the devices the
ep group lies among: a training layout's from its device order, :func:`ep_group_span`; a generation
instance's ``ep`` instances of ``tp * pp`` devices side by side). A training layout with expert
tensor parallelism ``etp`` (Megatron-core's ``expert_tensor_parallel_size``) splits each expert
over ``etp`` ranks instead: the device holds ``1 / (ep * etp)`` of the routed experts
(:func:`~harness.costmodel.memory.expert_tp_extra_params`) and dispatches ``etp / tp`` of its tp group's tokens
(:func:`moe_alltoalls_s`); its FLOPs, and the tp all-reduces charged per layer, are unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from harness.costmodel.llama import (
    BF16_BYTES,
    ModelDims,
    activation_io_elems_per_token_layer,
    forward_flops,
    head_params,
    kv_bytes_per_token,
    local_experts_streamed,
    moe_dispatch_bytes,
    norm_params_per_layer,
    params_per_layer,
    routed_expert_params_per_layer,
    streamed_matmul_params_per_layer,
)
from harness.costmodel.memory import expert_tp_extra_params

# Mixed-precision Adam touches per parameter: read + write fp32 master weight, m and v
# (3 x 4 x 2 = 24 bytes), read the bf16 gradient (2) and write the bf16 weight copy (2).
# (Byte layout of mixed-precision training: Micikevicius et al., ICLR 2018; Adam state:
# Kingma and Ba 2015.) Its ~10 FLOPs/param run on CUDA cores and never bound the step.
ADAM_BYTES_PER_PARAM = 28

# (num_bytes, group_size) -> seconds
CommFn = Callable[[float, int], float]
# (bytes each rank holds, ep, devices the ep group spans) -> seconds of one all-to-all
AllToAllFn = Callable[[float, int, int], float]


def _no_comm(num_bytes: float, group_size: int) -> float:
    return 0.0


def _no_alltoall(num_bytes: float, ep: int, span: int) -> float:
    return 0.0


def ep_group_span(ep: int, tp: int, ep_span: Optional[int]) -> int:
    """The devices a training pass's ep group lies among, first member to last: ``ep_span``
    where the caller has the layout (:attr:`harness.core.plan.Allocation.ep_span`), else
    ``ep * tp`` (its members' tp groups side by side)."""
    return ep * tp if ep_span is None else ep_span


def moe_alltoalls_s(alltoall_s: AllToAllFn, d: ModelDims, num_layers: float, num_tokens: float, ep: int,
                    span: int, tp: int = 1, etp: Optional[int] = None) -> float:
    """Seconds of the forward all-to-alls of ``num_layers`` layers (their MoE share, the layers
    averaged as in :mod:`.llama`) over ``num_tokens`` tokens per tp group: two per MoE layer
    (dispatch and combine). 0 without expert parallelism. With expert tensor parallelism ``etp``
    below ``tp`` each rank dispatches its own ``etp / tp`` of its tp group's tokens (sequence
    parallelism splits them over the tp ranks, and an expert needs them gathered over only its
    ``etp`` ranks); ``etp`` None or ``tp``: every rank carries the tp group's tokens."""
    if ep <= 1 or not d.is_moe:
        return 0.0
    if etp is not None and etp != tp:
        num_tokens = num_tokens * etp / tp
    moe_layers = num_layers * d.num_moe_layers / d.num_layers
    return 2 * moe_layers * alltoall_s(moe_dispatch_bytes(d, num_tokens), ep, span)


def stored_layer_params(d: ModelDims, ep: int = 1) -> float:
    """Weights of one layer (averaged) that one device of an expert-parallel group of ``ep``
    holds before tp sharding: :func:`~harness.costmodel.llama.params_per_layer` with ``1 / ep`` of
    the routed experts."""
    if ep == 1:
        return params_per_layer(d)
    return params_per_layer(d) - routed_expert_params_per_layer(d) * (ep - 1) / ep


class OpCost(NamedTuple):
    """Work of one op on one device."""

    flops: float
    num_bytes: float
    comm_s: float = 0.0


class Roofline:
    """Roofline timing on one GPU.

    ``allreduce_s(bytes, n)`` times a tensor-parallel all-reduce over ``n`` ranks,
    ``p2p_s(bytes, n)`` a pipeline hop inside an instance of ``n`` devices and
    ``alltoall_s(bytes, ep, span)`` a MoE layer's all-to-all (module docstring); all default
    to free (the caller, :class:`harness.costmodel.model.CostModel`, picks the tier).
    The roofline has no host model: no graph replay overhead, no host time per kernel launch.
    """

    graph_step_overhead_s = 0.0
    host_s_per_launch = 0.0

    def __init__(
        self,
        gpu: Any,
        allreduce_s: Optional[CommFn] = None,
        p2p_s: Optional[CommFn] = None,
        alltoall_s: Optional[AllToAllFn] = None,
    ) -> None:
        self.flops_per_s = float(gpu.peak_bf16_tflops) * 1e12 * float(gpu.matmul_efficiency_frac)
        self.bytes_per_s = float(gpu.hbm_bandwidth_gbps) * 1e9 * float(gpu.memory_efficiency_frac)
        self.stream_s_per_byte = 1.0 / self.bytes_per_s  # streaming rate of elementwise traffic
        self._allreduce_s = allreduce_s or _no_comm
        self._p2p_s = p2p_s or _no_comm
        self._alltoall_s = alltoall_s or _no_alltoall

    # -- timing ---------------------------------------------------------------------------

    def compute_s(self, cost: OpCost) -> float:
        return cost.flops / self.flops_per_s

    def memory_s(self, cost: OpCost) -> float:
        return cost.num_bytes / self.bytes_per_s

    def seconds(self, cost: OpCost) -> float:
        return max(cost.flops / self.flops_per_s, cost.num_bytes / self.bytes_per_s) + cost.comm_s

    def is_memory_bound(self, cost: OpCost) -> bool:
        return self.memory_s(cost) >= self.compute_s(cost)

    # -- training ops ---------------------------------------------------------------------

    def forward_cost(
        self,
        model: Any,
        num_tokens: float,
        context_len: float,
        tp: int = 1,
        num_layers: Optional[float] = None,
        include_head: Optional[bool] = None,
        ep: int = 1,
        ep_span: Optional[int] = None,
        etp: Optional[int] = None,
    ) -> OpCost:
        """A forward pass of ``num_tokens`` through ``num_layers`` layers on one of ``tp``
        ranks. ``include_head`` defaults to whether the pass covers the whole model. ``ep``: the
        expert-parallel degree (a MoE model's all-to-alls and its share of the experts);
        ``ep_span``: the devices the ep group lies among (:func:`ep_group_span`), which set the
        link its all-to-alls take; ``etp``: the ranks each expert is split over (None: ``tp``; the
        FLOPs per device are the same either way)."""
        d = ModelDims.of(model)
        layers = d.num_layers if num_layers is None else num_layers
        if include_head is None:
            include_head = layers >= d.num_layers
        if num_tokens <= 0 or layers <= 0:
            return OpCost(0.0, 0.0, 0.0)
        flops = forward_flops(d, num_tokens, context_len, layers, include_head) / tp
        weights = layers * stored_layer_params(d, ep)  # every local expert is used
        if include_head:
            weights += head_params(d) + d.hidden_size  # head + final norm
        activations = activation_io_elems_per_token_layer(d) * num_tokens * layers
        num_bytes = (weights + activations) * BF16_BYTES / tp
        if etp is not None:
            experts = layers * routed_expert_params_per_layer(d)
            num_bytes += expert_tp_extra_params(experts, tp, ep, etp) * BF16_BYTES
        comm_s = 2 * layers * self._allreduce_s(num_tokens * d.hidden_size * BF16_BYTES, tp)
        if ep > 1:
            comm_s += moe_alltoalls_s(self._alltoall_s, d, layers, num_tokens, ep, ep_group_span(ep, tp, ep_span),
                                      tp, etp)
        return OpCost(flops, num_bytes, comm_s)

    def forward_s(self, model: Any, num_tokens: float, context_len: float, tp: int = 1,
                  num_layers: Optional[float] = None,
                  include_head: Optional[bool] = None, ep: int = 1, ep_span: Optional[int] = None,
                  etp: Optional[int] = None) -> float:
        return self.seconds(
            self.forward_cost(model, num_tokens, context_len, tp, num_layers, include_head, ep, ep_span, etp)
        )

    def backward_s(
        self,
        model: Any,
        num_tokens: float,
        context_len: float,
        tp: int = 1,
        num_layers: Optional[float] = None,
        include_head: Optional[bool] = None,
        recompute: str = "none",
        ep: int = 1,
        ep_span: Optional[int] = None,
        etp: Optional[int] = None,
    ) -> float:
        """Backward pass: twice the forward's compute (input and weight gradients), the
        forward's two all-reduces per layer (and, with expert parallelism, its two all-to-alls per
        MoE layer), plus recomputation (Korthikanti et al. 2022):

        * ``none``: nothing extra;
        * ``selective``: the attention core (scores, softmax, weighted sum) is recomputed,
          charged as its forward FLOPs ``4 h context`` per token per layer;
        * ``full``: a whole extra forward pass, communication included.
        """
        fwd = self.forward_cost(model, num_tokens, context_len, tp, num_layers, include_head, ep, ep_span, etp)
        time_s = 2.0 * (self.seconds(fwd) - fwd.comm_s) + fwd.comm_s
        if recompute == "full":
            time_s += self.seconds(fwd)
        elif recompute == "selective":
            d = ModelDims.of(model)
            layers = d.num_layers if num_layers is None else num_layers
            core_flops = 4.0 * d.attention_width * context_len * num_tokens * layers / tp
            time_s += core_flops / self.flops_per_s
        elif recompute != "none":
            raise ValueError(f"recompute must be none, selective or full, not {recompute!r}")
        return time_s

    def optimizer_step_s(self, params_on_device: float) -> float:
        """Mixed-precision Adam over the parameters this device updates (memory bound)."""
        return self.seconds(OpCost(0.0, ADAM_BYTES_PER_PARAM * params_on_device))

    # -- generation ops -------------------------------------------------------------------

    def _pipelined_cost(
        self, d: ModelDims, batch_tokens: float, context_len: float, kv_tokens: float,
        head_tokens: float, tp: int, pp: int, num_mbs: float, ep: int = 1, decode: bool = False,
    ) -> OpCost:
        """Per-device work of one pass of ``batch_tokens`` (each attending to
        ``context_len`` keys, ``kv_tokens`` KV entries moved through HBM, logits for
        ``head_tokens``) through a tp x pp instance, following the steady-state pipeline
        model of the module docstring; a MoE model's experts split over ``ep`` and, in a decode
        step (``decode``), streamed only where the tokens go."""
        per_mb = tp * num_mbs
        flops = forward_flops(d, batch_tokens, context_len, d.num_layers, include_head=False, decode=decode)
        flops += 2.0 * head_params(d) * head_tokens
        # Streamed weights: the layers, final norm and head GEMM (a tied LM head is the embedding
        # matrix, streamed all the same); the looked-up embedding rows are negligible.
        weights = d.num_layers * params_per_layer(d) + d.hidden_size + head_params(d)
        mb_tokens = batch_tokens / num_mbs
        if d.is_moe:  # the routed experts this device holds and the micro-batch's tokens use
            local = local_experts_streamed(d, mb_tokens, ep, decode)
            layer = streamed_matmul_params_per_layer(d, local) + norm_params_per_layer(d)
            weights = d.num_layers * layer + d.hidden_size + head_params(d)
        weight_bytes = weights * BF16_BYTES / tp
        kv_bytes = kv_bytes_per_token(d) * kv_tokens / (min(tp, d.kv_cache_heads) * num_mbs)
        activations = activation_io_elems_per_token_layer(d) * batch_tokens * d.num_layers
        num_bytes = weight_bytes + kv_bytes + activations * BF16_BYTES / per_mb
        mb_bytes = batch_tokens / num_mbs * d.hidden_size * BF16_BYTES
        comm_s = 2 * d.num_layers * self._allreduce_s(mb_bytes, tp)
        if pp > 1:
            comm_s += (pp - 1) * self._p2p_s(mb_bytes, tp * pp)
        if ep > 1:
            comm_s += moe_alltoalls_s(self._alltoall_s, d, d.num_layers, mb_tokens, ep, ep * tp * pp)
        return OpCost(flops / per_mb, num_bytes, comm_s)

    def decode_step_cost(self, model: Any, batch_size: int, context_tokens_total: float,
                         tp: int = 1, pp: int = 1, ep: int = 1) -> OpCost:
        """One decode step: every sample of the batch emits one token, attending to its
        cache; ``context_tokens_total`` is the sum of the cached lengths over the batch.
        KV heads are sharded over at most ``num_kv_heads`` tp ranks (replicated beyond)."""
        if batch_size <= 0:
            return OpCost(0.0, 0.0, 0.0)
        d = ModelDims.of(model)
        num_mbs = min(pp, batch_size)
        # Every cached entry is read once; the new token's K, V written (counted in the
        # cache once it is there).
        return self._pipelined_cost(d, batch_size, context_tokens_total / batch_size,
                                    context_tokens_total, batch_size, tp, pp, num_mbs, ep, decode=True)

    def decode_step_s(self, model: Any, batch_size: int, context_tokens_total: float,
                      tp: int = 1, pp: int = 1, ep: int = 1) -> float:
        return self.seconds(self.decode_step_cost(model, batch_size, context_tokens_total, tp, pp, ep))

    def prefill_cost(self, model: Any, num_tokens: float, tp: int = 1, pp: int = 1,
                     seq_len: Optional[float] = None, ep: int = 1) -> OpCost:
        """Prefill of ``num_tokens`` prompt tokens in sequences of ``seq_len`` tokens
        (default: one sequence of ``num_tokens``). Causal attention attends to
        ``seq_len / 2`` keys on average; logits are computed for each sequence's last
        token only (what inference engines such as vLLM do). The KV of every prompt token
        is written once; the fused attention kernel keeps re-reads in on-chip memory."""
        if num_tokens <= 0:
            return OpCost(0.0, 0.0, 0.0)
        d = ModelDims.of(model)
        seq_len = num_tokens if seq_len is None else min(seq_len, num_tokens)
        num_seqs = num_tokens / seq_len
        num_mbs = max(1.0, min(pp, num_seqs))  # micro-batches hold whole sequences
        return self._pipelined_cost(d, num_tokens, seq_len / 2.0, num_tokens, num_seqs,
                                    tp, pp, num_mbs, ep)

    def prefill_s(self, model: Any, num_tokens: float, tp: int = 1, pp: int = 1,
                  seq_len: Optional[float] = None, ep: int = 1) -> float:
        return self.seconds(self.prefill_cost(model, num_tokens, tp, pp, seq_len, ep))
