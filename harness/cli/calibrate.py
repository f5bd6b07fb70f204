"""``python -m harness.calibrate report [--gpu h100|a100] [--csv out.csv]``: the analytic cost
model against the measured Vidur profiles (``docs/CALIBRATION.md``).

``python -m harness.calibrate fit [--gpu h100 a100]``: fit the calibrated cost model
(:mod:`harness.costmodel.calibrated`) on the shipped profiles and write
``data/profiles/fitted/<gpu>.json``, the file the H100/A100 cluster configs name.

``python -m harness.calibrate profile --model tiny --num-tokens 1 8 64 [--out DIR]``: time the
same op table on the local device (:mod:`harness.costmodel.profiler`; CUDA in bf16 when
available, else CPU in fp32) and write ``DIR/<device slug>/<model>/mlp.csv`` (default
``data/profiles/local``) in Vidur's format, readable with
``measured.load_compute(root=DIR)``.

``python -m harness.calibrate compare --local data/profiles/local [--gpu h100]``: our own
profile rows (``profile`` on a GPU) against the Vidur rows of the same shapes (models matched by
their dimensions, then tp, num_tokens and op): per op class and token range, and per layer, the
median of ``ours / Vidur`` (``ratio``) and ``|ours / Vidur - 1|`` (docs/GPU.md shows an H100 run).

``report`` prints three tables of ``|model / measured - 1|`` (median, p90, max over rows; ``ratio`` is the
median of ``model / measured``, > 1 when the model is slow):

1. ``layer``: :class:`~harness.costmodel.CostModel` (``conf/cluster/<gpu>_8x.yaml``, defaults
   untouched) has no per-op compute functions, only whole-layer ones, so the measured sum of one
   layer's non-attention ops (all Vidur ops but the embedding; duplicate measurements averaged)
   is compared with ``CostModel.forward_s(model, num_tokens, seq_len=0, tp, num_layers=1,
   include_head=False)`` minus its tensor-parallel all-reduces (the Vidur compute rows contain
   neither the attention kernel nor the all-reduce). The analytic bytes still include the
   attention kernel's activation reads/writes, a few percent of a layer's activation traffic.
   Under the same table, ``per-op roofline`` applies the cluster's roofline constants to each op's
   FLOPs and bytes (:func:`harness.costmodel.measured.op_work`) to show where the layer error
   comes from (diagnostic; the cost model does not time ops this way).
2. ``network``: ``CostModel.allreduce_s`` / ``CostModel.p2p_s`` against the NCCL tables (groups
   packed ``devices_per_node`` per node; ``size`` read as bytes).
3. ``held-out scaling``: the scaling rule of :mod:`harness.costmodel.measured`, fitted on two
   models, on the third, per op class.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from harness.core.config import LlamaConfig
from harness.costmodel import CostModel, OpCost
from harness.costmodel import measured as ms
from harness.run import pipeline

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
CLUSTERS = {"h100": "h100_8x", "a100": "a100_8x"}
_DIM_MAP = {"hidden_size": "n_embd", "num_heads": "n_head", "num_kv_heads": "n_kv_head",
            "ffn_hidden_size": "n_expanded_embd", "vocab_size": "vocab_size"}


def cost_model_for(gpu: str, kind: str = "calibrated") -> CostModel:
    """The project's CostModel on ``conf/cluster/<gpu>_8x.yaml`` with ``cluster.cost_model=kind``
    (two nodes, so the cross-node network rows have somewhere to go; compute times do not depend
    on the node count)."""
    overrides = ["+system=rlhfuse_base", f"cluster={CLUSTERS[gpu]}", "cluster.num_nodes=2",
                 f"cluster.cost_model={kind}"]
    return pipeline.prepare(pipeline.compose(overrides), overrides).ctx.cost_model


def _layer_model_s(cm: CostModel, cfg: LlamaConfig, n: float, tp: int) -> float:
    """One layer's non-attention ops, no tp all-reduce: what a Vidur layer row measures."""
    if cm.calibration is not None:
        from harness.costmodel.llama import ModelDims

        return cm.compute.linear_layer_s(ModelDims.of(cfg), tp, n)
    fwd = cm.forward_s(cfg, n, 0.0, tp=tp, num_layers=1, include_head=False)
    return fwd - cm.roofline.forward_cost(cfg, n, 0.0, tp, num_layers=1, include_head=False).comm_s


