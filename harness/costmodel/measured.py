"""Measured per-op GPU times (Vidur profiles) and a dimension-scaling rule fitted on them
(nothing here changes the cost model's defaults).

Data. ``data/profiles/vidur/compute/{h100,a100}/<model>/mlp.csv`` (Vidur, Agrawal et al.,
MLSys 2024; MIT licence, see ``data/profiles/vidur/README.md``) holds, per (num_tokens, tp),
the measured time of every non-attention op of one transformer layer on one GPU of a
tensor-parallel group. :func:`load_compute` turns them into a tidy table, one row per
(GPU, model, tp, num_tokens, op), with the model dimensions of the file and the *median* time
in seconds. :func:`load_network` does the same for the NCCL ``all_reduce`` / ``send_recv``
tables.

Work of an op. :func:`op_work` gives the FLOPs and HBM bytes (bf16) one GPU of a tp group does
for an op over ``M = num_tokens`` tokens, with Megatron sharding (column-parallel QKV and
gate/up, row-parallel output and down projections; ``h`` hidden, ``f`` ffn, ``kv`` the local
K/V width, at least one KV head per rank):

* GEMM ``M x K x N`` (``attn_pre_proj``: K = h, N = h/tp + 2 kv; ``attn_post_proj``: K = h/tp,
  N = h; ``mlp_up_proj``: K = h, N = 2f/tp; ``mlp_down_proj``: K = f/tp, N = h):
  FLOPs ``2 M K N``, bytes ``2 (K N + M K + M N)`` (weights, input, output once);
* norms: bytes ``2 * 2 M h``; rope: ``2 * 2 M (h/tp + kv)``; SwiGLU act: ``2 * 3 M f/tp``;
  residual add: ``2 * 3 M h``; embedding: ``2 * 2 M h``; FLOPs taken as zero.

Scaling rule (:func:`fit_scaling`). Per (GPU, op class, tp) the time of an op has two regimes,

    time_s = max(f0 + f_w * width,  c0 + c_flop * FLOPs + c_byte * bytes)      (all >= 0)

a *floor* (small ops are latency/launch bound: the profiles show e.g. an RMSNorm at a constant
4 us for 1..256 tokens of Llama-2-7B, then linear) that grows with the op's per-token width
(``width`` = its bytes at one token, i.e. weight bytes for GEMMs and a row's bytes for
elementwise ops), and a *throughput* regime linear in the work (an additive roofline: a latency
term, effective seconds per FLOP and per byte). Fitting: rows within 10% of the minimum time of
their (model, op) are the floor rows; ``f0, f_w`` are fitted on them and ``c0, c_flop, c_byte``
on the others, each by least squares on the *relative* residual ``(pred - measured) /
measured`` (so small and large ops weigh alike), dropping a coefficient that comes out negative
and refitting (a two-step non-negative least squares). The op classes are ``gemm`` (the four
projections, pooled: one GEMM law per GPU and tp), ``norm`` (the two RMSNorms), ``rope``,
``act``, ``add`` and ``embedding``; classes without FLOPs fit ``c0 + c_byte * bytes``. To predict
a model of other dimensions, compute its ops' work and apply the fitted law of the same (GPU,
class, tp).

:func:`heldout_error` fits on two measured models and reports ``|pred / measured - 1|`` on the
third, per op class (median, p90, max); the measured numbers are in ``docs/CALIBRATION.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # pandas is imported where the profiles are read (load_compute, load_network): every
    # process that imports the cost model (each Ray worker among them) would otherwise pay its ~0.3 s
    import pandas as pd

PROFILE_DIR = Path(__file__).resolve().parents[2] / "data" / "profiles" / "vidur"
GPUS = ("h100", "a100")
MODELS = ("Llama-2-7b-hf", "CodeLlama-34b-Instruct-hf", "Llama-2-70b-hf")
# Decoder layers of the released checkpoints (not in the CSVs; only used to build full configs).
NUM_LAYERS = {"Llama-2-7b-hf": 32, "CodeLlama-34b-Instruct-hf": 48, "Llama-2-70b-hf": 80}

# Vidur op name -> op class of the scaling rule.
OP_CLASS = {
    "emb": "embedding",
    "input_layernorm": "norm",
    "attn_pre_proj": "gemm",
    "attn_rope": "rope",
    "attn_post_proj": "gemm",
    "post_attention_layernorm": "norm",
    "mlp_up_proj": "gemm",
    "mlp_act": "act",
    "mlp_down_proj": "gemm",
    "add": "add",
}
OPS = tuple(OP_CLASS)
OP_CLASSES = ("gemm", "norm", "rope", "act", "add", "embedding")
LAYER_OPS = tuple(op for op in OPS if op != "emb")  # one decoder layer, attention core excluded
DIM_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
BYTES = 2  # bf16 / fp16


def compute_files(root: Path | str = PROFILE_DIR) -> list[tuple[str, str, Path]]:
    """(gpu, model, path) of every compute CSV under ``root``: ``<root>/compute/<gpu>/<model>/
    mlp.csv`` (the Vidur layout), or ``<root>/<gpu>/<model>/mlp.csv`` when ``root`` has no
    ``compute`` folder (the layout ``python -m harness.calibrate profile`` writes, with a device
    slug as ``gpu``)."""
    root = Path(root)
    base = root / "compute" if (root / "compute").is_dir() else root
    out = []
    if not base.is_dir():
        return out
    for gpu_dir in sorted(p for p in base.iterdir() if p.is_dir()):
        for model_dir in sorted(p for p in gpu_dir.iterdir() if p.is_dir()):
            path = model_dir / "mlp.csv"
            if path.is_file():
                out.append((gpu_dir.name, model_dir.name, path))
    return out


def load_compute(gpu: Optional[str] = None, root: Path | str = PROFILE_DIR) -> pd.DataFrame:
    """Tidy table of the Vidur compute profiles: columns ``gpu, model, n_head, n_kv_head,
    n_embd, n_expanded_embd, vocab_size, use_gated_mlp, tp, num_tokens, op, op_class, time_s``
    (median, seconds), one row per measured (GPU, model, tp, num_tokens, op)."""
    import pandas as pd

    frames = []
    for g, model, path in compute_files(root):
        if gpu is not None and g != gpu:
            continue
        raw = pd.read_csv(path)
        base = raw[list(DIM_COLUMNS) + ["num_tokens", "num_tensor_parallel_workers"]].rename(
            columns={"num_tensor_parallel_workers": "tp"})
        for op in OPS:
            part = base.copy()
            part["op"] = op
            part["time_s"] = raw[f"time_stats.{op}.median"].astype(float) * 1e-3
            frames.append(part.assign(gpu=g, model=model))
    if not frames:
        raise ValueError(f"no Vidur compute profiles under {root} for gpu={gpu!r}")
    df = pd.concat(frames, ignore_index=True)
    df["use_gated_mlp"] = df["use_gated_mlp"].astype(str).str.lower().eq("true")
    for col in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "tp",
                "num_tokens"):
        df[col] = df[col].astype(int)
    df["op_class"] = df["op"].map(OP_CLASS)
    cols = ["gpu", "model", *DIM_COLUMNS, "tp", "num_tokens", "op", "op_class", "time_s"]
    return df[cols]


def load_network(gpu: Optional[str] = None, root: Path | str = PROFILE_DIR) -> pd.DataFrame:
    """Tidy NCCL table: ``gpu, collective, num_workers, devices_per_node, size_bytes, time_s``
    (median, seconds). ``size`` is read as bytes (see ``data/profiles/vidur/README.md``)."""
    import pandas as pd

    frames = []
    for path in sorted(Path(root, "network").glob("*/*.csv")):
        g = path.parent.name.removesuffix("_dgx")
        if gpu is not None and g != gpu:
            continue
        raw = pd.read_csv(path)
        coll = path.stem
        frames.append(pd.DataFrame({
            "gpu": g, "collective": raw["collective"].astype(str),
            "num_workers": raw["num_workers"].astype(int),
            "devices_per_node": raw["devices_per_node"].astype(int),
            "size_bytes": raw["size"].astype(float),
            "time_s": raw[f"time_stats.{coll}.median"].astype(float) * 1e-3,
        }))
    if not frames:
        raise ValueError(f"no Vidur network profiles under {root} for gpu={gpu!r}")
    return pd.concat(frames, ignore_index=True)


# ----------------------------------------------------------------------------------------
# Work of an op
# ----------------------------------------------------------------------------------------


def op_work(op: str, dims: pd.DataFrame | dict, tp, num_tokens) -> tuple[np.ndarray, np.ndarray]:
    """(FLOPs, bytes) per GPU of ``op`` over ``num_tokens`` tokens at tensor parallelism ``tp``
    for a model with Vidur-style dimensions ``dims`` (``n_head, n_kv_head, n_embd,
    n_expanded_embd, use_gated_mlp``, and ``head_dim`` where a model's head width is not
    ``n_embd / n_head``; scalars or arrays). See the module docstring."""
    h = np.asarray(dims["n_embd"], dtype=float)
    f = np.asarray(dims["n_expanded_embd"], dtype=float)
    n_head = np.asarray(dims["n_head"], dtype=float)
    n_kv = np.asarray(dims["n_kv_head"], dtype=float)
    gated = np.asarray(dims.get("use_gated_mlp", True), dtype=bool)
    tp = np.asarray(tp, dtype=float)
    m = np.asarray(num_tokens, dtype=float)
    head_dim = np.asarray(dims["head_dim"], dtype=float) if "head_dim" in dims else h / n_head
    q = n_head * head_dim  # the Q projection's width (n_embd unless the model sets its head width)
    kv = np.maximum(1.0, np.floor(n_kv / tp)) * head_dim  # local K (and V) width

    def gemm(k, n):
        return 2.0 * m * k * n, BYTES * (k * n + m * k + m * n)

    zero = np.zeros_like(m * h)
    if op == "attn_pre_proj":
        return gemm(h, q / tp + 2.0 * kv)
    if op == "attn_post_proj":
        return gemm(q / tp, h)
    if op == "mlp_up_proj":
        return gemm(h, np.where(gated, 2.0, 1.0) * f / tp)
    if op == "mlp_down_proj":
        return gemm(f / tp, h)
    if op in ("input_layernorm", "post_attention_layernorm", "emb"):
        return zero, BYTES * 2.0 * m * h
    if op == "attn_rope":
        return zero, BYTES * 2.0 * m * (q / tp + kv)
    if op == "mlp_act":
        return zero, BYTES * np.where(gated, 3.0, 2.0) * m * f / tp
    if op == "add":
        return zero, BYTES * 3.0 * m * h
    raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


def with_work(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (a :func:`load_compute` table) with ``flops``, ``bytes`` and ``width`` (the op's bytes
    at one token) columns added."""
    out = df.copy()
    out["flops"] = 0.0
    out["bytes"] = 0.0
    out["width"] = 0.0
    for op, idx in out.groupby("op").groups.items():
        part = out.loc[idx]
        flops, nbytes = op_work(op, part, part["tp"].to_numpy(), part["num_tokens"].to_numpy())
        out.loc[idx, "flops"] = flops
        out.loc[idx, "bytes"] = nbytes
        out.loc[idx, "width"] = op_work(op, part, part["tp"].to_numpy(), np.ones(len(part)))[1]
    return out


