"""GPU utilisation through one steady-state step, per system: the fraction of the cluster's GPUs
running compute (prefill, decode, forward, backward, optimizer spans) over the last iteration of
each run of ``conf/experiment/async_tradeoff.yaml`` (its ``trace.json``). Where the long tail
idles the generation GPUs shows as a falling curve before training starts; an off-policy
system's step is the interval between its training steps, with generation of later batches
running through it (docs/ASYNC.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from harness.core.trace import COMPUTE_SPAN_KINDS
from harness.figures import style
from harness.figures.async_tradeoff import ASYNC_SYSTEMS

EXPERIMENT = "async_utilisation"  # its config runs async_tradeoff's sweep, under that name
SOURCE = "async_tradeoff"
NUM_BINS = 240


def utilisation(trace_path: Path, num_devices: int, num_bins: int = NUM_BINS) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres in seconds, fraction of the ``num_devices`` GPUs busy with compute in each bin)
    over the trace's time span: per device the union of its compute spans, the time of it in each bin."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in COMPUTE_SPAN_KINDS]
    if not events:
        raise style.FigureError(f"{trace_path}: no compute spans")
    end = max(e["ts"] + e["dur"] for e in events) / 1e6
    edges = np.linspace(0.0, end, num_bins + 1)
    busy = np.zeros(num_bins)
    by_device: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        by_device.setdefault(e["pid"], []).append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    width = edges[1] - edges[0]
    for spans in by_device.values():
        merged: list[list[float]] = []  # the device's busy time: the union of its spans
        for start, stop in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        covered = np.zeros(num_bins)
        for start, stop in merged:
            lo, hi = np.searchsorted(edges, [start, stop], side="right") - 1
            for b in range(max(lo, 0), min(hi, num_bins - 1) + 1):
                covered[b] += max(0.0, min(stop, edges[b + 1]) - max(start, edges[b]))
        busy += covered / width
    return (edges[:-1] + edges[1:]) / 2, busy / num_devices


def draw(root) -> list:
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = style.load_experiment(root, SOURCE, run=EXPERIMENT)
    style.one_variant(df, ["system", "model", "seed"], EXPERIMENT)
    runs = df.sort_values("seed").groupby("system").first()
    order = [s for s in ASYNC_SYSTEMS if s in runs.index] + sorted(set(runs.index) - set(ASYNC_SYSTEMS))
    style.setup()
    colors = dict(zip(order, sns.color_palette("colorblind", len(order))))
    fig, axes = plt.subplots(len(order), 1, figsize=(9, 1.35 * len(order) + 0.8), sharex=True, squeeze=False)
    for ax, system in zip(axes[:, 0], order):
        run = runs.loc[system]
        with open(Path(run["path"]) / "summary.json") as f:
            num_devices = int(json.load(f)["provenance"]["devices"]["count"])
        t, frac = utilisation(Path(run["path"]) / "trace.json", num_devices)
        ax.fill_between(t, frac, color=colors[system], alpha=0.5, lw=0)
        ax.plot(t, frac, color=colors[system], lw=1)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("busy", fontsize=8)
        ax.text(0.005, 0.9, f"{ASYNC_SYSTEMS.get(system, system)}: mean step {run['timing_s/step']:.0f} s, "
                            f"mean busy {run['util/gpu_busy_frac/mean']:.2f}",
                transform=ax.transAxes, fontsize=8, va="top")
    axes[-1, 0].set_xlabel("time in the last iteration's step (s)")
    fig.suptitle("fraction of GPUs running compute through one steady-state step", fontsize=11)
    fig.tight_layout()
    return style.save(fig, root, "async_utilisation")