def model_configs(table: pd.DataFrame) -> dict[str, tuple[LlamaConfig, str]]:
    """Per Vidur model: a LlamaConfig and where it came from. A project ``conf/llama`` config is
    used only if all its dimensions (vocab included) match the CSV's; otherwise one is built
    from the CSV's dimensions."""
    project = {}
    for path in sorted((CONF_DIR / "llama").glob("*.yaml")):
        raw = OmegaConf.load(path)
        project[path.stem] = {k: raw.get(k, 32000 if k == "vocab_size" else None) for k in _DIM_MAP}
    out = {}
    for model, part in table.groupby("model"):
        row = part.iloc[0]
        dims = {k: int(row[v]) for k, v in _DIM_MAP.items()}
        match = next((name for name, d in project.items() if d == dims), None)
        if match is not None:
            raw = OmegaConf.load(CONF_DIR / "llama" / f"{match}.yaml")
            raw.pop("defaults", None)
            cfg = LlamaConfig(**OmegaConf.to_container(raw))
            out[model] = (cfg, f"conf/llama/{match}.yaml")
        else:
            cfg = LlamaConfig(name=model, num_layers=ms.NUM_LAYERS.get(model, 1), **dims)
            close = [n for n, d in project.items()
                     if {k: v for k, v in d.items() if k != "vocab_size"}
                     == {k: v for k, v in dims.items() if k != "vocab_size"}]
            note = "from CSV dims" + (f" ({', '.join(close)} differ only in vocab_size)"
                                      if close else "")
            out[model] = (cfg, note)
    return out


def _stats_row(section: str, gpu: str, op_class: str, group: str, ratio: np.ndarray) -> dict:
    ratio = np.asarray(ratio, dtype=float)
    stats = ms.error_stats(ratio - 1.0)
    return {"section": section, "gpu": gpu, "op_class": op_class, "group": group, **stats,
            "ratio": float(np.median(ratio)) if ratio.size else float("nan")}