# ----------------------------------------------------------------------------------------
# Scaling rule
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Law:
    """``time_s = max(f0 + f_w * width, c0 + c_flop * flops + c_byte * bytes)`` for one
    (GPU, op class, tp); see the module docstring."""

    c0: float
    c_flop: float
    c_byte: float
    f0: float = 0.0
    f_w: float = 0.0

    def __call__(self, flops, nbytes, width=0.0):
        linear = self.c0 + self.c_flop * np.asarray(flops) + self.c_byte * np.asarray(nbytes)
        return np.maximum(self.f0 + self.f_w * np.asarray(width), linear)

    def seconds(self, flops: float, nbytes: float, width: float) -> float:
        """Scalar form of ``__call__`` (plain floats, for the simulator's hot paths)."""
        return max(self.f0 + self.f_w * width, self.c0 + self.c_flop * flops + self.c_byte * nbytes)


NEGLIGIBLE_FRAC = 1e-12  # of the largest time: a fitted term below this is set to zero


def _nnls_relative(cols: dict[str, np.ndarray], time_s: np.ndarray) -> dict[str, float]:
    """Non-negative least squares of ``sum_k coef_k * col_k ~ time_s`` on the relative residual."""
    active = [k for k, v in cols.items() if np.any(v > 0)]
    values = dict.fromkeys(cols, 0.0)
    if not active or time_s.size == 0:
        return values
    while True:
        a = np.column_stack([cols[k] / time_s for k in active])
        coef, *_ = np.linalg.lstsq(a, np.ones_like(time_s), rcond=None)
        if np.all(coef >= 0) or len(active) == 1:
            break
        active = [k for k, c in zip(active, coef) if c >= 0] or active[:1]
    values.update({k: max(0.0, float(c)) for k, c in zip(active, coef)})
    # a coefficient whose largest contribution is rounding noise (e.g. 1e-27 s per unit of width
    # on 1e-5 s kernels) is zero: its value otherwise depends on the LAPACK build, and the shipped
    # fit must be reproducible on any machine (tests/harness/costmodel/test_calibrated.py)
    scale = float(np.max(np.abs(time_s)))
    for k in values:
        if values[k] * float(np.max(np.abs(cols[k]))) < NEGLIGIBLE_FRAC * scale:
            values[k] = 0.0
    return values


