"""Builders: the classic pipeline schedules expressed in the schedule IR (docs/DESIGN.md section 3).

This module owns turning one or more :class:`PipeSpec` into per-rank action lists. It knows
nothing about time or memory (that is ``simulate``) and checks nothing beyond what it needs to
build a sensible order (that is ``validate``).

- :func:`gpipe` -- GPipe (Huang et al., NeurIPS 2019): every forward of every micro-batch, then
  every backward. Peak activation memory on each stage is all ``M`` micro-batches.
- :func:`one_f_one_b` -- the "PipeDream-flush" 1F1B schedule (Narayanan et al., SC'21): stage
  ``s`` of ``P`` runs ``P - s - 1`` warm-up forwards, then alternates one forward / one backward,
  then drains the remaining backwards. Same makespan as GPipe, but stage ``s`` holds at most
  ``min(P - s, M)`` micro-batches of activations.
- :func:`forward_only` -- inference passes (reference / reward / critic values): forwards only.
- :func:`merge_sequential` / :func:`sequential_actor_critic` -- run whole schedules one after the
  other on shared ranks: the baseline that RLHFuse (NSDI'25, arXiv 2409.13221, section 5) improves
  on by fusing the actor and critic pipelines, whose stages may run in opposite rank directions.
- :func:`build` -- dispatch by name, used by configs and plans.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache

from harness.schedule.ir import Action, PipeSpec, Schedule

Order = dict[int, list[Action]]


def _empty_order(pipe: PipeSpec) -> Order:
    return {rank: [] for rank in sorted(set(pipe.stage_to_rank))}


def one_f_one_b_stage(pipe: PipeSpec, stage: int) -> list[Action]:
    """Action list of one stage under PipeDream-flush 1F1B (warm-up, steady 1F1B, cool-down).
    A fresh list (callers may edit it) of cached, immutable actions: planners build the same
    stages thousands of times while scoring layouts."""
    return list(_one_f_one_b_stage(pipe.name, pipe.num_stages, pipe.num_mbs, stage))


# (pipe, stage, kind) -> that stage's actions of micro-batches 0, 1, ...: the schedules of one pipe
# with other micro-batch counts share them (a layout search builds thousands of 1F1B stages)
_STAGE_ACTIONS: dict[tuple[str, int, str], list[Action]] = {}


def _stage_actions(name: str, stage: int, kind: str, num_mbs: int) -> list[Action]:
    """The (immutable, shared) actions ``kind`` of micro-batches ``0 .. num_mbs - 1`` of one stage."""
    made = _STAGE_ACTIONS.setdefault((name, stage, kind), [])
    made.extend(Action(name, stage, kind, mb) for mb in range(len(made), num_mbs))
    return made[:num_mbs]


@lru_cache(maxsize=4096)
def _one_f_one_b_stage(name: str, num_stages: int, num_mbs: int, stage: int) -> tuple[Action, ...]:
    warmup = min(num_stages - stage - 1, num_mbs)
    fwd, bwd = _stage_actions(name, stage, "F", num_mbs), _stage_actions(name, stage, "B", num_mbs)
    actions = fwd[:warmup]
    for i in range(num_mbs - warmup):
        actions.append(fwd[warmup + i])
        actions.append(bwd[i])
    actions.extend(bwd[num_mbs - warmup:])
    return tuple(actions)


def one_f_one_b(pipe: PipeSpec) -> Order:
    """PipeDream-flush 1F1B. Each stage must sit on its own rank (interleaved placements, where a
    rank holds several stages of one pipe, need an interleaved builder)."""
    if len(set(pipe.stage_to_rank)) != pipe.num_stages:
        raise ValueError(
            f"pipe {pipe.name}: 1F1B needs one stage per rank, got stage_to_rank={pipe.stage_to_rank}"
        )
    return {pipe.stage_to_rank[s]: one_f_one_b_stage(pipe, s) for s in range(pipe.num_stages)}


def gpipe(pipe: PipeSpec) -> Order:
    """GPipe: all forwards (micro-batch major, then stage) and then all backwards (micro-batch
    major, last stage first). That global order is a valid execution order, so any placement,
    including several stages per rank, is deadlock free."""
    order = _empty_order(pipe)
    for mb in range(pipe.num_mbs):
        for s in range(pipe.num_stages):
            order[pipe.stage_to_rank[s]].append(Action(pipe.name, s, "F", mb))
    for mb in range(pipe.num_mbs):
        for s in reversed(range(pipe.num_stages)):
            order[pipe.stage_to_rank[s]].append(Action(pipe.name, s, "B", mb))
    return order


def forward_only(pipe: PipeSpec) -> Order:
    """Inference: forwards only, micro-batch major, so any placement is deadlock free."""
    order = _empty_order(pipe)
    for mb in range(pipe.num_mbs):
        for s in range(pipe.num_stages):
            order[pipe.stage_to_rank[s]].append(Action(pipe.name, s, "F", mb))
    return order


def merge_sequential(*orders: Order) -> Order:
    """Concatenate per-rank lists: on every rank, all of ``orders[0]``, then all of ``orders[1]``..."""
    merged: Order = {}
    for order in orders:
        for rank, actions in order.items():
            merged.setdefault(rank, []).extend(actions)
    return {rank: merged[rank] for rank in sorted(merged)}


def _pipes_by_name(pipes: Iterable[PipeSpec]) -> dict[str, PipeSpec]:
    by_name: dict[str, PipeSpec] = {}
    for pipe in pipes:
        if pipe.name in by_name:
            raise ValueError(f"two pipes are both named {pipe.name!r}")
        by_name[pipe.name] = pipe
    return by_name


def sequential_actor_critic(actor: PipeSpec, critic: PipeSpec) -> Schedule:
    """1F1B of the actor, then 1F1B of the critic, on the same ranks (the critic may run in the
    opposite rank direction). Each rank starts critic work as soon as its own actor work is done."""
    return Schedule(_pipes_by_name([actor, critic]),
                    merge_sequential(one_f_one_b(actor), one_f_one_b(critic)))


BUILDERS: dict[str, Callable[[PipeSpec], Order]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "forward_only": forward_only,
    "sequential": one_f_one_b,
}


def build(kind: str, pipes: list[PipeSpec]) -> Schedule:
    """Build a schedule by name. Every kind runs the given pipes one after another in list order;
    ``sequential`` is 1F1B per pipe (so ``1f1b`` with several pipes means the same thing)."""
    key = kind.lower().replace("-", "_")
    if key not in BUILDERS:
        raise ValueError(f"unknown schedule kind {kind!r}; known: {', '.join(BUILDERS)}")
    if not pipes:
        raise ValueError("build needs at least one pipe")
    builder = BUILDERS[key]
    return Schedule(_pipes_by_name(pipes), merge_sequential(*(builder(p) for p in pipes)))
