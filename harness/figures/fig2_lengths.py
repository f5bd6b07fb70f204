"""Figure 2 (RLHFuse section 2): output-length CDF of the workload and the share of generation time
spent on the longest 10% of samples, per max generation length. Paper: long tail, P99.9 > 10x median."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from harness import results
from harness.figures import style

EXPERIMENT = "fig2_lengths"


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt

    df = style.load_experiment(root, EXPERIMENT)
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
    ax_cdf.set(xlabel="output length (tokens)", ylabel="CDF of samples", xscale="log",
               title="Output-length distribution")
    ax_cdf.legend(fontsize=8, loc="lower right")
    caps, share = zip(*shares)
    ax_share.bar([str(c) for c in caps], [100 * s for s in share], color=style.palette()["RLHFuse-Base"])
    ax_share.set(xlabel="max generation length (tokens)", ylabel="generation time after 90% of samples (%)",
                 title="Time spent on the longest 10%")
    ax_cdf.text(0.02, 0.95, "paper: P99.9 > 10x median", transform=ax_cdf.transAxes, color=style.PAPER_COLOR,
                va="top", fontsize=8)
    return style.save(fig, root, EXPERIMENT)
