"""Routed-expert GEMMs of a mixture-of-experts layer, timed three ways on one device, side by side.

The calibrated cost model (:meth:`harness.costmodel.calibrated.CalibratedCostModel._moe_mlp_s`) times
the routed experts of one GPU as one GEMM of the layer's ``tokens x k`` token copies through the
``gemm`` law, reading the local experts' weights once. A framework runs them as many small GEMMs,
one per local expert, each over the copies routed to it. This script measures how much that costs on
the device at hand, for the expert shapes of the MoE models the harness ships (``conf/llama``):

* ``dense``: one GEMM pair over all copies, ``(E_l T_e, h) x (h, 2f)`` then ``(E_l T_e, f) x (f, h)``:
  the cost model's assumption, the same FLOPs;
* ``grouped``: ``torch._grouped_mm`` over ``E_l`` experts of ``T_e`` copies each (the grouped GEMM
  that Megatron-core's ``TEGroupedMLP`` and torchtitan's MoE run);
* ``loop``: one ``torch.mm`` per expert (Megatron-core's ``SequentialMLP``).

Each in the forward and in forward+backward (autograd, weights and input requiring gradients, a
contiguous random output gradient), bf16, CUDA events around ``repeats`` calls after ``warmup``.
Routing is balanced (``T_e`` copies per local expert). ``silu(gate) * up`` runs between the GEMMs
in every variant. ``E_l`` is the number of local experts (``num_experts / ep``); ``T_e =
tokens k ep / num_experts`` for ``tokens`` per GPU.

    python benchmarks/moe_profile.py --out moe.csv                  # on a GPU
    python benchmarks/moe_profile.py --device cpu --models tiny_moe --tokens-per-expert 16 32
    python benchmarks/moe_profile.py --summarize data/profiles/local/nvidia-h200/moe_experts.csv
    python benchmarks/moe_profile.py --block --out moe_block.csv            # on a GPU
    python benchmarks/moe_profile.py --summarize-block data/profiles/local/nvidia-h200/moe_block.csv \
        --experts data/profiles/local/nvidia-h200/moe_experts.csv

``--block`` times instead one whole MoE MLP block of one expert-parallel rank, forward+backward:
the router GEMM over all ``num_experts`` (fp32, and fp64 as NeMo-RL's recipes set
``moe_router_dtype``), softmax and top-k, the permutation of the ``tokens x k`` copies by expert
(argsort and gather), the grouped GEMMs of the ``num_experts / ep`` local experts, and the weighted
un-permutation (scatter-add). The expert-parallel all-to-alls are not run (one device): the copies
are mapped onto the local experts as a balanced all-to-all would deliver them. Rows: model, tokens,
ep, router dtype, median_ms, device_name, with the op-by-op forward split.

Rows: model, h, f, local_experts, tokens_per_expert, impl, pass (fwd / fwd_bwd), median_ms,
min_ms, tflops (of the median), device_name. Not a test: a benchmark (docs/GPU.md shows a run).
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["model", "h", "f", "local_experts", "tokens_per_expert", "impl", "pass", "median_ms", "min_ms",
          "tflops", "device_name"]


def moe_config(model: str) -> dict:
    """``conf/llama/<model>.yaml`` of a mixture-of-experts model; ``tiny_moe`` is a CPU smoke shape."""
    if model == "tiny_moe":
        return {"hidden_size": 64, "moe_ffn_hidden_size": 32, "num_experts": 8, "num_experts_per_token": 2}
    cfg = yaml.safe_load((ROOT / "conf" / "llama" / f"{model}.yaml").read_text())
    if not cfg.get("num_experts"):
        raise SystemExit(f"{model}: not a mixture-of-experts model (no num_experts in conf/llama/{model}.yaml)")
    return cfg


def expert_shape(model: str) -> tuple[int, int]:
    """(hidden, moe_ffn_hidden) of ``conf/llama/<model>.yaml``."""
    cfg = moe_config(model)
    return int(cfg["hidden_size"]), int(cfg["moe_ffn_hidden_size"])


def timer(device: str, warmup: int, repeats: int):
    def run(fn) -> list[float]:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                out.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
        return sorted(out)
    return run


def variants(x, w_up, w_down, num_experts: int, tokens: int):
    """Forward functions of the three implementations over the same tensors."""
    f = w_down.shape[1]
    offs = torch.arange(1, num_experts + 1, device=x.device, dtype=torch.int32) * tokens

    def act(y):
        return torch.nn.functional.silu(y[:, :f]) * y[:, f:]

    up0, down0 = (w[0].detach().clone().requires_grad_() for w in (w_up, w_down))

    def dense():
        # one GEMM pair over every copy, expert 0's weights standing in for all: the same FLOPs
        return act(x @ up0) @ down0

    def grouped():
        return torch._grouped_mm(act(torch._grouped_mm(x, w_up, offs=offs)), w_down, offs=offs)

    def loop():
        return torch.cat([act(x[e * tokens:(e + 1) * tokens] @ w_up[e]) @ w_down[e] for e in range(num_experts)])

    return {"dense": dense, "grouped": grouped, "loop": loop}


def profile_shape(model, h, f, num_experts, tokens, device, dtype, run, name) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(device=device, dtype=dtype)

    x = rand(num_experts * tokens, h).requires_grad_()
    w_up = rand(num_experts, h, 2 * f).requires_grad_()
    w_down = rand(num_experts, f, h).requires_grad_()
    grad = rand(num_experts * tokens, h)
    fwd_flops = 2.0 * num_experts * tokens * h * 3 * f
    rows = []
    for impl, fn in variants(x, w_up, w_down, num_experts, tokens).items():
        def fwd_bwd(fn=fn):
            fn().backward(grad)  # gradients accumulate: the same work on every call
        for pass_, call, flops in (("fwd", lambda fn=fn: fn(), fwd_flops), ("fwd_bwd", fwd_bwd, 3 * fwd_flops)):
            try:
                with torch.no_grad() if pass_ == "fwd" else torch.enable_grad():
                    times = run(call)
            except (RuntimeError, NotImplementedError) as exc:  # e.g. no grouped GEMM kernel for this device
                print(f"{model} E_l={num_experts} T_e={tokens} {impl} {pass_}: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0]}", file=sys.stderr)
                continue
            med = times[len(times) // 2]
            rows.append({"model": model, "h": h, "f": f, "local_experts": num_experts, "tokens_per_expert": tokens,
                         "impl": impl, "pass": pass_, "median_ms": round(med, 4), "min_ms": round(times[0], 4),
                         "tflops": round(flops / (med * 1e-3) / 1e12, 1), "device_name": name})
    del x, w_up, w_down, grad
    return rows


BLOCK_FIELDS = ["model", "h", "f", "num_experts", "k", "ep", "tokens", "router_dtype", "pass", "median_ms",
                "device_name"]


def profile_block(model: str, tokens: int, ep: int, router_dtype, device: str, dtype, run, name) -> list[dict]:
    """One MoE MLP block of one expert-parallel rank, forward and forward+backward (module docstring)."""
    cfg = moe_config(model)
    h, f = int(cfg["hidden_size"]), int(cfg["moe_ffn_hidden_size"])
    num_experts, k = int(cfg["num_experts"]), int(cfg["num_experts_per_token"])
    local = num_experts // ep
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dt=dtype):
        return (torch.randn(*shape, generator=gen) * 0.02).to(device=device, dtype=dt)

    x = rand(tokens, h).requires_grad_()
    w_router = rand(h, num_experts, dt=router_dtype).requires_grad_()
    w_up = rand(local, h, 2 * f).requires_grad_()
    w_down = rand(local, f, h).requires_grad_()
    grad = rand(tokens, h)
    offs = torch.arange(1, local + 1, device=device, dtype=torch.int32) * (tokens * k // local)

    def block():
        probs = torch.softmax(x.to(router_dtype) @ w_router, dim=-1)
        top_p, top_e = torch.topk(probs, k, dim=-1)
        # balanced delivery onto the local experts: copy i goes to local expert i mod local, the order an
        # all-to-all of uniformly routed tokens would leave after the permutation's sort
        flat = torch.arange(tokens * k, device=device) % local
        order = torch.argsort(flat + 0 * top_e.reshape(-1), stable=True)
        src = order // k
        copies = x.index_select(0, src)
        y = torch._grouped_mm(copies, w_up, offs=offs)
        y = torch._grouped_mm(torch.nn.functional.silu(y[:, :f]) * y[:, f:], w_down, offs=offs)
        weights = top_p.reshape(-1)[order].to(y.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add(0, src, y * weights)

    def fwd_bwd():
        block().backward(grad)

    rows = []
    for pass_, call in (("fwd", block), ("fwd_bwd", fwd_bwd)):
        with torch.no_grad() if pass_ == "fwd" else torch.enable_grad():
            times = run(call)
        rows.append({"model": model, "h": h, "f": f, "num_experts": num_experts, "k": k, "ep": ep, "tokens": tokens,
                     "router_dtype": str(router_dtype).replace("torch.", ""), "pass": pass_,
                     "median_ms": round(times[len(times) // 2], 4), "device_name": name})
    return rows


TOKEN_BINS = ((64, 128), (256, 512), (1024, 8192))


def summarize(path: Path) -> str:
    """Per model and pass, the median over local-expert counts and shapes of ``grouped / dense`` and
    ``loop / dense`` within each bin of tokens per expert (the table docs/GPU.md shows)."""
    import statistics
    from collections import defaultdict

    times: dict[tuple, dict[str, float]] = defaultdict(dict)
    device = set()
    with path.open() as fh:
        for r in csv.DictReader(fh):
            key = (r["model"], r["pass"], int(r["local_experts"]), int(r["tokens_per_expert"]))
            times[key][r["impl"]] = float(r["median_ms"])
            device.add(r["device_name"])
    ratios: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (model, pass_, _, tokens), by in times.items():
        for lo, hi in TOKEN_BINS:
            if lo <= tokens <= hi and "dense" in by:
                for impl in ("grouped", "loop"):
                    if impl in by:
                        ratios[(model, pass_, f"{lo}-{hi}")][impl].append(by[impl] / by["dense"])
    lines = [f"# {path} ({', '.join(sorted(device))}): median time over the dense-equivalent GEMM pair",
             f"{'model':<16} {'pass':<8} {'tokens/expert':<13} {'shapes':>6} {'grouped':>8} {'loop':>7}"]
    for (model, pass_, span), by in sorted(ratios.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                            int(kv[0][2].split("-")[0]))):
        lines.append(f"{model:<16} {pass_:<8} {span:<13} {len(by['grouped']):>6} "
                     f"{statistics.median(by['grouped']):>8.2f} {statistics.median(by['loop']):>7.2f}")
    return "\n".join(lines)


def summarize_block(path: Path, experts: Optional[Path], gpu: str = "h100") -> str:
    """Each block's forward+backward (fp32 router) beside the grouped GEMMs alone of the same
    local experts and tokens per expert (from ``experts``, where measured) and the calibrated cost
    model's MoE MLP of ``gpu`` without shared experts (the block has none), three forwards as the
    model's training pass (forward + a backward of twice the linear ops)."""
    import dataclasses

    from harness.cli.calibrate import cost_model_for
    from harness.costmodel.llama import ModelDims
    from harness.real.model import load_llama_config

    compute = cost_model_for(gpu).compute
    grouped: dict[tuple, float] = {}
    if experts is not None:
        with experts.open() as fh:
            for r in csv.DictReader(fh):
                if r["impl"] == "grouped" and r["pass"] == "fwd_bwd":
                    grouped[(r["model"], int(r["local_experts"]), int(r["tokens_per_expert"]))] = float(r["median_ms"])
    lines = [f"# {path}: MoE block forward+backward (fp32 router) against its grouped GEMMs alone and the "
             f"{gpu} cost model's MoE MLP (3 x forward, no shared experts)",
             f"{'model':<16} {'ep':>3} {'tokens':>6} {'block ms':>9} {'GEMMs ms':>9} {'GEMM share':>10} "
             f"{'model ms':>9} {'block/model':>11} {'GEMMs/model':>11}"]
    with path.open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["pass"] == "fwd_bwd" and r["router_dtype"] == "float32"]
    for r in rows:
        dims = ModelDims.of(load_llama_config(r["model"]))
        ep, tokens = int(r["ep"]), int(r["tokens"])
        local = dims.num_experts // ep
        model_ms = 3e3 * compute._moe_mlp_s(dataclasses.replace(dims, num_shared_experts=0), 1, float(tokens),
                                            float(local))
        block = float(r["median_ms"])
        gemms = grouped.get((r["model"], local, tokens * dims.num_experts_per_token // local))
        g = (f"{gemms:>9.3f} {gemms / block:>10.2f}", f"{gemms / model_ms:>11.2f}") if gemms else (f"{'':>9} {'':>10}", "")
        lines.append(f"{r['model']:<16} {ep:>3} {tokens:>6} {block:>9.3f} {g[0]} {model_ms:>9.3f} "
                     f"{block / model_ms:>11.2f} {g[1]}".rstrip())
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3"])
    parser.add_argument("--local-experts", nargs="+", type=int, default=[4, 8, 16, 32])
    parser.add_argument("--tokens-per-expert", nargs="+", type=int,
                        default=[64, 128, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--max-copies", type=int, default=1 << 18, help="skip shapes with more token copies")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new shapes after this")
    parser.add_argument("--out", type=Path, default=Path("moe_profile.csv"))
    parser.add_argument("--summarize", type=Path, metavar="CSV", help="print the summary of a written CSV and exit")
    parser.add_argument("--summarize-block", type=Path, metavar="CSV",
                        help="print a --block CSV beside the cost model (and --experts' grouped GEMMs) and exit")
    parser.add_argument("--experts", type=Path, metavar="CSV", help="--summarize-block: the routed-expert GEMM rows")
    parser.add_argument("--block", action="store_true", help="time whole MoE blocks (module docstring)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 4096, 8192], help="--block: tokens per rank")
    parser.add_argument("--ep", nargs="+", type=int, default=[8, 16, 32], help="--block: expert parallelism")
    args = parser.parse_args()
    if args.summarize_block:
        print(summarize_block(args.summarize_block, args.experts))
        return
    if args.block:
        sweep(args, BLOCK_FIELDS, block_shapes(args))
        return
    if args.summarize:
        print(summarize(args.summarize))
        return
    sweep(args, FIELDS, expert_shapes(args))


def expert_shapes(args):
    """(label, measure, summary) of every routed-expert shape asked for."""
    for model in args.models:
        h, f = expert_shape(model)
        for num_experts in args.local_experts:
            for tokens in args.tokens_per_expert:
                if num_experts * tokens > args.max_copies:
                    continue

                def summary(rows, label=f"{model:16s} E_l={num_experts:3d} T_e={tokens:5d}"):
                    by = {(r["impl"], r["pass"]): r["median_ms"] for r in rows}
                    dense = by.get(("dense", "fwd_bwd"))
                    return f"{label} fwd_bwd ms: " + "  ".join(
                        f"{impl} {by[(impl, 'fwd_bwd')]:.3f}" + (f" ({by[(impl, 'fwd_bwd')] / dense:.2f}x)" if dense else "")
                        for impl in ("dense", "grouped", "loop") if (impl, "fwd_bwd") in by)

                yield (f"{model} E_l={num_experts} T_e={tokens}",
                       lambda dtype, run, name, a=(model, h, f, num_experts, tokens): profile_shape(
                           *a, args.device, dtype, run, name), summary)


def block_shapes(args):
    """(label, measure, summary) of every MoE block asked for."""
    for model in args.models:
        num_experts = int(moe_config(model)["num_experts"])
        for ep in (e for e in args.ep if num_experts % e == 0):
            for tokens in args.tokens:
                for router_dtype in (torch.float32, torch.float64):
                    label = f"{model:16s} ep={ep:3d} tokens={tokens:5d} router {str(router_dtype)[6:]:8s}"
                    yield (label, lambda dtype, run, name, a=(model, tokens, ep, router_dtype): profile_block(
                        *a, args.device, dtype, run, name),
                        lambda rows, label=label: f"{label} ms: " + "  ".join(
                            f"{r['pass']} {r['median_ms']:.3f}" for r in rows))


def sweep(args, fields, shapes) -> None:
    """Measure each shape in turn, appending its rows to ``args.out`` as they come, until the shapes
    or ``args.budget_s`` run out."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    run = timer(args.device, args.warmup, args.repeats)
    t0 = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for label, measure, summary in shapes:
            if time.monotonic() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopping before {label}", file=sys.stderr)
                break
            rows = measure(dtype, run, name)
            writer.writerows(rows)
            fh.flush()
            print(summary(rows), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
