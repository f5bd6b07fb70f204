"""Shared figure style: one seaborn theme, system order, colours and labels fixed across figures,
the paper's statements drawn one way (shaded band for a range, dashed line for a point, note for
a bound, all labelled "paper"), saving PNG + PDF, and the errors a figure raises when its results
are missing.

Figure modules take every colour from here (:func:`palette`, :func:`system_color`,
:func:`pair_palette`, :func:`part_colors`, :func:`schedule_colors`) and set no rc parameters of
their own (:func:`setup` does).
"""
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
PAPER_ALPHA = 0.3
PAPER_LABEL = "paper"


class FigureError(Exception):
    """Results that cannot be drawn; ``python -m harness.figures`` reports it as one ``error:`` line."""


class MissingResults(FigureError, FileNotFoundError):
    """No (or not enough) results for a figure; the message names the experiment that makes them."""

    def __init__(self, what: str, experiment: str, root: str | Path):
        self.experiment = experiment
        where = "" if str(root) == "results" else f" results_dir={root}"
        super().__init__(f"{what}: run python -m harness +experiment={experiment}{where}")


def setup() -> None:
    """The one theme every figure uses (seaborn whitegrid, paper context, colourblind palette)."""
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper", font_scale=1.1, palette="colorblind",
                  rc={"legend.fontsize": 8, "legend.title_fontsize": 9, "axes.titlesize": 11,
                      "axes.labelsize": 10, "figure.dpi": 100, "savefig.dpi": 150, "hatch.color": "white"})


def palette() -> dict[str, tuple]:
    """System label -> colour (fixed across figures)."""
    import seaborn as sns

    colors = sns.color_palette("colorblind", len(SYSTEM_ORDER))
    return {SYSTEM_LABELS[s]: colors[i] for i, s in enumerate(SYSTEM_ORDER)}


def system_color(label: str, index: int = 0) -> tuple:
    """A system's colour; out-of-tree systems get a grey shade by their position."""
    import seaborn as sns

    return palette().get(label) or sns.color_palette("Greys", 6)[2 + index % 4]


def pair_palette(n: int) -> list[tuple]:
    """Colours of ``n`` actor/critic pairs (a sequential palette, distinct from the systems')."""
    import seaborn as sns

    return sns.color_palette("mako", max(n, 1))


def part_colors() -> dict[str, tuple]:
    """Parts of an iteration (Figure 8)."""
    import seaborn as sns

    c = sns.color_palette("colorblind")
    return {"gen+inf": c[0], "train": c[1], "others": c[7]}


def schedule_colors() -> dict[tuple[str, str], tuple]:
    """(model, F/B) -> colour for pipeline Gantt charts: forward dark, backward light."""
    import seaborn as sns

    p = sns.color_palette("Paired")
    return {("actor", "F"): p[1], ("actor", "B"): p[0], ("critic", "F"): p[7], ("critic", "B"): p[6]}


def model_order(present) -> list[str]:
    """The paper's pairs in the paper's order, then any other model (e.g. ``tiny``) sorted."""
    present = set(present)
    return [m for m in PAIR_ORDER if m in present] + sorted(present - set(PAIR_ORDER))


def model_label(model: str) -> str:
    return PAIR_LABELS.get(model, model.replace("_", "/").upper())


def _label_once(ax, label: str | None) -> str | None:
    return None if label is None or label in ax.get_legend_handles_labels()[1] else label


def paper_band(ax, lo: float, hi: float, x: tuple[float, float] | None = None, label: str | None = PAPER_LABEL):
    """The paper's stated range ``lo``-``hi`` as a shaded band (over ``x`` = (x0, x1), or the whole
    width), behind the data, with dashed edges in front so bars do not hide it."""
    kw = {"color": PAPER_COLOR, "alpha": PAPER_ALPHA, "zorder": 0, "lw": 0, "label": _label_once(ax, label)}
    edge = {"colors": PAPER_COLOR, "linestyles": "--", "lw": 1, "zorder": 4}
    if x is None:
        ax.axhspan(lo, hi, **kw)
        x0, x1 = 0, 1
        ax.hlines([lo, hi], x0, x1, transform=ax.get_yaxis_transform(), **edge)
    else:
        ax.fill_between(list(x), lo, hi, **kw)
        ax.hlines([lo, hi], *x, **edge)


def paper_line(ax, *, x: float | None = None, y: float | None = None, label: str = PAPER_LABEL) -> None:
    """A value the paper states (or that the paper says ours should reach) as a dashed line."""
    kw = {"color": PAPER_COLOR, "ls": "--", "lw": 1.2, "label": _label_once(ax, label), "zorder": 4}
    ax.axvline(x, **kw) if x is not None else ax.axhline(y, **kw)


def reference_line(ax, y: float = 1.0) -> None:
    """The no-change line of a ratio axis (speedup 1x)."""
    ax.axhline(y, color="black", lw=0.8, zorder=3)


def paper_note(ax, text: str, loc: str = "upper left") -> None:
    """A statement of the paper that is a bound, not a range (e.g. "paper: P99.9 > 10x median")."""
    x, ha = (0.02, "left") if loc.endswith("left") else (0.98, "right")
    y, va = (0.97, "top") if loc.startswith("upper") else (0.03, "bottom")
    ax.text(x, y, text, transform=ax.transAxes, ha=ha, va=va, color="0.3", fontsize=8,
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": PAPER_COLOR, "alpha": 0.85})


def save(fig, root: str | Path, name: str) -> list[Path]:
    """``<root>/figures/<name>.png`` (150 dpi) and ``.pdf``; closes the figure."""
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


def load_experiment(root, experiment: str, run: str | None = None):
    """Finished runs of ``experiment`` (through :func:`harness.run.results.load_results`); a
    :class:`MissingResults` naming the experiment to run (``run``, default ``experiment``) if none."""
    from harness.run import results

    df = results.load_results(root, experiment)
    if df.empty:
        raise MissingResults(f"no finished runs under {Path(root) / experiment}", run or experiment, root)
    return df


def load_table(root, experiment: str, name: str):
    """A table an experiment runner wrote (``<root>/<experiment>/<name>``); :class:`MissingResults` if absent."""
    from harness.run import results

    path = Path(root) / experiment / name
    if not path.is_file():
        raise MissingResults(f"no {path}", experiment, root)
    return results.load_run_table(path.parent, name)


def one_variant(df, keys: list[str], experiment: str) -> None:
    """Refuse to draw runs that differ only in other overrides (e.g. the same system, model and
    max length once with and once without ``cluster.num_nodes=16``): the figure would average
    them silently."""
    keys = [k for k in keys if k in df.columns]
    variants = df.groupby(keys)["variant"].nunique()
    mixed = variants[variants > 1]
    if not mixed.empty:
        key = mixed.index[0]
        sub = df.set_index(keys).loc[[key]]
        raise FigureError(f"{experiment}: runs of {dict(zip(keys, key if isinstance(key, tuple) else (key,)))} "
                          f"with different overrides ({' vs '.join(sorted(set(sub['variant'])))}); draw them from "
                          f"separate results dirs (--results)")
