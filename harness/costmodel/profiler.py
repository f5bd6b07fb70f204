"""Time the Vidur op table of one transformer layer on the local device.

:func:`profile_ops` runs, for each ``num_tokens``, every non-attention op of one LLaMA decoder
layer as Vidur lists them (``measured.OPS``: ``emb, input_layernorm, attn_pre_proj, attn_rope,
attn_post_proj, post_attention_layernorm, mlp_up_proj, mlp_act, mlp_down_proj, add``) on one
device of a tensor-parallel group (Megatron sharding, the same shapes as
:func:`harness.costmodel.measured.op_work`):

* ``emb``: embedding lookup of ``num_tokens`` ids in a ``(vocab/tp, h)`` table;
* ``input_layernorm`` / ``post_attention_layernorm``: RMSNorm over ``h``
  (:class:`harness.real.model.RMSNorm`);
* ``attn_pre_proj``: QKV GEMM ``(M, h) x (h, (heads/tp + 2 kv_heads/tp) * head_dim)``
  (at least one KV head per rank);
* ``attn_rope``: rotary embedding of the local Q and K heads (:func:`harness.real.model.rotary`);
* ``attn_post_proj``: output GEMM ``(M, h/tp) x (h/tp, h)``;
* ``mlp_up_proj``: gate+up GEMM ``(M, h) x (h, 2 f/tp)``; ``mlp_act``: ``silu(gate) * up``;
  ``mlp_down_proj``: ``(M, f/tp) x (f/tp, h)``;
* ``add``: the residual add over ``(M, h)``.

On CUDA the ops run in bf16 and are timed with CUDA events (one event pair per call, after a
``torch.cuda.synchronize``); on CPU in fp32 with :func:`time.perf_counter`. Each op gets
``warmup`` untimed calls and ``repeats`` timed ones.

CPU threads: on a machine whose cores are shared with other work, torch's multi-threaded small
GEMMs can stall for a scheduler quantum (measured here: a 1-token QKV GEMM of the tiny model at a
median 5-7 ms with 2 threads against 2 us with 1), so ``num_threads`` (CPU only) pins torch's
intra-op thread count for the run; ``None`` keeps torch's default.

Rows (:func:`write_profile_csv`) have Vidur's ``mlp.csv`` columns, so
:func:`harness.costmodel.measured.load_compute` reads them like the public files:
``time_stats.<op>.{min,max,mean,median,std}`` in milliseconds for every op (std with ddof=0),
then ``n_head, n_kv_head, n_embd, n_expanded_embd, vocab_size, use_gated_mlp, num_tokens,
num_tensor_parallel_workers``, then extra columns the loader ignores: ``device_name`` (e.g.
``NVIDIA H100 80GB HBM3`` or the CPU model), ``device`` (``cuda`` / ``cpu``), ``dtype``,
``threads`` (torch's CPU threads during the run), ``repeats``, ``warmup``, ``model``. ``python -m harness.calibrate profile`` writes them to
``<out>/<device_slug>/<model>/mlp.csv`` (default ``data/profiles/local``); read them back with
``measured.load_compute(root=<out>)`` (the device slug plays the role of the GPU name).
"""
from __future__ import annotations

import csv
import platform
import re
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from harness.costmodel.measured import DIM_COLUMNS, OPS

LOCAL_PROFILE_DIR = Path(__file__).resolve().parents[2] / "data" / "profiles" / "local"
STATS = ("min", "max", "mean", "median", "std")
TIME_COLUMNS = tuple(f"time_stats.{op}.{s}" for op in OPS for s in STATS)
KEY_COLUMNS = ("num_tokens", "num_tensor_parallel_workers")
EXTRA_COLUMNS = ("device_name", "device", "dtype", "threads", "repeats", "warmup", "model")
COLUMNS = (*TIME_COLUMNS, *DIM_COLUMNS, *KEY_COLUMNS, *EXTRA_COLUMNS)


def resolve_device(device: str = "auto") -> str:
    """``"cuda"`` if ``device`` is ``"auto"`` and CUDA is available, else ``"cpu"``; an explicit
    ``"cuda"`` / ``"cuda:N"`` / ``"cpu"`` is returned as given."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but torch.cuda.is_available() is False")
    return device


def device_name(device: str) -> str:
    """A human-readable name of ``device``: the CUDA device name, or the CPU model."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine() or "unknown")


