"""The rank x step text grid of a schedule, used in every validation error so a broken schedule
can be read at a glance (and in logs and reports). Depends on the IR only, so the validator and
the simulator can both use it."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.schedule.ir import Schedule


def ascii_grid(schedule: Schedule, results: Any = None,
               highlight: Mapping[int, int] | None = None) -> str:
    """Rows are ranks, columns are step indices, cells are action tokens padded to one width.
    ``highlight`` maps rank -> step to bracket (e.g. where a rank is stuck); with ``results``
    each row gets its busy/idle time and a footer gives makespan and bubble fraction."""
    ranks = schedule.ranks
    highlight = dict(highlight or {})
    steps = max((len(schedule.order.get(r, [])) for r in ranks), default=0)
    width = max((len(a.token()) for a in schedule.actions()), default=1) + 2
    label = max((len(f"r{r}") for r in ranks), default=2)
    lines = [" " * label + " |" + "".join(f"{i:^{width}}" for i in range(steps))]
    for rank in ranks:
        actions = schedule.order.get(rank, [])
        cells = []
        for step in range(steps):
            token = actions[step].token() if step < len(actions) else "."
            cells.append(f"[{token}]".center(width) if highlight.get(rank) == step
                         else token.center(width))
        row = f"{f'r{rank}':>{label}} |" + "".join(cells)
        if results is not None:
            row += f" | busy={results.busy.get(rank, 0.0):g} idle={results.idle.get(rank, 0.0):g}"
        lines.append(row.rstrip())
    if results is not None:
        lines.append(f"makespan={results.makespan:g} bubble={results.bubble_frac:.3f} "
                     f"peak_mem={results.max_peak_memory:g}")
    return "\n".join(lines)
