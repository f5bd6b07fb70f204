"""Table 3 (RLHFuse section 7.5): fused schedule vs serial 1F1B, greedy, 1F1B+ and the lower bound,
with peak-memory ratios to serial 1F1B; rendered as a figure (table) and a Markdown file."""
from __future__ import annotations

from pathlib import Path

from harness.figures import style

EXPERIMENT = "table3_schedules"
COLUMNS = {"pair": "actor/critic", "pp_actor": "actor pp (stages)", "pp_critic": "critic pp (stages)",
           "microbatches_actor": "micro-batches (actor)", "serial_s": "serial 1F1B (ms)",
           "one_f_one_b_plus_s": "1F1B+ (ms)", "greedy_s": "greedy (ms)", "fused_s": "fused (ms)", "lower_bound_s": "lower bound (ms)",
           "fused_speedup": "fused speedup vs serial (x)", "fused_memory_ratio": "fused memory / serial (x)",
           "one_f_one_b_plus_memory_ratio": "1F1B+ memory / serial (x)"}


def table(root):
    df = style.load_table(root, EXPERIMENT, "table3.csv")
    out = df[list(COLUMNS)].copy()
    for col in ("serial_s", "one_f_one_b_plus_s", "greedy_s", "fused_s", "lower_bound_s"):
        out[col] = (1e3 * out[col]).round(1)
    for col in ("fused_speedup", "fused_memory_ratio", "one_f_one_b_plus_memory_ratio"):
        out[col] = out[col].round(2)
    return out.rename(columns=COLUMNS)


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt

    t = table(root)
    style.setup()
    fig, ax = plt.subplots(figsize=(15, 0.35 * len(t) + 1.0))
    ax.axis("off")
    cells = ax.table(cellText=t.values, colLabels=list(t.columns), loc="center", cellLoc="center")
    cells.auto_set_font_size(False)
    cells.set_fontsize(8)
    cells.auto_set_column_width(list(range(len(t.columns))))
    cells.scale(1, 1.3)
    ax.set_title("Table 3: training schedules of one mini-batch (per-stage costs from the cost model)")
    paths = style.save(fig, root, EXPERIMENT)
    md = Path(root) / "figures" / f"{EXPERIMENT}.md"
    md.write_text(t.to_markdown(index=False))
    return paths + [md]