def slug(name: str) -> str:
    """Directory-safe form of a device name: ``"NVIDIA H100 80GB HBM3"`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _timer(device: str) -> Callable[[Callable[[], object], int, int], np.ndarray]:
    """A function ``(fn, warmup, repeats) -> times in ms`` for ``device``."""
    import torch

    if device.startswith("cuda"):
        def run(fn, warmup, repeats):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(repeats)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return np.array([s.elapsed_time(e) for s, e in events], dtype=float)
        return run

    def run(fn, warmup, repeats):
        for _ in range(warmup):
            fn()
        out = np.empty(repeats)
        for i in range(repeats):
            t0 = time.perf_counter()
            fn()
            out[i] = (time.perf_counter() - t0) * 1e3
        return out
    return run


def local_dims(llama_cfg, tp: int = 1) -> dict[str, int]:
    """Per-rank sizes at tensor parallelism ``tp``: ``heads, kv_heads, head_dim, q, kv, h_tp,
    f_tp, vocab_tp`` (``q`` / ``kv`` the local Q and K (= V) widths)."""
    h, heads, kv_heads = llama_cfg.hidden_size, llama_cfg.num_heads, llama_cfg.num_kv_heads
    if getattr(llama_cfg, "num_experts", 0):  # Vidur's ops are a dense layer's: no router, no experts
        raise ValueError(f"num_experts={llama_cfg.num_experts}: profiles of mixture-of-experts layers are not "
                         f"supported (the profile table's ops are those of a dense decoder layer)")
    if getattr(llama_cfg, "kv_lora_rank", 0):  # and of standard attention: fused QKV, one output projection
        raise ValueError(f"kv_lora_rank={llama_cfg.kv_lora_rank}: profiles of latent attention are not supported "
                         f"(the profile table's ops are those of standard multi-head attention)")
    if h % heads:
        raise ValueError(f"hidden_size={h} is not divisible by num_heads={heads}")
    head_dim = h // heads
    own = getattr(llama_cfg, "head_dim", None)
    if own is not None and own != head_dim:  # the profile table's columns have no head width
        raise ValueError(f"head_dim={own} differs from hidden_size / num_heads = {head_dim}: profiles of "
                         f"such models are not supported (the profile table has no head_dim column)")
    loc_heads = max(1, heads // tp)
    loc_kv = max(1, kv_heads // tp)
    return {"heads": loc_heads, "kv_heads": loc_kv, "head_dim": head_dim,
            "q": loc_heads * head_dim, "kv": loc_kv * head_dim,
            "h_tp": max(1, h // tp), "f_tp": max(1, llama_cfg.ffn_hidden_size // tp),
            "vocab_tp": max(1, llama_cfg.vocab_size // tp)}


def profile_ops(llama_cfg, num_tokens_list: Sequence[int], device: str = "auto", tp: int = 1,
                repeats: int = 20, warmup: int = 5, dtype=None, seed: int = 0,
                num_threads: Optional[int] = None) -> list[dict]:
    """Time every Vidur op of one decoder layer of ``llama_cfg`` (a ``LlamaConfig``) on one
    device of a ``tp``-way group, for each ``num_tokens``; one row per ``num_tokens`` with the
    columns of :data:`COLUMNS` (times in ms). ``dtype`` defaults to bf16 on CUDA, fp32 on CPU;
    ``num_threads`` sets torch's CPU thread count during a CPU run (restored afterwards)."""
    import torch

    dev = resolve_device(device)
    old_threads = torch.get_num_threads()
    if num_threads is not None and not dev.startswith("cuda"):
        torch.set_num_threads(int(num_threads))
    try:
        return _profile(llama_cfg, num_tokens_list, dev, tp, repeats, warmup, dtype, seed)
    finally:
        torch.set_num_threads(old_threads)


