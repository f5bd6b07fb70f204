"""Figure 9 (RLHFuse section 7.4): throughput vs the migration threshold R_t for 33B/65B and 65B/33B
at max generation length 1024. Paper: U-shaped, optimum near 20% of the batch (marked)."""
from __future__ import annotations

from pathlib import Path

from harness.figures import style

EXPERIMENT = "fig9_migration"


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt

    df = style.load_experiment(root, EXPERIMENT)
    style.setup()
    models = [m for m in style.PAIR_ORDER if m in set(df["model"])]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = df[df["model"] == model].sort_values("system.migration_frac")
        ax.plot(100 * sub["system.migration_frac"], sub["perf/samples_per_s"], marker="o",
                color=style.palette()["RLHFuse"], label="ours (simulated)")
        ax.axvline(20, color=style.PAPER_COLOR, ls="--", label="paper optimum (~20%)")
        ax.set(xlabel="migration threshold R_t (% of batch; 0 = stream without migrating)",
               ylabel="throughput (samples/s)", title=style.PAIR_LABELS[model])
        ax.legend(fontsize=8)
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
