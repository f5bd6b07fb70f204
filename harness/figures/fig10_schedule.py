"""Figure 10 (RLHFuse section 7.5): Gantt chart of the fused 16-stage 65B actor + two 8-stage 33B
critic pipelines, and activation memory over time against serial 1F1B. Paper: as long as the 65B
actor alone with 1F1B (the critic hidden), at the serial 1F1B memory peak (both marked)."""
from __future__ import annotations

from pathlib import Path

from harness.figures import style

EXPERIMENT = "fig10_schedule"


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt

    actions = style.load_table(root, EXPERIMENT, "actions.csv")
    memory = style.load_table(root, EXPERIMENT, "memory.csv")
    summary = style.load_table(root, EXPERIMENT, "summary.csv").iloc[0]
    style.setup()
    fig, (ax, ax_mem) = plt.subplots(2, 1, figsize=(12, 8), gridspec_kw={"height_ratios": [3, 2]})
    colors = style.schedule_colors()
    fused = actions[actions["schedule"] == "fused"]
    for (model, kind), group in fused.groupby(["model", "kind"]):
        ax.barh(group["rank"], 1e3 * (group["end_s"] - group["start_s"]), left=1e3 * group["start_s"], height=0.8,
                color=colors[(model, kind)], label=f"{'65B actor' if model == 'actor' else '33B critic'} "
                f"{'forward' if kind == 'F' else 'backward'}", edgecolor="white", linewidth=0.3)
    style.paper_line(ax, x=1e3 * summary["actor_alone_1f1b_s"], label="65B actor alone, 1F1B (paper: fused ends here)")
    ax.set(xlabel="time (ms)", ylabel="pipeline rank (GPU)", title=f"fused schedule: {1e3 * summary['fused_s']:.1f} ms "
           f"(serial 1F1B {1e3 * summary['serial_s']:.1f} ms, lower bound {1e3 * summary['lower_bound_s']:.1f} ms)")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=5)
    for label, sched in (("fused", "fused"), ("serial 1F1B", "serial_1f1b")):
        per_time = memory[memory["schedule"] == sched]
        peak = per_time.groupby("rank")["activation_gb"].max()
        worst = int(peak.idxmax())
        series = per_time[per_time["rank"] == worst].sort_values("time_s")
        ax_mem.step(1e3 * series["time_s"], series["activation_gb"], where="post", label=f"{label} (rank {worst})")
    style.paper_line(ax_mem, y=summary["serial_peak_gb"], label="serial 1F1B peak (paper: fused peak)")
    ax_mem.set(xlabel="time (ms)", ylabel="activation memory (GB)", title="in-flight activations on the busiest rank")
    ax_mem.set_xlim(ax.get_xlim())  # the same time axis as the Gantt chart
    ax_mem.legend()
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
