"""Validation of pipeline schedules (docs/DESIGN.md section 3).

This module owns the rules a schedule must obey before anyone times or runs it, and the error
text that explains a broken one (always with the rank x step grid from ``grid.ascii_grid``):

- structure: every action names a known pipe, a stage and micro-batch in range, and sits on the
  rank that holds its stage (``stage_to_rank``); every ``F(pipe, stage, mb)`` appears exactly once,
  and so does every ``B`` unless the pipe is forward-only (no ``B`` at all and
  ``require_backward=False``); in a lowered schedule, every cross-rank edge has exactly its send
  and receive with the right peers (see ``lower``);
- progress: each rank runs its list strictly in order, ``F(s, m)`` needs ``F(s-1, m)``,
  ``B(s, m)`` needs ``F(s, m)`` and ``B(s+1, m)``; a receive needs its matching send, a send its
  compute action, and a compute action its receive. A schedule deadlocks when ranks are left that
  cannot take their next action -- the failure mode that hand-written fused schedules (RLHFuse,
  NSDI'25, arXiv 2409.13221, section 5) and annealing moves over them must be guarded against.

:func:`find_deadlock` and :func:`deadlock_report` are shared with ``simulate``.
"""
from __future__ import annotations

from collections import defaultdict

from harness.schedule.grid import ascii_grid
from harness.schedule.ir import Action, PipeSpec, Schedule
from harness.schedule.lower import comm_partner, recv_before, send_after

MAX_LISTED_PROBLEMS = 20


class ScheduleError(ValueError):
    """A schedule breaks the IR rules; the message explains why and shows the rank x step grid."""


def format_error(headline: str, lines: list[str], schedule: Schedule,
               highlight: dict[int, int] | None = None) -> str:
    shown = lines[:MAX_LISTED_PROBLEMS]
    if len(lines) > len(shown):
        shown.append(f"... and {len(lines) - len(shown)} more")
    note = " ([X] marks where each rank is stuck)" if highlight else ""
    body = "\n".join(f"  - {line}" for line in shown)
    return f"{headline}\n{body}\nrank x step grid{note}:\n{ascii_grid(schedule, highlight=highlight)}"


def _expected_comm(pipe: PipeSpec, action: Action) -> Action | None:
    """What a send/recv action must look like (peer included), or None if none is needed."""
    compute_kind = "F" if action.kind in ("SF", "RF") else "B"
    compute = Action(action.pipe, action.stage, compute_kind, action.mb)
    return (send_after if action.kind[0] == "S" else recv_before)(pipe, compute)


def _check_action(schedule: Schedule, rank: int, action: Action) -> str | None:
    pipe = schedule.pipes.get(action.pipe)
    if pipe is None:
        return f"unknown pipe {action.pipe!r} (known: {', '.join(sorted(schedule.pipes))})"
    if not 0 <= action.stage < pipe.num_stages:
        return f"stage {action.stage} out of range for pipe {pipe.name} ({pipe.num_stages} stages)"
    if not 0 <= action.mb < pipe.num_mbs:
        return f"micro-batch {action.mb} out of range for pipe {pipe.name} ({pipe.num_mbs} mbs)"
    if action.kind == "W":
        return "split backward (W) is not supported yet"
    owner = pipe.stage_to_rank[action.stage]
    if owner != rank:
        return f"stage {action.stage} of pipe {pipe.name} lives on rank {owner}, not rank {rank}"
    if not action.is_compute:
        expected = _expected_comm(pipe, action)
        if expected is None:
            return "no communication is needed here (neighbour stage missing or on the same rank)"
        if expected != action:
            return f"peer should be rank {expected.peer}"
    return None


def _coverage_problems(schedule: Schedule, seen: dict[Action, list[tuple[int, int]]],
                       require_backward: bool) -> list[str]:
    problems = []
    for action, places in seen.items():
        if len(places) > 1:
            where = ", ".join(f"rank {r} step {i}" for r, i in places)
            problems.append(f"{action.token()} appears {len(places)} times ({where})")
    for pipe in schedule.pipes.values():
        has_backward = any(a.pipe == pipe.name and a.kind == "B" for a in seen)
        kinds = ("F", "B") if require_backward or has_backward else ("F",)
        for kind in kinds:
            for s in range(pipe.num_stages):
                for mb in range(pipe.num_mbs):
                    action = Action(pipe.name, s, kind, mb)
                    if action not in seen:
                        problems.append(f"{action.token()} is missing "
                                        f"(expected on rank {pipe.stage_to_rank[s]})")
        lowered = any(a.pipe == pipe.name and not a.is_compute for a in seen)
        if lowered:
            problems += _missing_comm(pipe, seen)
    return problems


