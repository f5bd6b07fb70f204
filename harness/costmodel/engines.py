"""The rules by which a plan's execution engines change op times, each written once.

Owns :class:`EngineCosts`, what :meth:`harness.costmodel.CostModel.with_engines` adds to a cost
model: the op times of :class:`~harness.costmodel.CostModel` (our kernels, a CUDA-graph engine's
steps) as the engines of :class:`~harness.core.engines.Engines` (the facts, harness/core/engines.py)
run them:

- a prefill or decode step (:func:`generation_step_s`): on a CUDA-graph engine ``max(GPU time x
  gpu_time_scale + host_s_per_step, ZeRO-3 gather)``, the host's per-step work (scheduler, sampled
  tokens back, next inputs) serial with the GPU's; on an eager engine ``max(GPU time x gpu_time_scale,
  eager host time x host_time_scale, ZeRO-3 gather)`` plus, per host-device sync, one launch of host time; the
  eager host time is ``layers x launches_per_layer`` launches of the compute model's
  ``host_s_per_launch`` (gpt-fast's measured eager loop when calibrated; the roofline has no host
  model); the gather only when the engine generates from ZeRO-3 shards in place; a decode step's GPU
  time includes the KV cache's extra passes (``kv_cache_passes - 1``) at the streaming rate; without a
  reused KV cache (``kv_cache: false``) a decode step's GPU time is a prefill of the whole context;
- forward and backward: ``(our kernels + eager attention-score traffic) x compute_time_scale``, the
  traffic ``attention_score_bytes_* x heads/tp x tokens x seq_len x layers`` at the streaming rate
  (the forward's bytes again in a backward that recomputes the attention);
- optimizer step with offload: the CPU Adam step over the node's share of the optimizer states plus
  the fp16 gradients down and parameters up over PCIe, instead of the GPU's;
- a refit into a reloading generation engine (``refit: reload``, :meth:`EngineCosts.refit_reload_s`):
  ``reload_s + reload_s_per_gb x`` the model's bf16 weights in GB, on top of the bytes' transfer
  between the layouts (:func:`harness.planning.taskmodels.passes.weight_movement_s`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from harness.core.engines import FITTED_PRIORS, Engines, GenerationEngine
from harness.costmodel.calibrated import SHORT_SPAN_STEPS
from harness.costmodel.compute import ADAM_BYTES_PER_PARAM
from harness.costmodel.llama import ModelDims, kv_bytes_per_token
from harness.costmodel.memory import updated_params_per_device
from harness.errors import PlanError


def generation_step_s(graph_s: Any, extra_gpu_s: Any, num_layers: int, engine: GenerationEngine,
                      host_s_per_launch: float, graph_overhead_s: float, gather_s: float,
                      maximum: Callable[[Any, Any], Any] = max) -> Any:
    """A prefill or decode step of ``engine`` from the cost model's CUDA-graph time of it
    (``graph_s``: GPU time + the graph replay overhead ``graph_overhead_s``), the engine's own GPU work
    beyond our kernels (``extra_gpu_s``: KV-cache copies), the host time per launch of an eager loop and
    the per-step ZeRO-3 gather. Elementwise over the steps of a span with ``maximum=np.maximum``."""
    gpu_s = (maximum(0.0, graph_s - graph_overhead_s) + extra_gpu_s) * engine.gpu_time_scale
    if engine.kernels == "graph":
        return maximum(gpu_s + graph_overhead_s + engine.host_s_per_step, gather_s)
    host_s_per_launch = host_s_per_launch * engine.host_time_scale
    host_s = num_layers * engine.launches_per_layer * host_s_per_launch
    sync_s = num_layers * engine.host_syncs_per_layer * host_s_per_launch
    return maximum(maximum(gpu_s, host_s), gather_s) + sync_s


class EngineCosts:
    """The op times of ``base`` (a :class:`~harness.costmodel.CostModel` without engines) as ``engines``
    run them (see the module docstring); ``gen_gather_s`` is the all-gather of the actor's weights paid
    at every generation step (0: none). Reached through :meth:`CostModel.with_engines`, whose op
    methods delegate here."""

    def __init__(self, base: Any, engines: Engines, gen_gather_s: float = 0.0):
        unresolved = [f"{kind}.{key}" for kind, engine in (("generation", engines.generation),
                                                           ("training", engines.training))
                      for key in FITTED_PRIORS[kind] if getattr(engine, key) is None]
        if unresolved:
            raise PlanError(f"engines with unresolved fitted constants {unresolved}: build them with "
                            f"harness.core.engines.select_engines or resolve()")
        self.base, self.engines, self.gen_gather_s = base, engines, gen_gather_s
        compute = base.compute  # the calibrated model, or the roofline (no host model)
        self._graph_overhead_s = float(compute.graph_step_overhead_s)
        self._host_s_per_launch = float(compute.host_s_per_launch)
        self._stream_s_per_byte = float(compute.stream_s_per_byte)
        self._spans: dict[tuple, tuple[float, ...]] = {}  # decode_span_s answers
        self._span_models: dict[int, Any] = {}  # keeps the memo's keyed models alive

    # -- generation -----------------------------------------------------------------------------

    def _step(self, graph_s: float, model: Any, extra_gpu_s: float = 0.0) -> float:
        return generation_step_s(graph_s, extra_gpu_s, model.num_layers, self.engines.generation,
                                 self._host_s_per_launch, self._graph_overhead_s, self.gen_gather_s)

    def _step_each(self, graph_s: np.ndarray, model: Any, extra_gpu_s: Any) -> np.ndarray:
        return generation_step_s(graph_s, extra_gpu_s, model.num_layers, self.engines.generation,
                                 self._host_s_per_launch, self._graph_overhead_s, self.gen_gather_s, np.maximum)

    def _kv_extra_s(self, model: Any, batch_size: int, context_tokens_total: Any, tp: int, pp: int) -> Any:
        """GPU time of a decode step's KV-cache passes beyond the one our kernel profiles include: the
        bytes one device holds for one micro-batch's pass through every layer (the pipeline rule of
        :meth:`CalibratedCompute._pipelined_s`), at the streaming rate."""
        extra_passes = self.engines.generation.kv_cache_passes - 1.0
        if extra_passes <= 0.0:
            return 0.0
        d = ModelDims.of(model)
        num_mbs = min(pp, batch_size) if np.isscalar(batch_size) else np.minimum(pp, batch_size)
        per_device = kv_bytes_per_token(d) * context_tokens_total / (min(tp, d.kv_cache_heads) * num_mbs)
        return extra_passes * per_device * self._stream_s_per_byte

    def decode_step_s(self, model: Any, batch_size: int, context_tokens_total: float, tp: int = 1,
                      pp: int = 1, ep: int = 1) -> float:
        if batch_size <= 0:
            return 0.0
        if self.engines.generation.kv_cache:
            gpu_s = self.base.decode_step_s(model, batch_size, context_tokens_total, tp, pp, ep)
        else:  # the model runs over every sequence's whole context to produce its next token
            tokens = context_tokens_total + batch_size
            gpu_s = self.base.prefill_s(model, tokens, tp, pp, tokens / batch_size, ep)
        return self._step(gpu_s, model, self._kv_extra_s(model, batch_size, context_tokens_total, tp, pp))

    def decode_span_s(self, model: Any, batch_size: int, context_tokens_total: int, num_steps: int,
                      tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[float, ...]:
        """:meth:`decode_step_s` of ``num_steps`` consecutive steps, bit for bit (memoised per instance):
        the cost model's span, then the step rule (step by step on short spans, elementwise on long
        ones), or step by step without a KV cache."""
        key = (id(model), batch_size, context_tokens_total, num_steps, tp, pp, ep)
        hit = self._spans.get(key)
        if hit is None:
            kv_cache = self.engines.generation.kv_cache
            if kv_cache and batch_size > 0 and num_steps <= SHORT_SPAN_STEPS:
                hit = tuple(self._step(g, model, self._kv_extra_s(
                    model, batch_size, context_tokens_total + j * batch_size, tp, pp))
                    for j, g in enumerate(self.base.decode_span_s(model, batch_size, context_tokens_total,
                                                                  num_steps, tp, pp, ep)))
            elif kv_cache and batch_size > 0:
                graph_s = np.asarray(self.base.decode_span_s(model, batch_size, context_tokens_total, num_steps,
                                                             tp, pp, ep))
                contexts = context_tokens_total + np.arange(num_steps, dtype=np.int64) * batch_size
                hit = tuple(self._step_each(graph_s, model,
                                            self._kv_extra_s(model, batch_size, contexts, tp, pp)).tolist())
            else:
                hit = tuple(self.decode_step_s(model, batch_size, context_tokens_total + j * batch_size, tp, pp, ep)
                            for j in range(num_steps))
            self._spans[key] = hit
            self._span_models[id(model)] = model
        return hit

    def decode_steps_s(self, model: Any, batch_sizes: np.ndarray, context_totals: np.ndarray, tp: int = 1,
                       pp: int = 1, ep: int = 1) -> Optional[np.ndarray]:
        """:meth:`decode_step_s` of many steps at once (positive batch sizes), elementwise and bit for
        bit; None where the base cost model has no such pass or the engine keeps no KV cache."""
        if not self.engines.generation.kv_cache:
            return None
        graph_s = self.base.decode_steps_s(model, batch_sizes, context_totals, tp, pp, ep)
        if graph_s is None:
            return None
        return self._step_each(graph_s, model, self._kv_extra_s(model, batch_sizes, context_totals, tp, pp))

    def prefill_s(self, model: Any, num_tokens: float, tp: int = 1, pp: int = 1,
                  seq_len: Optional[float] = None, ep: int = 1) -> float:
        if num_tokens <= 0:
            return 0.0
        return self._step(self.base.prefill_s(model, num_tokens, tp, pp, seq_len, ep), model)

    def prefills_s(self, model: Any, num_tokens: np.ndarray, tp: int = 1, pp: int = 1,
                   ep: int = 1) -> Optional[np.ndarray]:
        """:meth:`prefill_s` of many prefills of one sequence each (positive token counts),
        elementwise and bit for bit; None where the base cost model has no such pass."""
        graph_s = self.base.prefills_s(model, num_tokens, tp, pp, ep)
        if graph_s is None:
            return None
        return self._step_each(graph_s, model, 0.0)

    def refit_reload_s(self, model: Any) -> float:
        """Seconds a refit of ``model``'s new weights into the generation engine takes beyond moving
        their bytes: 0 on a ``transfer`` engine; on a ``reload`` engine (verl's and NeMo-RL's colocated
        vLLM) its fixed seconds plus its seconds per GB of the whole model's bf16 weights, which every
        GPU of the refit gathers, converts and loads (see ``refit`` in harness/core/engines.py)."""
        gen = self.engines.generation
        if gen.refit != "reload":
            return 0.0
        return gen.reload_s + gen.reload_s_per_gb * self.base.weights_gb(model, 1, 1)

    # -- training and inference passes ----------------------------------------------------------

    def _score_traffic_s(self, bytes_per_score: float, model: Any, num_tokens: float, seq_len: float,
                         tp: int, num_layers: Optional[float]) -> float:
        """Seconds an eager attention spends streaming the score matrices of ``num_tokens`` tokens in
        sequences of ``seq_len`` (every query against every key: an eager kernel computes the masked
        half too) through ``num_layers`` layers, ``bytes_per_score`` bytes per element."""
        if bytes_per_score <= 0.0 or num_tokens <= 0:
            return 0.0
        d = ModelDims.of(model)
        layers = d.num_layers if num_layers is None else num_layers
        heads_local = d.num_heads / min(tp, d.num_heads)
        return bytes_per_score * heads_local * num_tokens * seq_len * layers * self._stream_s_per_byte

    def forward_s(self, model: Any, num_tokens: float, seq_len: float, tp: int = 1,
                  num_layers: Optional[float] = None, include_head: Optional[bool] = None,
                  ep: int = 1, ep_span: Optional[int] = None, etp: Optional[int] = None) -> float:
        t = self.engines.training
        time_s = self.base.forward_s(model, num_tokens, seq_len, tp, num_layers, include_head, ep, ep_span, etp)
        time_s += self._score_traffic_s(t.attention_score_bytes_forward, model, num_tokens, seq_len, tp,
                                        num_layers)
        return time_s * t.compute_time_scale

    def backward_s(self, model: Any, num_tokens: float, seq_len: float, tp: int = 1,
                   num_layers: Optional[float] = None, include_head: Optional[bool] = None,
                   recompute: Optional[str] = None, ep: int = 1, ep_span: Optional[int] = None,
                   etp: Optional[int] = None) -> float:
        t = self.engines.training
        time_s = self.base.backward_s(model, num_tokens, seq_len, tp, num_layers, include_head, recompute, ep, ep_span,
                                      etp)
        score_bytes = t.attention_score_bytes_backward
        if (recompute or self.base.recompute) in ("full", "selective"):  # both recompute the attention
            score_bytes += t.attention_score_bytes_forward
        time_s += self._score_traffic_s(score_bytes, model, num_tokens, seq_len, tp, num_layers)
        return time_s * t.compute_time_scale

    def optimizer_step_s(self, model: Any, dp: int = 1, tp: int = 1, pp: int = 1, zero_stage: int = 0,
                         ep: int = 1, etp: Optional[int] = None) -> float:
        t = self.engines.training
        if not t.optimizer_offload:
            return self.base.optimizer_step_s(model, dp, tp, pp, zero_stage, ep, etp)
        params = updated_params_per_device(ModelDims.of(model), dp, tp, pp, zero_stage, ep, etp)
        ranks_per_node = min(dp * tp * pp, self.base.gpus_per_node)  # ranks sharing one host's memory
        cpu_s = params * ranks_per_node * ADAM_BYTES_PER_PARAM / (t.cpu_adam_gbps * 1e9)
        # fp16 gradients to the host, fp16 parameters back (ZeRO-Offload, Ren et al. ATC'21, section 4)
        pcie_s = 2 * self.base.host_transfer_s(2.0 * params)
        return cpu_s + pcie_s
