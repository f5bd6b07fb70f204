"""The calibrated compute and network model: op times from laws fitted on measured GPU profiles,
plus the overheads a roofline ignores (the default for the H100 and A100 clusters).

Owns :class:`Calibration` (the fitted data of one GPU: per-op-class laws, NCCL time curves; one
JSON file per GPU under ``data/profiles/fitted/``, written by ``python -m harness.calibrate fit``
from the Vidur profiles and reproducible from them, see ``tests/harness/costmodel/
test_calibrated.py``) and :class:`CalibratedCompute`, which answers the same questions as
:class:`harness.costmodel.compute.Roofline` (forward, backward, prefill, decode step, optimizer
step of a model on one GPU of a tp group) from those laws. Every number below is either fitted
from ``data/profiles/vidur`` or a published measurement cited where it is used; none is tuned to
a system's speedup.

What a layer costs (per GPU of a tp group, ``M`` tokens):

* **linear and elementwise ops** (norms, QKV, rope, output projection, gate/up, SwiGLU, down,
  residual adds): the sum of their fitted laws (:mod:`.measured`: a latency floor, then linear in
  FLOPs and bytes), evaluated on this model's dimensions, per tp. A GeLU MLP (``mlp="gelu"``: OPT,
  GPT) is Vidur's ``use_gated_mlp=False``: an up projection of ``ffn`` columns and a two-operand
  activation; a model with ``learned_positions`` has no rotary op (its position embedding is added
  once per pass with the token lookup, which is not charged either);
* **attention core** (not in the profiles): FLOPs at the FlashAttention-2 efficiency of
  ``ATTENTION_EFFICIENCY_FRAC`` (below), or the KV bytes it must stream at the measured
  elementwise streaming rate (the ``add`` law's seconds per byte), whichever is larger (a
  FlashAttention-style prefill is FLOP-bound, a paged decode kernel is bandwidth-bound), plus the
  ``add`` law's floor as the kernel's launch floor;
* **tensor-parallel all-reduces**: two per layer in the forward (Megatron-LM), timed from the
  measured NCCL all-reduce curve of ``tp`` GPUs on one node;
* **mixture-of-experts layers** (:mod:`.llama`; not in the profiles, which are of dense models): the
  attention ops as above, and for the MLP the router GEMM (``h x E``, not sharded), the token
  dispatch and combine copies (the ``add`` law's streaming), the shared experts as one GEMM pair of
  their summed width, and the routed experts as a grouped GEMM pair whose work is the top-k copies
  of the tokens (``M k`` rows; uniform routing spreads them evenly over the ep ranks) and whose
  weight bytes are the local experts the pass uses (all ``E / ep`` in training and prefill, those
  the tokens touch in a decode step: :func:`~harness.costmodel.llama.local_experts_streamed`), each
  timed by the ``gemm`` / ``act`` law of the same tp, per tp (expert tensor parallelism = tp). The
  expert-parallel all-to-alls (two per MoE layer in the forward) are alpha-beta over the cluster's
  links, as :mod:`.compute` describes; no NCCL all-to-all was measured.

Backward = 2x the linear ops and 2.5x the attention core (FlashAttention-2's backward runs five
matmuls to the forward's two; Dao 2023, section 3.1.2), the same all-reduces; recomputation as
in :mod:`.compute`. The LM head is a GEMM timed by the ``gemm`` law; the optimizer step streams
``ADAM_BYTES_PER_PARAM`` bytes per parameter at the measured elementwise rate.

Host overheads of generation: a decode or prefill step's host-side work (Python, kernel launches,
sampling) overlaps the GPU's only partly. The prefill and decode steps timed here are those of a
CUDA-graph engine (vLLM, ReaLHF's and RLHFuse's generation): GPU time + ``graph_step_overhead_s``.
An eager engine (a Hugging Face-style ``generate`` loop without CUDA graphs) issues every kernel of
every layer from the host, ``host_s_per_launch`` (``EAGER_HOST_S_PER_LAUNCH``) each; the rule that
combines the two is the execution engines' (:mod:`harness.costmodel.engines`).

Both constants come from one published measurement (PyTorch blog "Accelerating Generative AI
with PyTorch II: GPT, Fast", Nov 2023: LLaMA-7B, batch 1, A100-80GB power-limited to 330 W:
25.5 tokens/s in eager PyTorch, CPU-bound per the blog's trace; 107.0 tokens/s with
``torch.compile(mode="reduce-overhead")``, i.e. CUDA graphs, and a static KV cache). Eager:
``1 / 25.5 s`` over 32 layers of ``GPT_FAST_LAUNCHES_PER_LAYER`` kernel launches each (counted
from gpt-fast's ``model.py``), about 25 us per launch. Graph: ``1 / 107 s`` minus this model's
own A100 GPU time of that step (:func:`derived_graph_step_overhead_s`, computed, never tuned;
it comes out at zero: our modelled GPU step, 9.9 ms, is already 5% above the measured 9.35 ms).
Host work runs on the CPU, so the same constants apply on H100.

What is not calibrated: cross-node collectives other than point-to-point (the profiles hold
single-node all-reduces and a two-node send/recv): multi-node rings keep the alpha-beta model
of :mod:`.comm` over the cluster config's links.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from harness.costmodel.compute import (ADAM_BYTES_PER_PARAM, AllToAllFn, _no_alltoall, _no_comm, ep_group_span,
                                       moe_alltoalls_s)
from harness.costmodel.llama import BF16_BYTES, ModelDims, local_experts_streamed
from harness.costmodel.measured import LAYER_OPS, OP_CLASS, Law
from harness.core.files import file_kind

FITTED_DIR = Path(__file__).resolve().parents[2] / "data" / "profiles" / "fitted"
FORMAT_VERSION = 1


def calibration_names() -> list[str]:
    """The calibrations ``cluster.calibration`` takes by name (``data/profiles/fitted/<name>.json``)."""
    return sorted(p.stem for p in FITTED_DIR.glob("*.json"))


def _is_bare_name(name_or_path: str) -> bool:
    path = Path(name_or_path)
    return len(path.parts) == 1 and not path.suffix


def calibration_path(name_or_path: str) -> Path:
    """The file ``cluster.calibration`` names, absolute: ``data/profiles/fitted/<name>.json`` for a
    bare name of one (``h100``, ``a100``); else an existing file as it is given (with or without a
    suffix); else, for a bare name, where a calibration of that name would be, and for a path, the
    path itself."""
    path = Path(name_or_path)
    fitted = FITTED_DIR / f"{name_or_path}.json"
    if _is_bare_name(name_or_path) and fitted.is_file():
        return fitted.resolve()
    if path.is_file():
        return path.resolve()
    return (fitted if _is_bare_name(name_or_path) else path).resolve()


def check_calibration_file(name_or_path: str) -> Path:
    """:func:`calibration_path` of ``name_or_path`` if it is a file; else ValueError saying which
    names exist and that a path must name an existing file."""
    path = calibration_path(name_or_path)
    if path.is_file():
        return path
    names = ", ".join(calibration_names()) or "none"
    if _is_bare_name(name_or_path) and not Path(name_or_path).exists():
        raise ValueError(f"cluster.calibration={name_or_path!r}: no calibration of that name (names: {names}) "
                         f"and no such file; give a name or the path of an existing calibration file "
                         f"(python -m harness.calibrate fit writes data/profiles/fitted/<gpu>.json)")
    if path.exists():
        raise ValueError(f"calibration file {path}: is {file_kind(path)}, not a file (cluster.calibration="
                         f"{name_or_path!r})")
    raise ValueError(f"calibration file {path}: no such file (cluster.calibration={name_or_path!r}: a name "
                     f"({names}) or the path of an existing calibration file)")

# FlashAttention-2 attention-core efficiency (fraction of dense bf16 peak), forward and backward.
# A100: "FlashAttention-2 ... reaching 50-73% of the theoretical maximum FLOPs/s on A100" (Dao,
# "FlashAttention-2", 2023, abstract); RLHF sequences (1-2K tokens) sit at the low end of that
# range, so 0.5. H100: "FlashAttention-2 achieves only 35% utilization on H100" (Shah et al.,
# "FlashAttention-3", 2024, abstract): 0.35. Keyed by the profile's GPU.
ATTENTION_EFFICIENCY_FRAC = {"h100": 0.35, "a100": 0.5}

# PyTorch blog, "Accelerating Generative AI with PyTorch II: GPT, Fast" (Nov 2023), LLaMA-7B,
# batch 1, A100-80GB at 330 W: eager 25.5 tokens/s (CPU-bound), compiled with CUDA graphs 107.0.
GPT_FAST_EAGER_TOKENS_PER_S = 25.5
GPT_FAST_GRAPH_TOKENS_PER_S = 107.0
GPT_FAST_NUM_LAYERS = 32  # LLaMA-7B (Touvron et al. 2023, Table 2)
# Kernels one decode step of gpt-fast's eager TransformerBlock launches (model.py, batch 1, our
# count): 2 RMSNorms x 8 (cast, square, mean, +eps, rsqrt, mul, cast, weight), QKV GEMM 1, rotary
# on q and k 2 x 9 (cast, 4 mul, add, sub, stack, cast), KV-cache writes 2, repeat_interleave 2,
# SDPA 1, transpose copy 1, output GEMM 1, 2 residual adds, w1, w3, silu, mul, w2 5: 49.
GPT_FAST_LAUNCHES_PER_LAYER = 49
EAGER_HOST_S_PER_LAUNCH = (1.0 / GPT_FAST_EAGER_TOKENS_PER_S / GPT_FAST_NUM_LAYERS
                           / GPT_FAST_LAUNCHES_PER_LAYER)
# The gpt-fast benchmark generates 200 tokens after a short prompt: mean cached context ~100.
GPT_FAST_MEAN_CONTEXT = 100
LLAMA_7B = ModelDims("llama-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                     ffn_hidden_size=11008, vocab_size=32000)

# decode spans up to this many steps are timed step by step, longer ones elementwise in numpy
# (about 35% of a disaggregated 13b plan's spans are one step, 74% at most 8)
SHORT_SPAN_STEPS = 8
CommFn = Callable[[float, int], float]
# a layer's profiled ops apart from its (dense) MLP: what a MoE layer keeps
MLP_OPS = ("mlp_up_proj", "mlp_act", "mlp_down_proj")
ATTENTION_OPS = tuple(op for op in LAYER_OPS if op not in MLP_OPS)


class Curve:
    """Measured seconds over message bytes: linear interpolation between measured sizes; below
    the smallest, its time; above the largest, extended with the bandwidth of the largest
    quarter of the measured sizes (the latency-free regime)."""

    def __init__(self, sizes: list[float], times: list[float]):
        if len(sizes) < 2 or len(sizes) != len(times):
            raise ValueError("a curve needs at least two (size, time) points")
        self.sizes, self.times = list(map(float, sizes)), list(map(float, times))
        k = max(1, len(self.sizes) // 4)
        ds = self.sizes[-1] - self.sizes[-1 - k]
        self.tail_s_per_byte = max(0.0, (self.times[-1] - self.times[-1 - k]) / ds) if ds > 0 else 0.0

    def __call__(self, num_bytes: float) -> float:
        xs, ys = self.sizes, self.times
        if num_bytes <= xs[0]:
            return ys[0]
        if num_bytes >= xs[-1]:
            return ys[-1] + (num_bytes - xs[-1]) * self.tail_s_per_byte
        i = bisect.bisect_left(xs, num_bytes)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (num_bytes - x0) / (x1 - x0)


@dataclass
class Calibration:
    """Fitted data of one GPU: ``laws[(op_class, tp)]`` and NCCL curves
    ``all_reduce[num_workers]`` (one node), ``send_recv_intra`` / ``send_recv_inter`` (two GPUs
    on one node / on two nodes)."""

    gpu: str
    laws: dict[tuple[str, int], Law]
    all_reduce: dict[int, Curve]
    send_recv_intra: Optional[Curve]
    send_recv_inter: Optional[Curve]
    source: str

    @property
    def tps(self) -> list[int]:
        return sorted({tp for _, tp in self.laws})

    def law(self, op_class: str, tp: int) -> Law:
        """The law of ``op_class`` at ``tp``; an unmeasured tp uses the nearest measured one
        below it (its per-GPU work is still computed at the true tp)."""
        law = self.laws.get((op_class, tp))
        if law is None:
            below = [t for t in self.tps if t <= tp] or self.tps[:1]
            law = self.laws[(op_class, below[-1])]
        return law

    @classmethod
    def load(cls, name_or_path: str) -> "Calibration":
        """``h100`` / ``a100`` (``data/profiles/fitted/<name>.json``) or a path to such a file."""
        return _load_cached(str(check_calibration_file(name_or_path)))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<memory>") -> "Calibration":
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{source}: calibration format_version {data.get('format_version')!r}, "
                             f"expected {FORMAT_VERSION} (re-run python -m harness.calibrate fit)")
        laws = {}
        for op_class, by_tp in data["laws"].items():
            for tp, coef in by_tp.items():
                laws[(op_class, int(tp))] = Law(**coef)
        net = data.get("network", {})
        ar = {int(n): Curve(*c) for n, c in net.get("all_reduce", {}).items()}
        intra = net.get("send_recv_intra")
        inter = net.get("send_recv_inter")
        return cls(gpu=str(data["gpu"]), laws=laws, all_reduce=ar,
                   send_recv_intra=Curve(*intra) if intra else None,
                   send_recv_inter=Curve(*inter) if inter else None,
                   source=f"{source} (from {data.get('source', '?')})")


@lru_cache(maxsize=8)
def _load_cached(path: str) -> Calibration:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"calibration file {path}: no such file (python -m harness.calibrate fit "
                         f"writes data/profiles/fitted/<gpu>.json)")
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a calibration file (not UTF-8 text: {e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not a calibration file (invalid JSON: {e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a calibration file (a JSON object of its laws)")
    return Calibration.from_dict(data, source=str(p))


class CalibratedCompute:
    """Compute-op times on one GPU from a :class:`Calibration` (same interface as
    :class:`harness.costmodel.compute.Roofline`; ``allreduce_s(bytes, n)`` times a tp
    all-reduce and ``p2p_s(bytes, n)`` a pipeline hop inside an instance of ``n`` devices)."""

    host_s_per_launch = EAGER_HOST_S_PER_LAUNCH  # an eager engine's host time per kernel launch

    def __init__(self, calibration: Calibration, peak_bf16_tflops: float,
                 allreduce_s: Optional[CommFn] = None, p2p_s: Optional[CommFn] = None,
                 graph_step_overhead_s: Optional[float] = None, alltoall_s: Optional[AllToAllFn] = None):
        self.cal = calibration
        self.flops_per_s_attention = (float(peak_bf16_tflops) * 1e12
                                      * ATTENTION_EFFICIENCY_FRAC[calibration.gpu])
        self._allreduce_s = allreduce_s or _no_comm
        self._p2p_s = p2p_s or _no_comm
        self._alltoall_s = alltoall_s or _no_alltoall
        # measured elementwise streaming rate: the 'add' law's seconds per byte at tp 1
        self.stream_s_per_byte = calibration.law("add", 1).c_byte
        self._linear = lru_cache(maxsize=65536)(self._linear_layer_s)
        self._moe_linear = lru_cache(maxsize=65536)(self._moe_linear_layer_s)
        self._layer_terms = lru_cache(maxsize=1024)(self._layer_terms_uncached)
        self._head = lru_cache(maxsize=65536)(self._head_s)
        self._allreduces = lru_cache(maxsize=65536)(self._allreduces_uncached_s)
        self._decode_step_parts = lru_cache(maxsize=65536)(self._decode_step_parts_uncached)
        if graph_step_overhead_s is None:
            graph_step_overhead_s = derived_graph_step_overhead_s()
        self.graph_step_overhead_s = graph_step_overhead_s

    # -- pieces ---------------------------------------------------------------------------

    def _linear_layer_s(self, d: ModelDims, tp: int, num_tokens: float) -> float:
        """One layer's linear and elementwise ops (every profiled op but the embedding; no rope
        with learned positions): the sum over ops of ``law.seconds(*_op_work(op, m))``, with the
        parts that do not depend on ``m`` read from :meth:`_layer_terms` (the same operations in
        the same order, so bit for bit the same sum; tested)."""
        return self._sum_terms(self._layer_terms(d, int(tp)), num_tokens)

    def _layer_terms_uncached(self, d: ModelDims, tp: int, ops: tuple[str, ...] = LAYER_OPS) -> tuple:
        """Per op of a layer (``ops``: all of them by default), what :func:`_op_work` and the op's
        law compute without the token count: ``(k, n, k * n, None, floor, c0, c_flop, c_byte)`` for a
        GEMM, ``(None, None, None, bytes per token, floor, ...)`` for an elementwise op;
        ``floor = f0 + f_w * width``."""
        dims = _vidur_dims(d)
        h, f, n_head, n_kv, up, head_dim = dims
        q, kv = n_head * head_dim, max(1.0, float(int(n_kv // tp))) * head_dim
        gemm_shapes = {"attn_pre_proj": (h, q / tp + 2.0 * kv), "attn_post_proj": (q / tp, h),
                       "mlp_up_proj": (h, up * f / tp), "mlp_down_proj": (f / tp, h)}
        terms = []
        mla = _mla_ops(d, tp) if d.is_mla else {}
        for op in ops:
            if op == "attn_rope" and d.learned_positions:
                continue
            law = self.cal.law(OP_CLASS[op], tp)
            if op in mla:  # latent attention's projections (several GEMMs) and rotary part
                for k, n, width in mla[op]:
                    if k is None:
                        terms.append((None, None, None, width, law.f0 + law.f_w * width, law.c0, law.c_flop,
                                      law.c_byte))
                    else:
                        terms.append((k, n, k * n, None, law.f0 + law.f_w * width, law.c0, law.c_flop, law.c_byte))
                continue
            _, _, width = _op_work(op, dims, tp, 0.0)
            floor = law.f0 + law.f_w * width
            if op in gemm_shapes:
                k, n = gemm_shapes[op]
                terms.append((k, n, k * n, None, floor, law.c0, law.c_flop, law.c_byte))
            else:
                terms.append((None, None, None, width, floor, law.c0, law.c_flop, law.c_byte))
        return tuple(terms)

    def linear_layer_s(self, d: ModelDims, tp: int, num_tokens: float, ep: int = 1, decode: bool = False,
                       etp: Optional[int] = None) -> float:
        """One layer's linear and elementwise ops over ``num_tokens`` tokens on one GPU of a tp
        group; a MoE model's (averaged over its layers, :mod:`.llama`) with its routed experts split
        over ``ep`` ranks, each over ``etp`` (None: ``tp``), and, in a decode step (``decode``),
        streamed only where the tokens go."""
        if num_tokens <= 0:
            return 0.0
        if d.is_moe:
            expert_tp = int(tp) if etp is None else int(etp)
            return self._moe_linear(d, int(tp), float(num_tokens), int(ep), bool(decode), expert_tp)
        return self._linear(d, int(tp), float(num_tokens))

    @staticmethod
    def _sum_terms(terms: tuple, m: Any, maximum: Callable[[Any, Any], Any] = max) -> Any:
        """The ops of :meth:`_layer_terms` over ``m`` tokens, summed in order; elementwise over an
        array ``m`` with ``maximum=np.maximum``."""
        total = 0.0
        for k, n, kn, per_token_bytes, floor, c0, c_flop, c_byte in terms:
            if per_token_bytes is None:  # a GEMM of (m x k) by (k x n)
                total += maximum(floor, c0 + c_flop * (2.0 * m * k * n) + c_byte * (BF16_BYTES * (kn + m * k + m * n)))
            else:  # an elementwise op over m tokens
                total += maximum(floor, c0 + c_flop * 0.0 + c_byte * (per_token_bytes * m))
        return total

    def _moe_linear_layer_s(self, d: ModelDims, tp: int, m: float, ep: int, decode: bool, etp: int) -> float:
        """A MoE model's :meth:`linear_layer_s`: the attention ops of every layer, plus the MLP
        ops of a dense-MLP layer or of a MoE layer (:meth:`_moe_mlp_s`), averaged over the layers."""
        attention = self._sum_terms(self._layer_terms(d, tp, ATTENTION_OPS), m)
        moe = self._moe_mlp_s(d, tp, m, local_experts_streamed(d, m, ep, decode), etp)
        dense_layers = d.num_layers - d.num_moe_layers
        if not dense_layers:
            return attention + moe
        dense = self._sum_terms(self._layer_terms(d, tp, MLP_OPS), m)
        return attention + (dense_layers * dense + d.num_moe_layers * moe) / d.num_layers

    def _moe_mlp_s(self, d: ModelDims, tp: int, m: float, local_experts: float, etp: Optional[int] = None) -> float:
        """One MoE layer's MLP over ``m`` tokens on one GPU (module docstring): the router GEMM,
        dispatch and combine copies, the shared experts' GEMMs and activation, and the routed
        experts' grouped GEMMs over ``m k`` token copies reading ``local_experts`` experts' weights,
        each expert split over ``etp`` ranks (None: ``tp``): with ``etp`` below ``tp`` a GPU runs
        ``etp / tp`` of the copies through ``1 / etp`` of each expert, the same FLOPs."""
        gemm, act, add = self.cal.law("gemm", tp), self.cal.law("act", tp), self.cal.law("add", tp)
        h, f = float(d.hidden_size), float(d.moe_ffn_hidden_size)
        up = 2.0 if d.gated_mlp else 1.0
        k = float(d.num_experts_per_token)
        b = BF16_BYTES

        def grouped_gemm(tokens: float, kk: float, n: float, matrices: float) -> float:
            # (tokens x kk) by ``matrices`` weight matrices of (kk x n): each weight read once
            return gemm.seconds(2.0 * tokens * kk * n, b * (matrices * kk * n + tokens * kk + tokens * n),
                                b * (matrices * kk * n + kk + n))

        def elementwise(law: Law, tokens: float, elems_per_token: float) -> float:
            return law.seconds(0.0, b * elems_per_token * tokens, b * elems_per_token)

        total = grouped_gemm(m, h, float(d.num_experts), 1.0)  # router
        total += 2.0 * elementwise(add, m, h + k * h)  # dispatch and combine copies
        if d.num_shared_experts:
            wide = d.num_shared_experts * f / tp
            total += grouped_gemm(m, h, up * wide, 1.0) + elementwise(act, m, (up + 1.0) * wide)
            total += grouped_gemm(m, wide, h, 1.0)
        copies, split = m * k, float(tp)
        if etp is not None and etp != tp:
            copies, split = m * k * etp / tp, float(etp)
        total += (grouped_gemm(copies, h, up * f / split, local_experts)
                  + elementwise(act, copies, (up + 1.0) * f / split))
        total += grouped_gemm(copies, f / split, h, local_experts)
        return total

    def attention_s(self, d: ModelDims, tp: int, num_tokens: float, context_len: float,
                    kv_tokens_read: float, decode: bool = False) -> float:
        """Attention core of one layer: ``num_tokens`` queries over ``context_len`` keys each,
        ``kv_tokens_read`` KV entries streamed from HBM (the whole cache in decode); a decode step's
        (``decode``) FLOPs by :attr:`ModelDims.decode_attention_width`."""
        if num_tokens <= 0:
            return 0.0
        width = d.decode_attention_width if decode else d.attention_width
        flops = 4.0 * width * context_len * num_tokens / tp
        q_out = 2.0 * num_tokens * d.q_dim / tp  # read Q, write O
        nbytes = (float(d.kv_cache_width(tp)) * kv_tokens_read + q_out) * BF16_BYTES
        floor = self.cal.law("add", tp).f0
        return max(flops / self.flops_per_s_attention, nbytes * self.stream_s_per_byte) + floor

    def head_s(self, d: ModelDims, tp: int, num_tokens: float) -> float:
        """Final norm + LM head (vocab-parallel GEMM) or scalar value head of ``num_tokens``."""
        if num_tokens <= 0:
            return 0.0
        return self._head(d, tp, num_tokens)

    def _head_s(self, d: ModelDims, tp: int, num_tokens: float) -> float:
        h = d.hidden_size
        norm = self.cal.law("norm", tp).seconds(0.0, BF16_BYTES * 2.0 * num_tokens * h,
                                                BF16_BYTES * 2.0 * h)
        n_out = 1.0 if d.value_head else d.vocab_size / tp
        weights = h * n_out * BF16_BYTES
        gemm = self.cal.law("gemm", tp).seconds(
            2.0 * num_tokens * h * n_out,
            BF16_BYTES * (h * n_out + num_tokens * h + num_tokens * n_out), weights)
        return norm + gemm

    def _allreduces_s(self, layers: float, num_tokens: float, d: ModelDims, tp: int) -> float:
        return self._allreduces(layers, num_tokens, d, tp)

    def _allreduces_uncached_s(self, layers: float, num_tokens: float, d: ModelDims, tp: int) -> float:
        return 2 * layers * self._allreduce_s(num_tokens * d.hidden_size * BF16_BYTES, tp)

    # -- training ops ---------------------------------------------------------------------

    def _forward_parts(self, model: Any, num_tokens: float, context_len: float, tp: int,
                       num_layers: Optional[float], include_head: Optional[bool], ep: int = 1,
                       ep_span: Optional[int] = None, etp: Optional[int] = None):
        d = ModelDims.of(model)
        layers = d.num_layers if num_layers is None else num_layers
        if include_head is None:
            include_head = layers >= d.num_layers
        linear = layers * self.linear_layer_s(d, tp, num_tokens, ep, etp=etp)
        attention = layers * self.attention_s(d, tp, num_tokens, context_len, num_tokens)
        head = self.head_s(d, tp, num_tokens) if include_head else 0.0
        comm = self._allreduces_s(layers, num_tokens, d, tp)
        if ep > 1:
            comm += moe_alltoalls_s(self._alltoall_s, d, layers, num_tokens, ep, ep_group_span(ep, tp, ep_span),
                                    tp, etp)
        return linear + head, attention, comm

    def forward_s(self, model: Any, num_tokens: float, context_len: float, tp: int = 1,
                  num_layers: Optional[float] = None, include_head: Optional[bool] = None,
                  ep: int = 1, ep_span: Optional[int] = None, etp: Optional[int] = None) -> float:
        """``ep``: expert parallelism (a MoE model's local experts and all-to-alls); ``ep_span``:
        the devices the ep group lies among (:func:`~harness.costmodel.compute.ep_group_span`);
        ``etp``: expert tensor parallelism (None: ``tp``)."""
        if num_tokens <= 0:
            return 0.0
        linear, attention, comm = self._forward_parts(model, num_tokens, context_len, tp,
                                                      num_layers, include_head, ep, ep_span, etp)
        return linear + attention + comm

    def backward_s(self, model: Any, num_tokens: float, context_len: float, tp: int = 1,
                   num_layers: Optional[float] = None, include_head: Optional[bool] = None,
                   recompute: str = "none", ep: int = 1, ep_span: Optional[int] = None,
                   etp: Optional[int] = None) -> float:
        """2x the linear ops, 2.5x the attention core, the forward's all-reduces (and all-to-alls);
        ``full`` recomputation adds a forward, ``selective`` the attention core's forward."""
        if num_tokens <= 0:
            return 0.0
        linear, attention, comm = self._forward_parts(model, num_tokens, context_len, tp,
                                                      num_layers, include_head, ep, ep_span, etp)
        time_s = 2.0 * linear + 2.5 * attention + comm
        if recompute == "full":
            time_s += linear + attention + comm
        elif recompute == "selective":
            time_s += attention
        elif recompute != "none":
            raise ValueError(f"recompute must be none, selective or full, not {recompute!r}")
        return time_s

    def optimizer_step_s(self, params_on_device: float) -> float:
        """Mixed-precision Adam (multi-tensor, memory bound) at the measured streaming rate."""
        return ADAM_BYTES_PER_PARAM * params_on_device * self.stream_s_per_byte

    # -- generation ops -------------------------------------------------------------------

    def _pipelined_s(self, d: ModelDims, batch_tokens: float, context_len: float,
                     kv_tokens: float, head_tokens: float, tp: int, pp: int,
                     num_mbs: float, ep: int = 1) -> float:
        """GPU time of one pass of ``batch_tokens`` through a tp x pp instance in steady state
        (the pipeline rule of :mod:`.compute`): the ``num_mbs`` micro-batches each cross all
        layers, the stages serve them in parallel, so the pass takes ``num_layers`` layer times
        of one micro-batch (plus its head and communication)."""
        mb = batch_tokens / num_mbs
        layer = (self.linear_layer_s(d, tp, mb, ep)
                 + self.attention_s(d, tp, mb, context_len, kv_tokens / num_mbs))
        time_s = d.num_layers * layer + self.head_s(d, tp, head_tokens / num_mbs)
        time_s += self._allreduces_s(d.num_layers, mb, d, tp)
        if pp > 1:
            time_s += (pp - 1) * self._p2p_s(mb * d.hidden_size * BF16_BYTES, tp * pp)
        if ep > 1:
            time_s += moe_alltoalls_s(self._alltoall_s, d, d.num_layers, mb, ep, ep * tp * pp)
        return time_s

    def _decode_span_gpu_s(self, d: ModelDims, batch_size: int, context_tokens_total: float, num_steps: int,
                           tp: int, pp: int, ep: int = 1) -> np.ndarray:
        """GPU time of ``num_steps`` consecutive decode steps (contexts ``c, c + b, ...``) by the
        pipeline rule of :meth:`_pipelined_s` (one micro-batch per stage, up to ``pp``): the parts of
        a step that do not depend on the context (linear ops, head, all-reduces, pipeline hops) are
        computed once, the attention core for every step at once (:meth:`_steps_gpu_s`).
        ``batch_size`` must be positive."""
        total = context_tokens_total + np.arange(num_steps, dtype=np.int64) * batch_size
        return self._steps_gpu_s(d, tp, pp, self._decode_step_parts(d, batch_size, tp, pp, ep), total, batch_size)

    def _steps_gpu_s(self, d: ModelDims, tp: int, pp: int, parts: Any, context_totals: np.ndarray,
                     batch_sizes: Any) -> np.ndarray:
        """GPU time of decode steps from their context-independent ``parts``
        (:meth:`_decode_step_parts`: scalars, or one array per part) and their contexts: the
        attention core (:meth:`attention_s`'s operations in the same order, elementwise), then the
        sum of :meth:`decode_step_gpu_s`, so a step equals its scalar timing bit for bit."""
        num_mbs, mb, linear, head, comm, hops = parts
        flops = 4.0 * d.decode_attention_width * (context_totals / batch_sizes) * mb / tp
        q_out = 2.0 * mb * d.q_dim / tp
        nbytes = (float(d.kv_cache_width(tp)) * (context_totals / num_mbs) + q_out) * BF16_BYTES
        attention = np.maximum(flops / self.flops_per_s_attention, nbytes * self.stream_s_per_byte)
        attention += self.cal.law("add", tp).f0
        time_s = d.num_layers * (linear + attention) + head
        time_s += comm
        if pp > 1:
            time_s += hops
        return time_s

    def decode_step_gpu_s(self, model: Any, batch_size: int, context_tokens_total: float,
                          tp: int = 1, pp: int = 1, ep: int = 1) -> float:
        if batch_size <= 0:
            return 0.0
        d = ModelDims.of(model)
        # one step by the rule of _steps_gpu_s, the scalar ops; the parts that do not depend on
        # the context are the batch's (memoised: the generation task model asks for 1e5 steps a plan)
        num_mbs, mb, linear, head, comm, hops = self._decode_step_parts(d, batch_size, tp, pp, ep)
        attention = self.attention_s(d, tp, mb, context_tokens_total / batch_size, context_tokens_total / num_mbs,
                                     decode=True)
        time_s = d.num_layers * (linear + attention) + head
        time_s += comm
        if pp > 1:
            time_s += hops
        return time_s

    def _decode_step_parts_uncached(self, d: ModelDims, batch_size: int, tp: int, pp: int,
                                    ep: int) -> tuple[int, float, float, float, float, float]:
        """A decode step's micro-batches, micro-batch size, linear ops of a layer, head, collectives
        and pipeline hops: everything of :meth:`decode_step_gpu_s` but the attention core."""
        num_mbs = min(pp, batch_size)
        mb = batch_size / num_mbs
        linear = self.linear_layer_s(d, tp, mb, ep, decode=True)
        head = self.head_s(d, tp, batch_size / num_mbs)
        comm = self._allreduces_s(d.num_layers, mb, d, tp)
        if ep > 1:  # summed as the steps of a span sum them (a span equals its steps bit for bit)
            comm += moe_alltoalls_s(self._alltoall_s, d, d.num_layers, mb, ep, ep * tp * pp)
        hops = (pp - 1) * self._p2p_s(mb * d.hidden_size * BF16_BYTES, tp * pp) if pp > 1 else 0.0
        return num_mbs, mb, linear, head, comm, hops

    def decode_step_s(self, model: Any, batch_size: int, context_tokens_total: float,
                      tp: int = 1, pp: int = 1, ep: int = 1) -> float:
        """One decode step of a CUDA-graph engine: GPU time + the graph replay overhead."""
        if batch_size <= 0:
            return 0.0
        return self.decode_step_gpu_s(model, batch_size, context_tokens_total, tp, pp, ep) + self.graph_step_overhead_s

    def _short_decode_span_s(self, d: ModelDims, batch_size: int, context_tokens_total: float, num_steps: int,
                             tp: int, pp: int, ep: int) -> list[float]:
        """:meth:`decode_step_s` of ``num_steps`` consecutive steps in one loop: the operations of
        :meth:`decode_step_gpu_s` and :meth:`attention_s` in the same order (so bit for bit the
        same), with the step's context-independent parts and the attention core's constant factors
        taken once. The generation task model's spans between two batch changes are mostly a few
        steps long, and it times ~1e5 of them a plan."""
        num_mbs, mb, linear, head, comm, hops = self._decode_step_parts(d, batch_size, tp, pp, ep)
        layers, overhead_s = d.num_layers, self.graph_step_overhead_s
        flops_per_query_key = 4.0 * d.decode_attention_width  # 4.0 * width * context_len * num_tokens / tp
        kv_bytes_factor = float(d.kv_cache_width(tp))
        q_out = 2.0 * mb * d.q_dim / tp
        flops_rate, s_per_byte = self.flops_per_s_attention, self.stream_s_per_byte
        floor = self.cal.law("add", tp).f0
        steps = []
        for j in range(num_steps):
            context_total = context_tokens_total + j * batch_size
            flops = flops_per_query_key * (context_total / batch_size) * mb / tp
            nbytes = (kv_bytes_factor * (context_total / num_mbs) + q_out) * BF16_BYTES
            attention = max(flops / flops_rate, nbytes * s_per_byte) + floor
            time_s = layers * (linear + attention) + head
            time_s += comm
            if pp > 1:
                time_s += hops
            steps.append(time_s + overhead_s)
        return steps

    def decode_steps_s(self, d: ModelDims, batch_sizes: np.ndarray, context_totals: np.ndarray, tp: int, pp: int,
                       ep: int = 1) -> np.ndarray:
        """:meth:`decode_step_s` of many steps at once, bit for bit: step ``i`` has ``batch_sizes[i]``
        (positive) samples whose caches hold ``context_totals[i]`` tokens in all (integer arrays).
        The context-independent parts are taken once per distinct batch size, the attention core
        elementwise, in :meth:`decode_step_gpu_s`'s order."""
        sizes, which = np.unique(batch_sizes, return_inverse=True)
        parts = np.array([self._decode_step_parts(d, int(b), tp, pp, ep) for b in sizes], dtype=np.float64)
        return self._steps_gpu_s(d, tp, pp, parts[which].T, context_totals, batch_sizes) + self.graph_step_overhead_s

    def decode_span_s(self, model: Any, batch_size: int, context_tokens_total: float, num_steps: int,
                      tp: int = 1, pp: int = 1, ep: int = 1) -> list[float]:
        """:meth:`decode_step_s` of ``num_steps`` consecutive steps (contexts ``c, c + b, ...``),
        bit for bit: step by step up to ``SHORT_SPAN_STEPS`` steps, else in one elementwise pass
        (:meth:`_decode_span_gpu_s`; numpy's per-call cost is repaid only on longer spans)."""
        if batch_size <= 0:
            return [0.0] * num_steps
        d = ModelDims.of(model)
        if num_steps <= SHORT_SPAN_STEPS:
            return self._short_decode_span_s(d, batch_size, context_tokens_total, num_steps, tp, pp, ep)
        gpu_s = self._decode_span_gpu_s(d, batch_size, context_tokens_total, num_steps, tp, pp, ep)
        return (gpu_s + self.graph_step_overhead_s).tolist()

    def prefill_s(self, model: Any, num_tokens: float, tp: int = 1, pp: int = 1,
                  seq_len: Optional[float] = None, ep: int = 1) -> float:
        """A prefill of ``num_tokens`` by a CUDA-graph engine: GPU time + the graph replay overhead."""
        if num_tokens <= 0:
            return 0.0
        d = ModelDims.of(model)
        seq_len = num_tokens if seq_len is None else min(seq_len, num_tokens)
        num_seqs = num_tokens / seq_len
        num_mbs = max(1.0, min(pp, num_seqs))
        gpu_s = self._pipelined_s(d, num_tokens, seq_len / 2.0, num_tokens, num_seqs, tp, pp,
                                  num_mbs, ep)
        return gpu_s + self.graph_step_overhead_s

    def prefills_s(self, d: ModelDims, num_tokens: np.ndarray, tp: int, pp: int, ep: int = 1) -> np.ndarray:
        """:meth:`prefill_s` of many prefills of one sequence each (``num_tokens``: positive integer
        token counts), elementwise and bit for bit: :meth:`_pipelined_s`'s operations in its order
        with one micro-batch, the linear ops and the attention core in numpy (a dense model's), the
        collectives (memoised scalars) and a MoE model's linear ops element by element. A
        generation instance's step schedule prefills as many distinct token counts as it has
        admissions, and a layout search prices tens of thousands of them."""
        m = np.asarray(num_tokens, dtype=np.float64)  # mb = num_tokens / 1.0
        if d.is_moe:
            linear = np.array([self.linear_layer_s(d, tp, x, ep) for x in m.tolist()])
        else:
            linear = self._sum_terms(self._layer_terms(d, int(tp)), m, np.maximum)
        # attention_s(d, tp, m, m / 2.0, m): queries over half the sequence, the whole of it read
        flops = 4.0 * d.attention_width * (m / 2.0) * m / tp
        q_out = 2.0 * m * d.q_dim / tp
        nbytes = (float(d.kv_cache_width(tp)) * m + q_out) * BF16_BYTES
        attention = np.maximum(flops / self.flops_per_s_attention, nbytes * self.stream_s_per_byte)
        attention += self.cal.law("add", tp).f0
        time_s = d.num_layers * (linear + attention) + self.head_s(d, tp, 1.0)
        time_s += np.array([self._allreduces_s(d.num_layers, x, d, tp) for x in m.tolist()])
        if pp > 1:
            time_s += np.array([(pp - 1) * self._p2p_s(x * d.hidden_size * BF16_BYTES, tp * pp)
                                for x in m.tolist()])
        if ep > 1:
            time_s += np.array([moe_alltoalls_s(self._alltoall_s, d, d.num_layers, x, ep, ep * tp * pp)
                                for x in m.tolist()])
        return time_s + self.graph_step_overhead_s


# A100 SXM4 datasheet dense bf16 peak (the reference step below is bandwidth-bound anyway).
A100_PEAK_BF16_TFLOPS = 312.0


@lru_cache(maxsize=1)
def derived_graph_step_overhead_s() -> float:
    """Host overhead per step of a CUDA-graph engine: gpt-fast's measured compiled step time of
    LLaMA-7B at batch 1 on A100 (1 / 107 s) minus this model's A100 GPU time of that step
    (host work runs on the CPU, so it is used for every GPU). Clamped at zero if our GPU time
    were the larger."""
    a100 = CalibratedCompute(Calibration.load("a100"), A100_PEAK_BF16_TFLOPS,
                             graph_step_overhead_s=0.0)
    gpu_s = a100.decode_step_gpu_s(LLAMA_7B, 1, GPT_FAST_MEAN_CONTEXT)
    return max(0.0, 1.0 / GPT_FAST_GRAPH_TOKENS_PER_S - gpu_s)


# -- op work on ModelDims (the same formulas as measured.op_work, in plain floats) ------------


@lru_cache(maxsize=None)
def _vidur_dims(d: ModelDims) -> tuple[float, float, float, float, float, float]:
    """``(h, ffn, heads, kv heads, up-projection matrices, head width)``: 2 up-projection matrices
    (gate and up) for SwiGLU, Vidur's ``use_gated_mlp``; 1 for a GeLU MLP."""
    return (float(d.hidden_size), float(d.ffn_hidden_size), float(d.num_heads),
            float(d.num_kv_heads), 2.0 if d.gated_mlp else 1.0, float(d.head_dim))


def _mla_ops(d: ModelDims, tp: int) -> dict[str, list[tuple[Optional[float], Optional[float], float]]]:
    """Latent attention's ops in place of Vidur's (``(k, n, width)`` per GEMM of ``(m x k)`` by ``(k x
    n)``, ``(None, None, bytes per token)`` for the rotary op) on one of ``tp`` ranks, as vLLM's
    DeepSeek-V2/V3 attention shards them: the down-projections to the query latent (``h x
    q_lora_rank``) and to the KV latent with the rotary key (``h x (kv_lora_rank + qk_rope_head_dim)``)
    replicated on every rank, the up-projections of queries (``q_lora_rank x q_dim``) and of keys and
    values (``kv_lora_rank x heads (head_dim + v_head_dim)``) split by heads, the output projection by
    rows. A decode step, which runs with the key and value up-projections absorbed into the query and
    output (:attr:`ModelDims.decode_attention_width`), is priced with the same GEMMs per token."""
    b = BF16_BYTES
    h, heads = float(d.hidden_size), float(d.num_heads)
    q_dim, v_dim = float(d.q_dim), heads * float(d.v_head_dim or d.head_dim)
    kv_rank, rope = float(d.kv_lora_rank), float(d.qk_rope_head_dim)
    query = [(h, float(d.q_lora_rank)), (float(d.q_lora_rank), q_dim / tp)] if d.q_lora_rank else [(h, q_dim / tp)]
    pre = query + [(h, kv_rank + rope), (kv_rank, heads * float(d.head_dim) / tp + v_dim / tp)]
    rotary = 2.0 * (heads * rope / tp + rope)  # read and write the queries' and the key's rotary parts
    return {"attn_pre_proj": [(k, n, b * (k * n + k + n)) for k, n in pre],
            "attn_post_proj": [(v_dim / tp, h, b * (v_dim / tp * h + v_dim / tp + h))],
            "attn_rope": [(None, None, b * rotary)]}


def _op_work(op: str, dims: tuple[float, float, float, float, float, float], tp: int,
             m: float) -> tuple[float, float, float]:
    """(FLOPs, bytes, width) of a profiled op; see :func:`harness.costmodel.measured.op_work`
    (tested equal)."""
    h, f, n_head, n_kv, up, head_dim = dims
    q, kv = n_head * head_dim, max(1.0, float(int(n_kv // tp))) * head_dim
    b = BF16_BYTES
    if op in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"):
        k, n = {"attn_pre_proj": (h, q / tp + 2.0 * kv), "attn_post_proj": (q / tp, h),
                "mlp_up_proj": (h, up * f / tp), "mlp_down_proj": (f / tp, h)}[op]
        return 2.0 * m * k * n, b * (k * n + m * k + m * n), b * (k * n + k + n)
    per_token = {"input_layernorm": 2.0 * h, "post_attention_layernorm": 2.0 * h, "emb": 2.0 * h,
                 "attn_rope": 2.0 * (q / tp + kv), "mlp_act": (up + 1.0) * f / tp,
                 "add": 3.0 * h}[op]
    return 0.0, b * per_token * m, b * per_token


# -- fitting (python -m harness.calibrate fit) -----------------------------------------------


def fit_calibration(gpu: str, root: Any = None, max_curve_points: int = 48) -> dict[str, Any]:
    """The calibration of ``gpu`` fitted on every measured model of ``root`` (default: the
    shipped Vidur profiles), as the JSON-ready dict :meth:`Calibration.from_dict` reads."""
    import numpy as np

    from harness.costmodel import measured as ms

    root = ms.PROFILE_DIR if root is None else Path(root)
    table = ms.load_compute(gpu, root)
    laws = ms.fit_scaling(table)
    by_class: dict[str, dict[str, dict[str, float]]] = {}
    for (_, op_class, tp), law in sorted(laws.items()):
        by_class.setdefault(op_class, {})[str(tp)] = {
            k: float(getattr(law, k)) for k in ("c0", "c_flop", "c_byte", "f0", "f_w")}
    net = ms.load_network(gpu, root)

    def curve(part) -> list[list[float]]:
        med = part.groupby("size_bytes")["time_s"].median().sort_index()
        sizes, times = med.index.to_numpy(float), med.to_numpy(float)
        if len(sizes) > max_curve_points:  # evenly spaced in log(size), ends kept
            keep = np.unique(np.round(np.geomspace(1, len(sizes), max_curve_points)).astype(int) - 1)
            sizes, times = sizes[keep], times[keep]
        times = np.maximum.accumulate(times)  # a bigger message never takes less time
        return [[float(x) for x in sizes], [float(y) for y in times]]

    network: dict[str, Any] = {"all_reduce": {}}
    for (coll, n, per_node), part in net.groupby(["collective", "num_workers", "devices_per_node"]):
        if coll == "all_reduce" and n == per_node:
            network["all_reduce"][str(int(n))] = curve(part)
        elif coll == "send_recv" and n == 2:
            network["send_recv_intra" if per_node == 2 else "send_recv_inter"] = curve(part)
    commit = (Path(root) / "SOURCE_COMMIT")
    source = f"{Path(root).name} profiles" + (f" @ {commit.read_text().strip()[:12]}"
                                              if commit.is_file() else "")
    return {
        "format_version": FORMAT_VERSION,
        "gpu": gpu,
        "source": source,
        "models": sorted(table["model"].unique()),
        "fit": "harness.costmodel.measured.fit_scaling (all models); NCCL medians per size",
        "laws": by_class,
        "network": network,
    }
