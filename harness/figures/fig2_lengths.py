"""Figure 2 (RLHFuse section 2): output-length CDF of the workload and the share of generation time
spent on the longest 10% of samples, per max generation length. Paper: long tail, P99.9 > 10x median."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.run import results
from harness.figures import style

EXPERIMENT = "fig2_lengths"
PAPER_P999_OVER_MEDIAN = 10.0


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    df = style.load_experiment(root, EXPERIMENT)
    if "workload.max_gen_len" not in df.columns:
        raise style.FigureError(f"{EXPERIMENT}: runs under {Path(root) / EXPERIMENT} have no workload.max_gen_len "
                                f"in their overrides (the experiment sweeps it)")
    style.one_variant(df, ["workload.max_gen_len", "seed"], EXPERIMENT)
    style.setup()
    fig, (ax_cdf, ax_share) = plt.subplots(1, 2, figsize=(10, 3.8))
    df = df.sort_values("workload.max_gen_len")
    shares = []
    for _, row in df.iterrows():
        lengths = np.sort(results.load_run_table(row["path"], results.SAMPLES_FILE)["response_len"].to_numpy())
        cdf = np.arange(1, len(lengths) + 1) / len(lengths)
        cap = int(row["workload.max_gen_len"])
        ax_cdf.step(lengths, cdf, where="post", label=f"max {cap} (P99.9/median = "
                    f"{np.percentile(lengths, 99.9) / np.median(lengths):.1f}x)")
        shares.append((cap, row["gen/tail_s"] / row["timing_s/gen"]))
    ax_cdf.set_xscale("log", base=2)  # ticks at powers of two, like the max lengths
    ax_cdf.xaxis.set_major_formatter(ScalarFormatter())
    ax_cdf.xaxis.set_minor_formatter(NullFormatter())
    ax_cdf.set(xlabel="output length (tokens)", ylabel="cumulative fraction of samples",
               title="Output-length distribution")
    ax_cdf.legend(title="max generation length (tokens)", loc="best")
    style.paper_note(ax_cdf, f"paper: P99.9 > {PAPER_P999_OVER_MEDIAN:.0f}x median")
    caps, share = zip(*shares)
    ax_share.bar([str(c) for c in caps], [100 * s for s in share], color=style.system_color("RLHFuse-Base"))
    ax_share.set(xlabel="max generation length (tokens)", ylabel="generation time after 90% of samples (%)",
                 title="Time spent on the longest 10%")
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
