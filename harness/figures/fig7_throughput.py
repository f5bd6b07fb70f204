"""Figure 7 (RLHFuse section 7.2): throughput of every system on the four actor/critic pairs and
three max generation lengths, and RLHFuse's speedup over each baseline with the paper's ranges
(over DeepSpeed-Chat 2.5-3.7x, over ReaLHF 1.4-2.4x, over RLHFuse-Base 1.2-1.4x) as bands."""
from __future__ import annotations

from pathlib import Path

from harness.figures import style

EXPERIMENT = "fig7_throughput"
PAPER_SPEEDUP = {"deepspeed_chat": (2.5, 3.7), "realhf": (1.4, 2.4), "rlhfuse_base": (1.2, 1.4)}


def throughput_table(root, run: str = EXPERIMENT):
    """Fig. 7's runs with ``System``, ``pair`` and ``max_gen_len`` columns. Models other than the
    paper's pairs (e.g. ``tiny`` in a quick run) are kept, after the pairs."""
    df = style.load_experiment(root, EXPERIMENT, run=run).copy()
    if "workload.max_gen_len" not in df.columns:
        raise style.FigureError(f"{EXPERIMENT}: runs under {Path(root) / EXPERIMENT} have no workload.max_gen_len "
                                f"in their overrides (the experiment sweeps it)")
    df["System"] = df["system"].map(lambda s: style.SYSTEM_LABELS.get(s, s))
    df["pair"] = df["model"].map(style.model_label)
    df["max_gen_len"] = df["workload.max_gen_len"].astype(int)
    style.one_variant(df, ["system", "model", "max_gen_len", "seed"], EXPERIMENT)
    return df


def speedups(df):
    """RLHFuse's throughput over each baseline's, per (pair, max length), seeds averaged."""
    import pandas as pd

    keyed = df.groupby(["model", "max_gen_len", "system"])["perf/samples_per_s"].mean()
    rows = []
    for (model, cap, system), value in keyed.items():
        if system == "rlhfuse" or (model, cap, "rlhfuse") not in keyed.index:
            continue
        rows.append({"model": model, "pair": style.model_label(model), "max_gen_len": cap, "baseline": system,
                     "Baseline": style.SYSTEM_LABELS.get(system, system),
                     "speedup": keyed[(model, cap, "rlhfuse")] / value})
    return pd.DataFrame(rows)


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = throughput_table(root)
    style.setup()
    caps = sorted(df["max_gen_len"].unique())
    pairs = [style.model_label(m) for m in style.model_order(df["model"])]
    fig, axes = plt.subplots(2, len(caps), figsize=(5.2 * len(caps) + 1.5, 7.5), squeeze=False)
    order = style.ordered_systems(df["system"])
    colors = {label: style.system_color(label, i) for i, label in enumerate(order)}
    pair_colors = dict(zip(pairs, style.pair_palette(len(pairs))))
    for i, cap in enumerate(caps):
        ax = axes[0][i]
        sns.barplot(df[df["max_gen_len"] == cap], x="pair", y="perf/samples_per_s", hue="System", hue_order=order,
                    order=pairs, palette=colors, ax=ax)
        ax.set(title=f"max generation length {cap} tokens", xlabel="actor/critic model pair",
               ylabel="throughput (samples/s)")
        if i == len(caps) - 1:
            sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1.0), title="system")
        else:
            ax.get_legend().remove()
        sp = speedups(df[df["max_gen_len"] == cap])
        ax2 = axes[1][i]
        if sp.empty:
            ax2.axis("off")
            continue
        base_order = [b for b in order if b != "RLHFuse"]
        sns.barplot(sp, x="Baseline", y="speedup", hue="pair", order=base_order,
                    hue_order=[p for p in pairs if p in set(sp["pair"])], ax=ax2, palette=pair_colors)
        for j, label in enumerate(base_order):
            key = next((k for k, v in style.SYSTEM_LABELS.items() if v == label), None)
            if key in PAPER_SPEEDUP:
                style.paper_band(ax2, *PAPER_SPEEDUP[key], x=(j - 0.45, j + 0.45),
                                 label="paper (Fig. 7 text)")
        style.reference_line(ax2, 1.0)
        ax2.set(xlabel="baseline", ylabel="RLHFuse speedup (x, samples/s ratio)",
                title="RLHFuse over each baseline (band: paper's range)")
        ax2.tick_params(axis="x", labelrotation=30)
        for label in ax2.get_xticklabels():
            label.set_horizontalalignment("right")
        if i == len(caps) - 1:
            ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="actor/critic")
        else:
            ax2.get_legend().remove()
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
