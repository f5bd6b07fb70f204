"""Lowering: add point-to-point communication actions to a compute-only schedule (docs/DESIGN.md section 3).

This module owns where sends and receives go, so that the real pipeline runtime can execute the
lowered per-rank lists verbatim, and ``validate`` can check a lowered schedule against the same
rules. A compute action whose neighbouring stage sits on another rank gets:

- forward: ``SF`` (send activations to the rank of stage ``s + 1``) right after ``F(s, m)``, and on
  that rank ``RF`` (stage ``s + 1``, peer = sender) right before ``F(s + 1, m)``;
- backward: ``SB`` (send gradients to the rank of stage ``s - 1``) right after ``B(s, m)``, and
  ``RB`` (stage ``s - 1``) right before ``B(s - 1, m)``.

Send actions carry the *sender's* stage, receive actions the *receiver's* stage, and both carry
the peer rank. Sends are asynchronous (isend-like), receives block until the matching send was
posted; with that rule a receive placed right before its consumer waits exactly as long as the
consumer's data dependency does, so lowering a deadlock-free schedule cannot deadlock it, and the
simulated makespan is unchanged (``simulate`` charges ``PipeCosts.p2p`` on cross-rank edges either
way). Neighbours on the same rank exchange nothing.
"""
from __future__ import annotations

from harness.schedule.ir import Action, PipeSpec, Schedule

RECV_OF_SEND = {"SF": "RF", "SB": "RB"}
SEND_OF_RECV = {"RF": "SF", "RB": "SB"}


def recv_before(pipe: PipeSpec, action: Action) -> Action | None:
    """The receive that must run right before compute ``action`` (None if its input is local)."""
    stage, rank = action.stage, pipe.stage_to_rank[action.stage]
    if action.kind == "F" and stage > 0:
        src = pipe.stage_to_rank[stage - 1]
        return None if src == rank else Action(action.pipe, stage, "RF", action.mb, peer=src)
    if action.kind == "B" and stage < pipe.num_stages - 1:
        src = pipe.stage_to_rank[stage + 1]
        return None if src == rank else Action(action.pipe, stage, "RB", action.mb, peer=src)
    return None


def send_after(pipe: PipeSpec, action: Action) -> Action | None:
    """The send that must run right after compute ``action`` (None if its consumer is local)."""
    stage, rank = action.stage, pipe.stage_to_rank[action.stage]
    if action.kind == "F" and stage < pipe.num_stages - 1:
        dst = pipe.stage_to_rank[stage + 1]
        return None if dst == rank else Action(action.pipe, stage, "SF", action.mb, peer=dst)
    if action.kind == "B" and stage > 0:
        dst = pipe.stage_to_rank[stage - 1]
        return None if dst == rank else Action(action.pipe, stage, "SB", action.mb, peer=dst)
    return None


def comm_partner(action: Action, rank: int) -> tuple[int, Action]:
    """For a send/recv ``action`` executed on ``rank``: (peer rank, the matching action there)."""
    if action.peer is None:
        raise ValueError(f"{action.token()} has no peer rank")
    if action.kind in RECV_OF_SEND:
        step = 1 if action.kind == "SF" else -1
        kind = RECV_OF_SEND[action.kind]
    elif action.kind in SEND_OF_RECV:
        step = -1 if action.kind == "RF" else 1
        kind = SEND_OF_RECV[action.kind]
    else:
        raise ValueError(f"{action.token()} is not a communication action")
    return action.peer, Action(action.pipe, action.stage + step, kind, action.mb, peer=rank)


def strip_comm(schedule: Schedule) -> Schedule:
    """The compute-only schedule (drops every send/recv)."""
    order = {r: [a for a in acts if a.is_compute] for r, acts in schedule.order.items()}
    return Schedule(dict(schedule.pipes), order)


def lower(schedule: Schedule) -> Schedule:
    """Return a new schedule with send/recv actions inserted next to their compute actions.
    Idempotent: existing send/recv actions are dropped and re-derived."""
    order: dict[int, list[Action]] = {}
    for rank, actions in schedule.order.items():
        lowered: list[Action] = []
        for action in actions:
            if not action.is_compute:
                continue
            pipe = schedule.pipes[action.pipe]
            recv = recv_before(pipe, action)
            if recv is not None:
                lowered.append(recv)
            lowered.append(action)
            send = send_after(pipe, action)
            if send is not None:
                lowered.append(send)
        order[rank] = lowered
    return Schedule(dict(schedule.pipes), order)