def _missing_comm(pipe: PipeSpec, seen: dict[Action, list[tuple[int, int]]]) -> list[str]:
    problems = []
    for action in [a for a in seen if a.pipe == pipe.name and a.is_compute]:
        for comm in (recv_before(pipe, action), send_after(pipe, action)):
            if comm is not None and comm not in seen:
                problems.append(f"lowered schedule lacks {comm.token()} for {action.token()} "
                                f"on rank {pipe.stage_to_rank[action.stage]}")
    return problems


def structural_problems(schedule: Schedule, require_backward: bool = True) -> list[str]:
    """Every structural rule the schedule breaks, as human-readable lines (empty when fine)."""
    problems: list[str] = []
    seen: dict[Action, list[tuple[int, int]]] = defaultdict(list)
    for rank in sorted(schedule.order):
        for step, action in enumerate(schedule.order[rank]):
            problem = _check_action(schedule, rank, action)
            if problem is not None:
                problems.append(f"rank {rank} step {step} ({action.token()}): {problem}")
                continue
            seen[action].append((rank, step))
    return problems + _coverage_problems(schedule, seen, require_backward)


def dependencies(schedule: Schedule, action: Action, rank: int,
                 lowered_pipes: set[str] = frozenset()) -> list[Action]:
    """The actions ``action`` (run on ``rank``) must wait for. In pipes listed in
    ``lowered_pipes``, cross-rank data arrives through receives instead of directly."""
    pipe = schedule.pipes[action.pipe]
    s, mb = action.stage, action.mb
    if action.kind in ("SF", "SB"):
        return [Action(action.pipe, s, "F" if action.kind == "SF" else "B", mb)]
    if action.kind in ("RF", "RB"):
        return [comm_partner(action, rank)[1]]
    deps = []
    if action.kind == "F" and s > 0:
        deps.append(Action(action.pipe, s - 1, "F", mb))
    if action.kind == "B":
        deps.append(Action(action.pipe, s, "F", mb))
        if s < pipe.num_stages - 1:
            deps.append(Action(action.pipe, s + 1, "B", mb))
    if action.pipe in lowered_pipes:
        recv = recv_before(pipe, action)
        if recv is not None:
            deps.append(recv)
    return deps


def find_deadlock(schedule: Schedule) -> dict[int, int] | None:
    """Run every rank's list as far as dependencies allow; return {rank: step it is stuck at} for
    the ranks that cannot finish, or None when the whole schedule can run."""
    lowered = {a.pipe for a in schedule.actions() if not a.is_compute}
    pos = {rank: 0 for rank in schedule.order}
    done: set[Action] = set()
    waiting: dict[Action, list[int]] = defaultdict(list)
    ready = list(schedule.order)
    while ready:
        rank = ready.pop()
        actions, i = schedule.order[rank], pos[rank]
        while i < len(actions):
            unmet = [d for d in dependencies(schedule, actions[i], rank, lowered) if d not in done]
            if unmet:
                waiting[unmet[0]].append(rank)
                break
            done.add(actions[i])
            ready.extend(waiting.pop(actions[i], ()))
            i += 1
        pos[rank] = i
    stuck = {r: i for r, i in pos.items() if i < len(schedule.order[r])}
    return stuck or None


def deadlock_report(schedule: Schedule, stuck: dict[int, int]) -> str:
    """Explain, per stuck rank, which action waits on what and where that is."""
    lowered = {a.pipe for a in schedule.actions() if not a.is_compute}
    location = {a: (r, i) for r, acts in schedule.order.items() for i, a in enumerate(acts)}
    done_before = {a for r, acts in schedule.order.items() for a in acts[:stuck.get(r, len(acts))]}
    lines = []
    for rank in sorted(stuck):
        head = schedule.order[rank][stuck[rank]]
        for dep in dependencies(schedule, head, rank, lowered):
            if dep in done_before:
                continue
            if dep not in location:
                where = "which appears nowhere in the schedule"
            else:
                r, i = location[dep]
                where = (f"at rank {r} step {i}, behind that rank's own blocked "
                         f"{schedule.order[r][stuck[r]].token()}" if r in stuck else f"at rank {r} step {i}")
            lines.append(f"rank {rank} is stuck at step {stuck[rank]}: {head.token()} waits for "
                         f"{dep.token()}, {where}")
    return format_error("schedule deadlocks: no rank can make progress", lines, schedule, stuck)


def validate(schedule: Schedule, require_backward: bool = True) -> None:
    """Raise :class:`ScheduleError` (explanation + grid) unless the schedule is well formed and
    free of deadlock. Accepts compute-only and lowered schedules."""
    problems = structural_problems(schedule, require_backward)
    if problems:
        raise ScheduleError(format_error(f"invalid schedule: {len(problems)} problem(s)",
                                       problems, schedule))
    stuck = find_deadlock(schedule)
    if stuck:
        raise ScheduleError(deadlock_report(schedule, stuck))