def _fit_law(flops: np.ndarray, nbytes: np.ndarray, time_s: np.ndarray,
             width: Optional[np.ndarray] = None, floor: Optional[np.ndarray] = None) -> Law:
    """Fit a :class:`Law`; ``floor`` marks the floor rows (none: a purely linear law)."""
    if floor is None or not np.any(floor) or np.count_nonzero(~floor) < 3:
        lin = _nnls_relative({"c0": np.ones_like(time_s), "c_flop": flops, "c_byte": nbytes}, time_s)
        return Law(**lin)
    width = np.zeros_like(time_s) if width is None else width
    fl = _nnls_relative({"f0": np.ones(int(floor.sum())), "f_w": width[floor]}, time_s[floor])
    up = ~floor
    lin = _nnls_relative({"c0": np.ones(int(up.sum())), "c_flop": flops[up], "c_byte": nbytes[up]},
                         time_s[up])
    return Law(**lin, **fl)


def floor_rows(df: pd.DataFrame, tolerance_frac: float = 0.1) -> np.ndarray:
    """Rows within ``tolerance_frac`` of the minimum time of their (gpu, model, op, tp)."""
    least = df.groupby(["gpu", "model", "op", "tp"])["time_s"].transform("min")
    return (df["time_s"] <= (1.0 + tolerance_frac) * least).to_numpy()


