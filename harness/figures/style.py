"""Shared figure style: system order, colours and labels fixed across figures; saving PNG + PDF."""
from __future__ import annotations

from pathlib import Path

SYSTEM_ORDER = ("deepspeed_chat", "realhf_heuristic", "realhf", "interleaved", "disaggregated", "rlhfuse_base",
                "rlhfuse")
SYSTEM_LABELS = {"deepspeed_chat": "DeepSpeed-Chat", "realhf_heuristic": "ReaLHF (heuristic)", "realhf": "ReaLHF",
                 "interleaved": "Interleaved", "disaggregated": "Disaggregated", "rlhfuse_base": "RLHFuse-Base",
                 "rlhfuse": "RLHFuse"}
PAIR_ORDER = ("13b_33b", "33b_13b", "33b_65b", "65b_33b")
PAIR_LABELS = {p: p.replace("_", "/").upper() for p in PAIR_ORDER}
PAPER_COLOR = "0.55"


def palette() -> dict[str, tuple]:
    import seaborn as sns

    colors = sns.color_palette("colorblind", len(SYSTEM_ORDER))
    return {SYSTEM_LABELS[s]: colors[i] for i, s in enumerate(SYSTEM_ORDER)}


def setup() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper", font_scale=1.1)


def save(fig, root: str | Path, name: str) -> list[Path]:
    out = Path(root) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


def ordered_systems(present) -> list[str]:
    return [SYSTEM_LABELS[s] for s in SYSTEM_ORDER if s in set(present)]


def load_experiment(root, experiment: str):
    """Finished runs of ``experiment`` (through :func:`harness.results.load_results`); a clear error if none."""
    from harness import results

    df = results.load_results(root, experiment)
    if df.empty:
        raise FileNotFoundError(f"no finished runs under {root}/{experiment}: run python -m harness "
                                f"+experiment={experiment}")
    return df
