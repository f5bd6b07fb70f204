"""Figure 9 (RLHFuse section 7.4): throughput vs the migration threshold R_t for 33B/65B and 65B/33B
at max generation length 1024. Paper: U-shaped, optimum near 20% of the batch (marked)."""
from __future__ import annotations

from pathlib import Path

from harness.figures import style

EXPERIMENT = "fig9_migration"
PAPER_OPTIMUM_PCT = 20


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt

    df = style.load_experiment(root, EXPERIMENT)
    if "system.migration_frac" not in df.columns:
        raise style.FigureError(f"{EXPERIMENT}: runs under {Path(root) / EXPERIMENT} have no system.migration_frac "
                                f"in their overrides (the experiment sweeps it)")
    style.one_variant(df, ["model", "system.migration_frac", "seed"], EXPERIMENT)
    style.setup()
    models = style.model_order(df["model"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = df[df["model"] == model].groupby("system.migration_frac")["perf/samples_per_s"].mean()
        ax.plot(100 * sub.index.to_numpy(dtype=float), sub.to_numpy(), marker="o", color=style.system_color("RLHFuse"),
                label="ours (simulated)")
        style.paper_line(ax, x=PAPER_OPTIMUM_PCT, label=f"paper: optimum near {PAPER_OPTIMUM_PCT}%")
        ax.set(xlabel="migration threshold R_t (% of batch; 0 = stream, no migration)",
               ylabel="throughput (samples/s)", title=style.model_label(model))
        ax.legend()
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
