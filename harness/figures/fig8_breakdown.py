"""Figure 8 (RLHFuse section 7.3): iteration time split into generation+inference, training and
others for RLHFuse-Base vs RLHFuse, and the fusion speedups per part with the paper's ranges
(gen+inf 1.2-1.6x, training 1.2-1.3x; others < 3% of the iteration)."""
from __future__ import annotations

from pathlib import Path

from harness.figures import style
from harness.figures.fig7_throughput import throughput_table

EXPERIMENT = "fig8_breakdown"
SOURCE = "fig7_throughput"  # same runs (fig8's config shares fig7's experiment name)
PAPER = {"gen+inf": (1.2, 1.6), "train": (1.2, 1.3)}


def breakdown(root):
    df = throughput_table(root)
    df = df[df["system"].isin(["rlhfuse_base", "rlhfuse"])].copy()
    df["gen+inf"] = df["timing_s/gen_inference"]
    df["train"] = df["timing_s/train"]
    df["others"] = (df["timing_s/step"] - df["gen+inf"] - df["train"]).clip(lower=0.0)
    return df


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt
    import pandas as pd

    df = breakdown(root)
    if df.empty:
        raise FileNotFoundError(f"no rlhfuse_base/rlhfuse runs under {root}/{SOURCE}")
    style.setup()
    caps = sorted(df["max_gen_len"].unique())
    fig, axes = plt.subplots(2, len(caps), figsize=(5.2 * len(caps), 7.5), squeeze=False)
    parts = {"gen+inf": "#4c72b0", "train": "#dd8452", "others": "#8c8c8c"}
    for i, cap in enumerate(caps):
        sub = df[df["max_gen_len"] == cap].set_index(["model", "system"])
        ax = axes[0][i]
        x = 0
        ticks, labels = [], []
        for model in style.PAIR_ORDER:
            for system in ("rlhfuse_base", "rlhfuse"):
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
            ax.text(x - 1.5, -0.13, style.PAIR_LABELS[model], transform=ax.get_xaxis_transform(), ha="center",
                    fontsize=8)
            x += 0.5
        ax.set_xticks(ticks, labels, fontsize=7)
        ax.set(ylabel="iteration time (s)", title=f"max generation length {cap}")
        ax.legend(fontsize=7)
        rows = []
        for model in style.PAIR_ORDER:
            if (model, "rlhfuse") in sub.index and (model, "rlhfuse_base") in sub.index:
                for part in ("gen+inf", "train"):
                    rows.append({"pair": style.PAIR_LABELS[model], "part": part,
                                 "speedup": sub.loc[(model, "rlhfuse_base"), part] / sub.loc[(model, "rlhfuse"), part]})
        ax2 = axes[1][i]
        sp = pd.DataFrame(rows)
        if sp.empty:
            continue
        import seaborn as sns

        sns.barplot(sp, x="part", y="speedup", hue="pair", ax=ax2, palette="mako", order=list(PAPER))
        for j, part in enumerate(PAPER):
            lo, hi = PAPER[part]
            ax2.fill_between([j - 0.45, j + 0.45], lo, hi, color=style.PAPER_COLOR, alpha=0.3, zorder=0,
                             label="paper" if j == 0 else None)
        ax2.axhline(1.0, color="black", lw=0.8)
        ax2.set(xlabel="", ylabel="fusion speedup (x)", title="RLHFuse over RLHFuse-Base (band: paper)")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
