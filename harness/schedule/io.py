"""Schedule IO: text, CSV, JSON-able dicts and Chrome traces (docs/DESIGN.md section 3).

This module owns every external form of a :class:`Schedule`:

- :func:`ascii_grid` (from :mod:`.grid`) -- rank x step table of action tokens;
- :func:`to_csv` / :func:`from_csv` (and ``*_string``) -- one row per rank: ``rank`` then one
  column per step holding an action token, in the spirit of torch.distributed.pipelining's CSV
  schedules, with our ``pipe`` prefix (``A2F0``) so fused actor/critic schedules round-trip;
- :func:`schedule_to_dict` / :func:`schedule_from_dict` -- the plan JSON form;
- :func:`to_chrome_trace_events` -- simulated timings as Chrome trace "X" events (open in Perfetto).
"""
from __future__ import annotations

import csv
import io as _stdio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from harness.schedule.grid import ascii_grid  # noqa: F401 - re-exported as part of the IO forms
from harness.schedule.ir import Action, PipeSpec, Schedule

if TYPE_CHECKING:  # pragma: no cover
    from harness.schedule.simulate import SimResult


def _pipes_dict(pipes: Mapping[str, PipeSpec] | Iterable[PipeSpec]) -> dict[str, PipeSpec]:
    if isinstance(pipes, Mapping):
        return dict(pipes)
    return {p.name: p for p in pipes}


def to_csv_string(schedule: Schedule) -> str:
    buf = _stdio.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    ranks = sorted(schedule.order)
    steps = max((len(schedule.order[r]) for r in ranks), default=0)
    writer.writerow(["rank", *range(steps)])
    for rank in ranks:
        tokens = [a.token() for a in schedule.order[rank]]
        writer.writerow([rank, *tokens, *([""] * (steps - len(tokens)))])
    return buf.getvalue()


def from_csv_string(text: str, pipes: Mapping[str, PipeSpec] | Iterable[PipeSpec]) -> Schedule:
    rows = list(csv.reader(_stdio.StringIO(text)))
    if not rows or not rows[0] or rows[0][0].strip() != "rank":
        raise ValueError("schedule CSV must start with a header row whose first column is 'rank'")
    order: dict[int, list[Action]] = {}
    for row in rows[1:]:
        if not row or not row[0].strip():
            continue
        rank = int(row[0])
        if rank in order:
            raise ValueError(f"schedule CSV has two rows for rank {rank}")
        order[rank] = [Action.parse(cell) for cell in row[1:] if cell.strip()]
    return Schedule(_pipes_dict(pipes), order)


def to_csv(schedule: Schedule, path: str) -> None:
    with open(path, "w", newline="") as f:
        f.write(to_csv_string(schedule))


def from_csv(path: str, pipes: Mapping[str, PipeSpec] | Iterable[PipeSpec]) -> Schedule:
    with open(path, newline="") as f:
        return from_csv_string(f.read(), pipes)


def pipe_to_dict(pipe: PipeSpec) -> dict[str, Any]:
    return {"name": pipe.name, "num_stages": pipe.num_stages, "num_mbs": pipe.num_mbs,
            "stage_to_rank": list(pipe.stage_to_rank), "model": pipe.model}


def pipe_from_dict(d: Mapping[str, Any]) -> PipeSpec:
    return PipeSpec(name=d["name"], num_stages=int(d["num_stages"]), num_mbs=int(d["num_mbs"]),
                    stage_to_rank=tuple(int(r) for r in d["stage_to_rank"]),
                    model=d.get("model", ""))


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    """JSON-able form: ``{"pipes": [pipe dicts], "order": {"<rank>": ["A0F0", ...]}}``."""
    return {"pipes": [pipe_to_dict(p) for p in schedule.pipes.values()],
            "order": {str(r): [a.token() for a in schedule.order[r]] for r in sorted(schedule.order)}}


def schedule_from_dict(d: Mapping[str, Any]) -> Schedule:
    pipes = d["pipes"]
    pipe_dicts = pipes.values() if isinstance(pipes, Mapping) else pipes
    specs = [pipe_from_dict(p) for p in pipe_dicts]
    order = {int(r): [Action.parse(t) for t in tokens] for r, tokens in d["order"].items()}
    return Schedule({p.name: p for p in specs}, order)


def to_chrome_trace_events(schedule: Schedule, result: "SimResult", pid_offset: int = 0,
                           time_scale_us: float = 1e6) -> list[dict[str, Any]]:
    """Chrome trace events for simulated compute actions: one process per rank, one thread per
    pipe. ``time_scale_us`` converts simulated time units to microseconds (1e6 for seconds)."""
    if not result.start:
        raise ValueError("to_chrome_trace_events needs a SimResult made with record_times=True")
    tids = {name: i for i, name in enumerate(sorted(schedule.pipes))}
    events: list[dict[str, Any]] = []
    for rank in schedule.ranks:
        pid = rank + pid_offset
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        for name, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"pipe {name}"}})
        for action in schedule.order.get(rank, []):
            if action not in result.start:
                continue
            start, end = result.start[action], result.end[action]
            events.append({
                "name": action.token(), "ph": "X", "pid": pid, "tid": tids[action.pipe],
                "ts": start * time_scale_us, "dur": (end - start) * time_scale_us,
                "args": {"pipe": action.pipe, "stage": action.stage, "kind": action.kind,
                         "mb": action.mb},
            })
    return events
