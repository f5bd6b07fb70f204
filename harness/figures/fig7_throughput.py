"""Figure 7 (RLHFuse section 7.2): throughput of every system on the four actor/critic pairs and
three max generation lengths, and RLHFuse's speedup over each baseline with the paper's ranges
(over DeepSpeed-Chat 2.5-3.7x, over ReaLHF 1.4-2.4x, over RLHFuse-Base 1.2-1.4x) as bands."""
from __future__ import annotations

from pathlib import Path

from harness.figures import style

EXPERIMENT = "fig7_throughput"
PAPER_SPEEDUP = {"deepspeed_chat": (2.5, 3.7), "realhf": (1.4, 2.4), "rlhfuse_base": (1.2, 1.4)}


def throughput_table(root):
    df = style.load_experiment(root, EXPERIMENT)
    df = df[df["model"].isin(style.PAIR_ORDER)].copy()
    df["System"] = df["system"].map(style.SYSTEM_LABELS)
    df["pair"] = df["model"].map(style.PAIR_LABELS)
    df["max_gen_len"] = df["workload.max_gen_len"].astype(int)
    return df


def speedups(df):
    import pandas as pd

    keyed = df.set_index(["model", "max_gen_len", "system"])["perf/samples_per_s"]
    rows = []
    for (model, cap, system), value in keyed.items():
        if system == "rlhfuse" or (model, cap, "rlhfuse") not in keyed.index:
            continue
        rows.append({"model": model, "pair": style.PAIR_LABELS[model], "max_gen_len": cap, "baseline": system,
                     "Baseline": style.SYSTEM_LABELS[system], "speedup": keyed[(model, cap, "rlhfuse")] / value})
    return pd.DataFrame(rows)


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = throughput_table(root)
    style.setup()
    caps = sorted(df["max_gen_len"].unique())
    fig, axes = plt.subplots(2, len(caps), figsize=(5.2 * len(caps), 7.5), squeeze=False)
    order = style.ordered_systems(df["system"])
    for i, cap in enumerate(caps):
        ax = axes[0][i]
        sns.barplot(df[df["max_gen_len"] == cap], x="pair", y="perf/samples_per_s", hue="System", hue_order=order,
                    order=[style.PAIR_LABELS[p] for p in style.PAIR_ORDER], palette=style.palette(), ax=ax)
        ax.set(title=f"max generation length {cap}", xlabel="actor/critic", ylabel="throughput (samples/s)")
        if i == len(caps) - 1:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="system")
        else:
            ax.get_legend().remove()
        sp = speedups(df[df["max_gen_len"] == cap])
        ax2 = axes[1][i]
        if sp.empty:
            continue
        base_order = [b for b in order if b != "RLHFuse"]
        sns.barplot(sp, x="Baseline", y="speedup", hue="pair", order=base_order, ax=ax2, palette="mako")
        for j, label in enumerate(base_order):
            key = next((k for k, v in style.SYSTEM_LABELS.items() if v == label), None)
            if key in PAPER_SPEEDUP:
                lo, hi = PAPER_SPEEDUP[key]
                ax2.fill_between([j - 0.45, j + 0.45], lo, hi, color=style.PAPER_COLOR, alpha=0.3, zorder=0,
                                 label="paper" if j == 0 else None)
        ax2.axhline(1.0, color="black", lw=0.8)
        ax2.set(xlabel="", ylabel="RLHFuse speedup (x)", title="RLHFuse over each baseline (band: paper)")
        ax2.tick_params(axis="x", labelrotation=30)
        for label in ax2.get_xticklabels():
            label.set_horizontalalignment("right")
        ax2.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