def fit_scaling(df: pd.DataFrame) -> dict[tuple[str, str, int], Law]:
    """Fit the scaling rule on every row of ``df`` (a :func:`load_compute` table, any models):
    one :class:`Law` per (gpu, op_class, tp)."""
    df = df if "flops" in df else with_work(df)
    df = df[df["time_s"] > 0].reset_index(drop=True)
    floor = floor_rows(df)
    laws = {}
    for (g, c, tp), idx in df.groupby(["gpu", "op_class", "tp"]).indices.items():
        part = df.iloc[idx]
        laws[(g, c, int(tp))] = _fit_law(part["flops"].to_numpy(), part["bytes"].to_numpy(),
                                         part["time_s"].to_numpy(), part["width"].to_numpy(),
                                         floor[idx])
    return laws


def predict(laws: dict[tuple[str, str, int], Law], df: pd.DataFrame) -> np.ndarray:
    """Predicted seconds of every row of ``df`` (needs gpu, op_class, tp and the work)."""
    df = df if "flops" in df else with_work(df)
    out = np.full(len(df), np.nan)
    for (g, c, tp), idx in df.groupby(["gpu", "op_class", "tp"]).indices.items():
        law = laws.get((g, c, int(tp)))
        if law is not None:
            part = df.iloc[idx]
            out[idx] = law(part["flops"].to_numpy(), part["bytes"].to_numpy(),
                           part["width"].to_numpy())
    return out


def error_stats(rel_err: Iterable[float]) -> dict[str, float]:
    """median, p90 and max of ``|rel_err|`` and the count ``n``."""
    e = np.abs(np.asarray(list(rel_err), dtype=float))
    if e.size == 0:
        return {"n": 0, "median": float("nan"), "p90": float("nan"), "max": float("nan")}
    return {"n": int(e.size), "median": float(np.median(e)), "p90": float(np.quantile(e, 0.9)),
            "max": float(e.max())}


def heldout_error(gpu: str, fit_models: Sequence[str], heldout_model: str,
                  root: Path | str = PROFILE_DIR,
                  table: Optional[pd.DataFrame] = None) -> dict[str, dict[str, float]]:
    """Fit the scaling rule on ``fit_models`` of ``gpu`` and report ``|pred / measured - 1|``
    on every row of ``heldout_model``, per op class (``n, median, p90, max``) plus ``layer``:
    the sum of the layer's ops (all but the embedding) per (tp, num_tokens).

    Rows measured at 0 ms (below the profiler's 1 us resolution) are skipped."""
    if heldout_model in fit_models:
        raise ValueError(f"held-out model {heldout_model!r} is among the fit models")
    df = with_work(table if table is not None else load_compute(gpu, root))
    df = df[df["gpu"] == gpu]
    fit = df[df["model"].isin(list(fit_models))]
    missing = set(fit_models) - set(fit["model"]) | ({heldout_model} - set(df["model"]))
    if missing:
        raise ValueError(f"no {gpu} profile for model(s) {sorted(missing)}")
    laws = fit_scaling(fit)
    test = df[df["model"] == heldout_model].reset_index(drop=True)
    test = test.assign(pred_s=predict(laws, test))
    out = {}
    for c in OP_CLASSES:
        part = test[(test["op_class"] == c) & (test["time_s"] > 0)]
        out[c] = error_stats(part["pred_s"] / part["time_s"] - 1.0)
    # Duplicate (tp, num_tokens) measurements are averaged per op, then the ops summed.
    layer = (test[test["op"].isin(LAYER_OPS)]
             .groupby(["tp", "num_tokens", "op"])[["time_s", "pred_s"]].mean()
             .groupby(["tp", "num_tokens"]).sum())
    out["layer"] = error_stats(layer["pred_s"] / layer["time_s"] - 1.0)
    return out