def layer_rows(gpu: str, cm: CostModel, table: pd.DataFrame,
               configs: dict[str, tuple[LlamaConfig, str]]) -> list[dict]:
    """Analytic one-layer forward (no tp all-reduce) against the measured layer sums, and the
    per-op roofline diagnostic."""
    layer = (table[table["op"].isin(ms.LAYER_OPS)]
             .groupby(["model", "tp", "num_tokens", "op"], as_index=False)["time_s"].mean())
    sums = layer.groupby(["model", "tp", "num_tokens"], as_index=False)["time_s"].sum()
    label = "calibrated (in-sample)" if cm.calibration is not None else "roofline"
    model_s = [_layer_model_s(cm, configs[r.model][0], float(r.num_tokens), int(r.tp))
               for r in sums.itertuples(index=False)]
    sums["ratio"] = np.asarray(model_s) / sums["time_s"].to_numpy()
    rows = [_stats_row(f"layer {label}", gpu, "layer", f"tp{tp}", part["ratio"])
            for tp, part in sums.groupby("tp")]
    rows.append(_stats_row(f"layer {label}", gpu, "layer", "all", sums["ratio"]))
    if cm.calibration is not None:
        return rows
    # Diagnostic: the cluster's roofline constants on each op's work.
    work = ms.with_work(layer.assign(
        gpu=gpu, op_class=layer["op"].map(ms.OP_CLASS),
        **{c: layer["model"].map(table.groupby("model")[c].first())
           for c in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp")}))
    work = work[work["time_s"] > 0]
    pred = np.array([cm.roofline.seconds(OpCost(f, b)) for f, b in
                     zip(work["flops"].to_numpy(), work["bytes"].to_numpy())])
    work = work.assign(ratio=pred / work["time_s"].to_numpy())
    for c in ms.OP_CLASSES:
        part = work[work["op_class"] == c]
        if len(part):
            rows.append(_stats_row("per-op roofline", gpu, c, "all", part["ratio"]))
    return rows


def network_rows(gpu: str, cm: CostModel, net: pd.DataFrame) -> list[dict]:
    """CostModel's alpha-beta collectives against the NCCL measurements."""
    rows = []
    net = net[net["time_s"] > 0]
    for (coll, nw, dpn), part in net.groupby(["collective", "num_workers", "devices_per_node"]):
        nodes = -(-int(nw) // int(dpn))
        devices = [node * cm.gpus_per_node + j for node in range(nodes) for j in range(int(dpn))]
        sizes = part["size_bytes"].to_numpy()
        if coll == "all_reduce":
            pred = np.array([cm.allreduce_s(b, devices) for b in sizes])
        elif coll == "send_recv":
            pred = np.array([cm.p2p_s(b, devices[0], devices[-1]) for b in sizes])
        else:
            continue
        kind = "calibrated" if cm.calibration is not None else "roofline"
        rows.append(_stats_row(f"network {kind}", gpu, coll,
                               f"n{nw} x{nodes}node", pred / part["time_s"].to_numpy()))
    return rows


def heldout_rows(gpu: str, table: pd.DataFrame) -> list[dict]:
    rows = []
    models = sorted(table["model"].unique())
    for held in models:
        fit = [m for m in models if m != held]
        res = ms.heldout_error(gpu, fit, held, table=table)
        for c, st in res.items():
            rows.append({"section": "held-out scaling", "gpu": gpu, "op_class": c,
                         "group": f"-> {held}", **st, "ratio": float("nan")})
    return rows


def report(gpu: str = "h100", root: Path | str = ms.PROFILE_DIR) -> tuple[pd.DataFrame, str]:
    """All rows of the report for ``gpu`` and a header describing what was compared."""
    table = ms.load_compute(gpu, root)
    roof, cal = cost_model_for(gpu, "roofline"), cost_model_for(gpu, "calibrated")
    configs = model_configs(table)
    net = ms.load_network(gpu, root)
    rows = layer_rows(gpu, roof, table, configs) + layer_rows(gpu, cal, table, configs)
    rows += network_rows(gpu, roof, net) + network_rows(gpu, cal, net)
    rows += heldout_rows(gpu, table)
    g = roof.gpu
    try:
        shown = Path(root).resolve().relative_to(CONF_DIR.parent)
    except ValueError:
        shown = Path(root)
    header = [
        f"# Calibration report: {gpu}, cluster conf/cluster/{CLUSTERS[gpu]}.yaml "
        f"({g.name}: {g.peak_bf16_tflops:g} TFLOP/s x {g.matmul_efficiency_frac:g}, "
        f"{g.hbm_bandwidth_gbps:g} GB/s x {g.memory_efficiency_frac:g}), data {shown}",
        "# err = |model / measured - 1| over measured rows; ratio = median model / measured.",
        "# 'layer': the sum of one layer's measured non-attention ops (embedding excluded) against "
        "the roofline (CostModel.forward_s(num_layers=1, seq_len=0,",
        "# include_head=False) minus its tp all-reduces) and the calibrated model (the same ops' "
        "fitted laws; fitted on all three models, so in-sample).",
        "# 'per-op roofline' is a diagnostic (cluster roofline constants on each op's FLOPs/bytes); "
        "'held-out scaling' fits measured.fit_scaling on two models, tests the third",
        "# (the calibrated model's out-of-sample error). 'network': CostModel.allreduce_s / p2p_s "
        "of each model against the NCCL tables.",
    ]
    for model, (cfg, src) in sorted(configs.items()):
        header.append(f"# {model}: h={cfg.hidden_size} heads={cfg.num_heads}/{cfg.num_kv_heads} "
                      f"ffn={cfg.ffn_hidden_size} vocab={cfg.vocab_size} -- {src}")
    return pd.DataFrame(rows), "\n".join(header)


def format_table(df: pd.DataFrame) -> str:
    """The rows as a fixed-width table; with rows of several devices, each row names its device."""
    several = df["gpu"].nunique() > 1
    dev = max((len(str(g)) for g in df["gpu"]), default=0) if several else 0
    lines = [(f"{'device':<{dev}} " if several else "") + f"{'section':<29} {'op class':<14} {'group':<30} {'n':>6} "
             f"{'median':>7} {'p90':>7} {'max':>7} {'ratio':>6}"]
    for r in df.itertuples(index=False):
        ratio = "" if np.isnan(r.ratio) else f"{r.ratio:6.2f}"
        lines.append((f"{r.gpu:<{dev}} " if several else "") + f"{r.section:<29} {r.op_class:<14} {r.group:<30} "
                     f"{r.n:>6d} {r.median:>7.3f} {r.p90:>7.3f} {r.max:>7.3f} {ratio:>6}".rstrip())
    return "\n".join(lines)


def figure(gpu: str, path: Path | str, root: Path | str = ms.PROFILE_DIR) -> Path:
    """Measured vs modelled time of one layer's non-attention ops over num_tokens, per model
    (rows) and tp 1 / 8 (columns): the measured medians, the roofline and the calibrated model.
    Written as PNG (and PDF when ``path`` ends in .png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = ms.load_compute(gpu, root)
    configs = model_configs(table)
    roof, cal = cost_model_for(gpu, "roofline"), cost_model_for(gpu, "calibrated")
    layer = (table[table["op"].isin(ms.LAYER_OPS)]
             .groupby(["model", "tp", "num_tokens", "op"])["time_s"].mean()
             .groupby(["model", "tp", "num_tokens"]).sum().reset_index())
    models = sorted(layer["model"].unique())
    fig, axes = plt.subplots(len(models), 2, figsize=(9, 2.8 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, tp in enumerate((1, 8)):
            ax = axes[i][j]
            part = layer[(layer["model"] == model) & (layer["tp"] == tp)].sort_values("num_tokens")
            n = part["num_tokens"].to_numpy(float)
            cfg = configs[model][0]
            ax.plot(n, part["time_s"] * 1e3, "k.", ms=3, label="measured (Vidur)")
            ax.plot(n, [_layer_model_s(roof, cfg, x, tp) * 1e3 for x in n], label="roofline")
            ax.plot(n, [_layer_model_s(cal, cfg, x, tp) * 1e3 for x in n], label="calibrated")
            ax.set(xscale="log", yscale="log", title=f"{model}, tp {tp}", xlabel="tokens",
                   ylabel="one layer, no attention (ms)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{gpu.upper()}: measured vs modelled layer time")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    if path.suffix == ".png":
        fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    return path


def profile(model: str, num_tokens: Sequence[int], out: Path | str, device: str = "auto",
            tp: Sequence[int] = (1,), repeats: int = 20, warmup: int = 5,
            threads: Optional[int] = None) -> tuple[Path, str]:
    """Run :func:`harness.costmodel.profiler.profile_ops` for ``model`` (a ``conf/llama`` name or
    YAML path) at every ``tp``; write the CSV and return its path and a printable summary."""
    from harness.costmodel import profiler
    from harness.real.model import load_llama_config

    cfg = load_llama_config(model)
    rows = []
    for t in tp:
        rows += profiler.profile_ops(cfg, list(num_tokens), device=device, tp=int(t),
                                     repeats=repeats, warmup=warmup, num_threads=threads)
    first = rows[0]
    path = profiler.write_profile_csv(rows, profiler.profile_path(out, first["device_name"],
                                                                  cfg.name))
    text = "\n".join([
        f"# profiled {cfg.name} (h={cfg.hidden_size} heads={cfg.num_heads}/{cfg.num_kv_heads} "
        f"ffn={cfg.ffn_hidden_size} vocab={cfg.vocab_size}) on {first['device']}: "
        f"{first['device_name']}, {first['dtype']}, {first['threads']} CPU thread(s), {repeats} "
        f"repeats after {warmup} warmup",
        "# median ms per op; layer = sum of all ops but emb (attention core and all-reduce not "
        "included)",
        profiler.format_rows(rows),
        f"# wrote {path}",
    ])
    return path, text


TOKEN_RANGES = ((1, 64), (128, 1024), (2048, 1 << 30))


def compare(local_root: Path | str, gpu: str = "h100", root: Path | str = ms.PROFILE_DIR
            ) -> tuple[pd.DataFrame, str]:
    """Rows of ``ours / Vidur`` per (op class, token range) and per layer (all ops but the
    embedding), over every (shape, tp, num_tokens, op) both tables measured; duplicate
    measurements are averaged first. Shapes match on every dimension but ``vocab_size`` (Vidur's
    files pad it to 32768; it sizes only the embedding table, whose lookup reads ``num_tokens``
    rows). Raises ValueError when no row of ``local_root`` has a Vidur counterpart."""
    keys = [*(c for c in ms.DIM_COLUMNS if c != "vocab_size"), "tp", "num_tokens", "op", "op_class"]
    ours = ms.load_compute(root=local_root).groupby(keys + ["gpu", "model"], as_index=False)["time_s"].mean()
    theirs = ms.load_compute(gpu, root).groupby(keys + ["model"], as_index=False)["time_s"].mean()
    both = ours.merge(theirs, on=keys, suffixes=("_ours", "_vidur"))
    if both.empty:
        raise ValueError(f"no profile row under {local_root} has a {gpu} Vidur row of the same model "
                         f"dimensions (vocab_size aside), tp and num_tokens")
    both["ratio"] = both["time_s_ours"] / both["time_s_vidur"]
    rows, headers = [], []
    for device, mine in both.groupby("gpu"):  # one block per profiled device: never pooled
        for lo, hi in TOKEN_RANGES:
            part = mine[(mine["num_tokens"] >= lo) & (mine["num_tokens"] <= hi)]
            group = f"tokens {lo}-{hi}" if hi < (1 << 30) else f"tokens >= {lo}"
            for op_class, cls in part.groupby("op_class"):
                rows.append(_stats_row("op class", device, op_class, group, cls["ratio"]))
        layer = (mine[mine["op"].isin(ms.LAYER_OPS)]
                 .groupby(["model_vidur", "tp", "num_tokens"], as_index=False)[["time_s_ours", "time_s_vidur"]].sum())
        layer["ratio"] = layer["time_s_ours"] / layer["time_s_vidur"]
        for tp, part in layer.groupby("tp"):
            rows.append(_stats_row("layer", device, "layer", f"tp{tp}", part["ratio"]))
        rows.append(_stats_row("layer", device, "layer", "all", layer["ratio"]))
        models = ", ".join(f"{a} = {b}" for a, b in sorted(set(zip(mine["model_ours"], mine["model_vidur"]))))
        headers.append(f"# ours ({device}, {local_root}) vs Vidur {gpu}: {len(mine)} (shape, tp, num_tokens, op) "
                       f"rows; {models}")
    header = "\n".join(headers + ["# ratio: median of ours / Vidur; median, p90, max: of |ours / Vidur - 1|"])
    return pd.DataFrame(rows), header


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="analytic cost model vs the measured Vidur profiles")
    rep.add_argument("--gpu", choices=sorted(CLUSTERS), default="h100")
    rep.add_argument("--csv", help="also write the table's rows to this CSV file")
    rep.add_argument("--figure", help="also draw measured vs modelled layer curves to this PNG")
    rep.add_argument("--profiles", default=str(ms.PROFILE_DIR), help=argparse.SUPPRESS)
    prof = sub.add_parser("profile", help="time the Vidur op table on the local device")
    prof.add_argument("--model", default="tiny", help="conf/llama name or YAML path")
    prof.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    prof.add_argument("--tp", type=int, nargs="+", default=[1],
                      help="tensor-parallel degrees to emulate (per-rank shapes)")
    prof.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    prof.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads for a CPU run (default: torch's)")
    prof.add_argument("--repeats", type=int, default=20)
    prof.add_argument("--warmup", type=int, default=5)
    prof.add_argument("--out", default=None,
                      help="output root (default data/profiles/local)")
    cmp_ = sub.add_parser("compare", help="our own profile rows against Vidur's of the same shapes")
    cmp_.add_argument("--local", required=True, help="root that `profile --out` wrote to")
    cmp_.add_argument("--gpu", choices=sorted(CLUSTERS), default="h100")
    cmp_.add_argument("--profiles", default=str(ms.PROFILE_DIR), help=argparse.SUPPRESS)
    fit = sub.add_parser("fit", help="fit the calibrated model's data/profiles/fitted/<gpu>.json")
    fit.add_argument("--gpu", choices=sorted(CLUSTERS), nargs="+", default=sorted(CLUSTERS))
    fit.add_argument("--profiles", default=str(ms.PROFILE_DIR),
                     help="Vidur-layout profile root to fit on")
    fit.add_argument("--out", default=None, help="output folder (default data/profiles/fitted)")
    args = parser.parse_args(argv)
    if args.command == "fit":
        from harness.costmodel.calibrated import FITTED_DIR, fit_calibration

        out = Path(args.out or FITTED_DIR)
        out.mkdir(parents=True, exist_ok=True)
        for gpu in args.gpu:
            path = out / f"{gpu}.json"
            path.write_text(json.dumps(fit_calibration(gpu, args.profiles), indent=1) + "\n")
            print(f"wrote {path}")
        return 0
    if args.command == "profile":
        from harness.costmodel.profiler import LOCAL_PROFILE_DIR

        _, text = profile(args.model, args.num_tokens, args.out or LOCAL_PROFILE_DIR,
                          device=args.device, tp=args.tp, repeats=args.repeats,
                          warmup=args.warmup, threads=args.threads)
        print(text)
        return 0
    if args.command == "compare":
        if not Path(args.local).is_dir():
            print(f"error: --local {args.local}: no such folder", file=sys.stderr)
            return 2
        df, header = compare(args.local, args.gpu, args.profiles)
        print(header)
        print(format_table(df))
        return 0
    df, header = report(args.gpu, args.profiles)
    print(header)
    print(format_table(df))
    if args.csv:
        df.to_csv(args.csv, index=False)
        print(f"# wrote {args.csv}")
    if args.figure:
        print(f"# wrote {figure(args.gpu, args.figure, args.profiles)}")
    return 0