def _profile(llama_cfg, num_tokens_list, dev, tp, repeats, warmup, dtype, seed) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from harness.real.model import RMSNorm, rotary

    if repeats < 1 or warmup < 0:
        raise ValueError("need repeats >= 1 and warmup >= 0")
    if dtype is None:
        dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    name = device_name(dev)
    timer = _timer(dev)
    d = local_dims(llama_cfg, tp)
    h = llama_cfg.hidden_size
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(device=dev, dtype=dtype)

    # Weights of one rank (shared by every num_tokens).
    w_emb = rand(d["vocab_tp"], h)
    w_qkv = rand(d["q"] + 2 * d["kv"], h)
    w_o = rand(h, d["h_tp"])
    w_gu = rand(2 * d["f_tp"], h)
    w_down = rand(h, d["f_tp"])
    norm1 = RMSNorm(h, 1e-6).to(device=dev, dtype=dtype)
    norm2 = RMSNorm(h, 1e-6).to(device=dev, dtype=dtype)
    theta = 10000.0

    rows = []
    with torch.inference_mode():
        for m in num_tokens_list:
            m = int(m)
            if m < 1:
                raise ValueError(f"num_tokens must be >= 1, got {m}")
            ids = torch.randint(0, d["vocab_tp"], (m,), generator=gen).to(dev)
            x = rand(m, h)
            res = rand(m, h)
            q = rand(1, d["heads"], m, d["head_dim"])
            k = rand(1, d["kv_heads"], m, d["head_dim"])
            pos = torch.arange(m, device=dev)[None, :]
            attn = rand(m, d["h_tp"])
            gu = rand(m, 2 * d["f_tp"])
            act = rand(m, d["f_tp"])

            def mlp_act():
                gate, up = gu.chunk(2, dim=-1)
                return F.silu(gate) * up

            ops = {
                "emb": lambda: F.embedding(ids, w_emb),
                "input_layernorm": lambda: norm1(x),
                "attn_pre_proj": lambda: F.linear(x, w_qkv),
                "attn_rope": lambda: (rotary(q, pos, theta), rotary(k, pos, theta)),
                "attn_post_proj": lambda: F.linear(attn, w_o),
                "post_attention_layernorm": lambda: norm2(x),
                "mlp_up_proj": lambda: F.linear(x, w_gu),
                "mlp_act": mlp_act,
                "mlp_down_proj": lambda: F.linear(act, w_down),
                "add": lambda: x + res,
            }
            assert tuple(ops) == OPS
            row: dict = {}
            for op, fn in ops.items():
                t = timer(fn, warmup, repeats)
                row.update({f"time_stats.{op}.min": float(t.min()),
                            f"time_stats.{op}.max": float(t.max()),
                            f"time_stats.{op}.mean": float(t.mean()),
                            f"time_stats.{op}.median": float(np.median(t)),
                            f"time_stats.{op}.std": float(t.std())})
            row.update({"n_head": llama_cfg.num_heads, "n_kv_head": llama_cfg.num_kv_heads,
                        "n_embd": h, "n_expanded_embd": llama_cfg.ffn_hidden_size,
                        "vocab_size": llama_cfg.vocab_size, "use_gated_mlp": True,
                        "num_tokens": m, "num_tensor_parallel_workers": int(tp),
                        "device_name": name, "device": dev.split(":")[0],
                        "dtype": str(dtype).removeprefix("torch."),
                        "threads": torch.get_num_threads(), "repeats": int(repeats),
                        "warmup": int(warmup), "model": llama_cfg.name})
            rows.append({c: row[c] for c in COLUMNS})
    return rows


def write_profile_csv(rows: Sequence[dict], path: Path | str) -> Path:
    """Write ``rows`` (from :func:`profile_ops`) as a Vidur-format ``mlp.csv`` at ``path``
    (parent directories created, an existing file replaced)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r[c] for c in COLUMNS})
    return path


def profile_path(out_dir: Path | str, device_name_: str, model: str) -> Path:
    """``<out_dir>/<slug(device_name)>/<model>/mlp.csv``."""
    return Path(out_dir) / slug(device_name_) / model / "mlp.csv"


def format_rows(rows: Sequence[dict], ops: Optional[Sequence[str]] = None) -> str:
    """A short table of the median times (ms) of ``rows``, one line per (tp, num_tokens), with
    the layer sum (all ops but the embedding)."""
    ops = tuple(ops or OPS)
    short = {"emb": "emb", "input_layernorm": "in_norm", "attn_pre_proj": "qkv",
             "attn_rope": "rope", "attn_post_proj": "o_proj",
             "post_attention_layernorm": "post_norm", "mlp_up_proj": "up", "mlp_act": "act",
             "mlp_down_proj": "down", "add": "add"}
    head = f"{'tokens':>6} {'tp':>2} " + " ".join(f"{short.get(o, o):>9}" for o in ops) \
        + f" {'layer':>9}"
    lines = [head]
    for r in rows:
        med = [r[f"time_stats.{o}.median"] for o in ops]
        layer = sum(r[f"time_stats.{o}.median"] for o in OPS if o != "emb")
        lines.append(f"{r['num_tokens']:>6d} {r['num_tensor_parallel_workers']:>2d} "
                     + " ".join(f"{v:>9.4f}" for v in med) + f" {layer:>9.4f}")
    return "\n".join(lines)
