"""Throughput against staleness on the long reasoning workload: every system of
``conf/experiment/async_tradeoff.yaml`` (synchronous ones at staleness 0, off-policy ones at the
mean staleness of their trained samples, a line to the largest), samples/s after the warm-up
iteration. The speed asynchrony buys, beside its price (docs/ASYNC.md)."""
from __future__ import annotations

from harness.figures import style

EXPERIMENT = "async_tradeoff"
# the systems in the order they are drawn and listed, with their labels
ASYNC_SYSTEMS = {"verl": "verl", "nemo_rl": "NeMo-RL", "rlhfuse_base": "RLHFuse-Base", "rlhfuse": "RLHFuse",
                 "one_step_off": "one-step-off", "nemo_rl_async": "NeMo-RL async", "areal": "AReaL",
                 "partial_rollout": "partial rollout (APRIL)", "rollpacker": "RollPacker", "streamrl": "StreamRL"}
METRICS = ("perf/samples_per_s", "staleness/mean", "staleness/max", "timing_s/step")


def tradeoff_table(root):
    """One row per system: its label, samples/s, staleness mean and max, step time (seeds averaged)."""
    df = style.load_experiment(root, EXPERIMENT)
    style.one_variant(df, ["system", "model", "seed"], EXPERIMENT)
    missing = [m for m in METRICS if m not in df.columns]
    if missing:
        raise style.FigureError(f"{EXPERIMENT}: runs under {root} have no {missing} (re-run them)")
    table = df.groupby("system")[list(METRICS)].mean().reset_index()
    order = {s: i for i, s in enumerate(ASYNC_SYSTEMS)}
    table["System"] = table["system"].map(lambda s: ASYNC_SYSTEMS.get(s, s))
    table["order"] = table["system"].map(lambda s: order.get(s, len(order)))
    return table.sort_values(["order", "system"]).reset_index(drop=True)


def draw(root) -> list:
    import matplotlib.pyplot as plt
    import seaborn as sns

    table = tradeoff_table(root)
    style.setup()
    colors = dict(zip(table["System"], sns.color_palette("colorblind", len(table))))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.3, 1]})
    for _, row in table.iterrows():
        c = colors[row["System"]]
        ax.plot([row["staleness/mean"], row["staleness/max"]], [row["perf/samples_per_s"]] * 2, color=c, lw=1.5,
                alpha=0.6)
        ax.scatter(row["staleness/mean"], row["perf/samples_per_s"], color=c, s=60, zorder=3, label=row["System"],
                   marker="o" if row["staleness/max"] == 0 else "D")
    ax.set(xlabel="staleness of the trained samples (weight versions; dot: mean, line to the largest)",
           ylabel="throughput (samples/s)", title="speed against staleness")
    ax.set_xlim(left=-0.25)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=7)
    sns.barplot(table, y="System", x="perf/samples_per_s", hue="System", palette=colors, ax=ax2, legend=False)
    for i, row in table.iterrows():
        ax2.text(row["perf/samples_per_s"], i, f"  {row['timing_s/step']:.0f} s/step", va="center", fontsize=7)
    ax2.set(xlabel="throughput (samples/s)", ylabel="", title="throughput (after the warm-up iterations)")
    ax2.set_xlim(right=1.3 * table["perf/samples_per_s"].max())
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
