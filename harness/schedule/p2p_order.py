"""Point-to-point message order: schedules that stay correct when messages are matched in posting
order per rank pair, as NCCL matches them (docs/DESIGN.md section 3).

NCCL ignores tags: between two ranks, the k-th receive one posts gets the payload of the k-th send
the other posted (NCCL docs, "Point-to-point communication"). A lowered schedule
(:func:`harness.schedule.lower`) runs correctly under that rule only if, for every directed rank
pair (src, dst), src posts its sends to dst in the same order as dst posts its receives from src.
Plain 1F1B/GPipe pipelines keep that order by construction; a fused bidirectional schedule
(RLHFuse, NSDI'25, arXiv 2409.13221, section 5) need not: on the link from rank r to r+1 the
actor's forward activations and the critic's gradients interleave in each rank's own order, and
a searched schedule interleaves them differently on the two ends.

This module owns:

- :func:`message_order` / :func:`order_mismatches` / :func:`check_in_order`: the offline checker,
  which compares, pair by pair, the sender's posting order with the receiver's over the lowered
  action lists (the lists the real pipeline runtime executes);
- :func:`order_receives`: the fix, a pass over a lowered schedule that makes every rank post its
  receives from a peer in that peer's send order (:func:`in_posting_order`: fixed and checked, as
  the real runtime executes a schedule). A receive needed before the ones posted ahead
  of it on the sender is preceded by those earlier receives (their payloads wait in a buffer
  until their compute action runs), and a receive already posted early is dropped from its old
  place. Sends are never moved, so this cannot add a wait: when a rank needs message ``m`` its
  sender has posted ``m`` and therefore every message it sends to that rank before ``m``.
"""
from __future__ import annotations

from collections import defaultdict

from harness.schedule.ir import Action, Schedule
from harness.schedule.lower import comm_partner, lower

Pair = tuple[int, int]  # (source rank, destination rank)


def _is_lowered(schedule: Schedule) -> bool:
    return any(not a.is_compute for acts in schedule.order.values() for a in acts)


def _lowered(schedule: Schedule) -> Schedule:
    return schedule if _is_lowered(schedule) else lower(schedule)


def message_order(schedule: Schedule) -> tuple[dict[Pair, list[Action]], dict[Pair, list[Action]]]:
    """Per directed rank pair: the messages in the order the source posts its sends, and in the
    order the destination posts its receives; both as the *send* action that names the message
    (``A2SF0>3``). A compute-only schedule is lowered first."""
    lowered = _lowered(schedule)
    sent: dict[Pair, list[Action]] = defaultdict(list)
    received: dict[Pair, list[Action]] = defaultdict(list)
    for rank, actions in lowered.order.items():
        for a in actions:
            if a.kind in ("SF", "SB"):
                sent[(rank, a.peer)].append(a)
            elif a.kind in ("RF", "RB"):
                src, send = comm_partner(a, rank)
                received[(src, rank)].append(send)
    return dict(sent), dict(received)


def order_mismatches(schedule: Schedule) -> list[str]:
    """One line per directed rank pair whose two ends disagree on the message order (the first
    position where they differ), or whose messages differ. Empty: posting-order matching gives
    every receive the payload it expects."""
    sent, received = message_order(schedule)
    problems = []
    for pair in sorted(set(sent) | set(received)):
        s, r = sent.get(pair, []), received.get(pair, [])
        if s == r:
            continue
        if sorted(s) != sorted(r):
            problems.append(f"ranks {pair[0]}->{pair[1]}: {len(s)} sends but receives of "
                            f"{len(r)} messages that differ from them")
            continue
        k = next(i for i, (x, y) in enumerate(zip(s, r)) if x != y)
        problems.append(f"ranks {pair[0]}->{pair[1]}: message {k} is {s[k].token()} on the sender but the "
                        f"receiver's receive {k} expects {r[k].token()}")
    return problems


def check_in_order(schedule: Schedule) -> None:
    """Raise ScheduleError if some rank pair would match messages wrongly under posting order."""
    from harness.schedule.checks import ScheduleError, format_error

    problems = order_mismatches(schedule)
    if problems:
        raise ScheduleError(format_error(
            f"{len(problems)} rank pair(s) post sends and receives in different orders (NCCL matches "
            f"point-to-point messages per rank pair in posting order, ignoring tags):", problems,
            _lowered(schedule)))


def order_receives(schedule: Schedule) -> Schedule:
    """The lowered schedule with every rank's receives from each peer in that peer's send order
    (see the module docstring); compute and send actions keep their places."""
    lowered = _lowered(schedule)
    sent, _ = message_order(lowered)
    out: dict[int, list[Action]] = {}
    for rank, actions in lowered.order.items():
        position = {src: 0 for (src, dst) in sent if dst == rank}  # next message expected per source
        posted: set[Action] = set()  # receives already posted early
        ordered: list[Action] = []
        for a in actions:
            if a.kind not in ("RF", "RB"):
                ordered.append(a)
                continue
            if a in posted:
                continue
            src, send = comm_partner(a, rank)
            stream = sent[(src, rank)]
            while True:  # every message the source sends before this one, then this one
                earlier = stream[position[src]]
                position[src] += 1
                _, recv = comm_partner(earlier, src)
                ordered.append(recv)
                posted.add(recv)
                if earlier == send:
                    break
        out[rank] = ordered
    return Schedule(dict(lowered.pipes), out)


def in_posting_order(schedule: Schedule) -> Schedule:
    """A schedule as a real runtime executes it: lowered to sends and receives, every rank posting
    its receives in its peers' send order (:func:`order_receives`), checked (:func:`check_in_order`)."""
    ordered = order_receives(schedule)
    check_in_order(ordered)
    return ordered
