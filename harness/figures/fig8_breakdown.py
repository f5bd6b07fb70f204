"""Figure 8 (RLHFuse section 7.3): iteration time split into generation+inference, training and
others for RLHFuse-Base vs RLHFuse, and the fusion speedups per part with the paper's ranges
(gen+inf 1.2-1.6x, training 1.2-1.3x; others < 3% of the iteration).

Its runs are Figure 7's RLHFuse-Base and RLHFuse runs: ``conf/experiment/fig8_breakdown.yaml``
runs only those two systems, under Figure 7's experiment name (``results/fig7_throughput/``), so
either experiment makes them and neither re-runs what the other finished."""
from __future__ import annotations

from pathlib import Path

from harness.figures import style
from harness.figures.fig7_throughput import throughput_table

EXPERIMENT = "fig8_breakdown"
SOURCE = "fig7_throughput"  # where its runs are (fig8's config shares fig7's experiment name)
PAPER = {"gen+inf": (1.2, 1.6), "train": (1.2, 1.3)}
PAPER_OTHERS_MAX_FRAC = 0.03
SYSTEMS = ("rlhfuse_base", "rlhfuse")


def breakdown(root):
    df = throughput_table(root, run=EXPERIMENT)
    df = df[df["system"].isin(SYSTEMS)].copy()
    if df.empty:
        raise style.MissingResults(f"no rlhfuse_base/rlhfuse runs under {Path(root) / SOURCE}", EXPERIMENT, root)
    df["gen+inf"] = df["timing_s/gen_inference"]
    df["train"] = df["timing_s/train"]
    df["others"] = (df["timing_s/step"] - df["gen+inf"] - df["train"]).clip(lower=0.0)
    return df


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = breakdown(root)
    style.setup()
    caps = sorted(df["max_gen_len"].unique())
    models = style.model_order(df["model"])
    pairs = [style.model_label(m) for m in models]
    fig, axes = plt.subplots(2, len(caps), figsize=(5.2 * len(caps) + 1.5, 7.5), squeeze=False)
    parts = style.part_colors()
    for i, cap in enumerate(caps):
        sub = df[df["max_gen_len"] == cap].groupby(["model", "system"])[list(parts) + ["timing_s/step"]].mean()
        ax = axes[0][i]
        x = 0.0
        ticks, labels = [], []
        for model in models:
            start = x
            for system in SYSTEMS:
                if (model, system) not in sub.index:
                    continue
                bottom = 0.0
                for part, color in parts.items():
                    value = sub.loc[(model, system), part]
                    ax.bar(x, value, bottom=bottom, color=color, label=part if x == 0 else None,
                           hatch="//" if system == "rlhfuse" else None, edgecolor="white")
                    bottom += value
                ticks.append(x)
                labels.append("Fused" if system == "rlhfuse" else "Base")
                x += 1
            if x > start:
                ax.text((start + x - 1) / 2, -0.13, style.model_label(model), transform=ax.get_xaxis_transform(),
                        ha="center", fontsize=8)
            x += 0.5
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.set(ylabel="iteration time (s)", title=f"max generation length {cap} tokens")
        ax.set_xlabel("Base: RLHFuse-Base, Fused: RLHFuse, per actor/critic pair", labelpad=16)
        ax.grid(axis="x", visible=False)
        ax.set_ylim(top=1.3 * ax.get_ylim()[1])  # room for the legend and the note
        ax.legend(title="part (hatched: RLHFuse)", loc="upper left")
        others = sub["others"] / sub["timing_s/step"]
        style.paper_note(ax, f"others: {100 * others.min():.1f}-{100 * others.max():.1f}% of the iteration\n"
                             f"(paper: < {100 * PAPER_OTHERS_MAX_FRAC:.0f}%)", loc="upper right")
        rows = []
        for model in models:
            if (model, "rlhfuse") in sub.index and (model, "rlhfuse_base") in sub.index:
                for part in PAPER:
                    rows.append({"pair": style.model_label(model), "part": part,
                                 "speedup": sub.loc[(model, "rlhfuse_base"), part] / sub.loc[(model, "rlhfuse"), part]})
        ax2 = axes[1][i]
        sp = pd.DataFrame(rows)
        if sp.empty:
            ax2.axis("off")
            continue
        sns.barplot(sp, x="part", y="speedup", hue="pair", ax=ax2, order=list(PAPER),
                    hue_order=[p for p in pairs if p in set(sp["pair"])],
                    palette=dict(zip(pairs, style.pair_palette(len(pairs)))))
        for j, part in enumerate(PAPER):
            style.paper_band(ax2, *PAPER[part], x=(j - 0.45, j + 0.45), label="paper (Fig. 8 text)")
        style.reference_line(ax2, 1.0)
        ax2.set(xlabel="part of the iteration", ylabel="fusion speedup (x, time ratio)",
                title="RLHFuse over RLHFuse-Base (band: paper's range)")
        if i == len(caps) - 1:
            ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="actor/critic")
        else:
            ax2.get_legend().remove()
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
