"""Point-to-point message order (harness.schedule.p2p_order): the offline checker and the pass that
makes a lowered schedule safe under NCCL's posting-order matching.

Oracles: a hand-built fused schedule whose two ends disagree (the checker must name the pair), the
plain builders (consistent by construction: the pass must leave them alone), and every Table 3
shape of RLHFuse (33B/13B at pp 8/4 and 8/8, 65B/33B at pp 16/8 and 16/16; 8 to 64 micro-batches;
stage costs from the cost model) searched as the planner searches them: after the pass every
directed rank pair agrees on the order, and the schedule still passes ``validate`` (every action
present once, sends and receives with the right peers, no deadlock).
"""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from harness.schedule import Action, PipeSpec, Schedule, build, lower, validate
from harness.schedule.p2p_order import check_in_order, message_order, order_mismatches, order_receives
from harness.schedule.checks import ScheduleError

TABLE3 = (("33b", "13b", 8, 4), ("33b", "13b", 8, 8), ("65b", "33b", 16, 8), ("65b", "33b", 16, 16))
TABLE3_MICROBATCHES = (8, 16, 32, 64)


def _two_pipe(order: dict[int, list[str]]) -> Schedule:
    """Actor A on ranks 0 -> 1, critic C on ranks 1 -> 0, two micro-batches each."""
    pipes = {"A": PipeSpec("A", 2, 2, (0, 1), "actor"), "C": PipeSpec("C", 2, 2, (1, 0), "critic")}
    return Schedule(pipes, {r: [Action.parse(t) for t in acts] for r, acts in order.items()})


# Rank 0 sends to rank 1 the actor's activation 0, the critic's gradient 0, the actor's activation
# 1, the critic's gradient 1; rank 1 runs A1F1 before C0B0, so it consumes activation 1 before
# gradient 0: posting its receives in compute order would hand it the gradient as activation 1.
_MISMATCHED = _two_pipe({
    0: ["A0F0", "C1F0", "C1B0", "A0F1", "C1F1", "C1B1", "A0B0", "A0B1"],  # A stage 0, C stage 1
    1: ["C0F0", "A1F0", "C0F1", "A1F1", "C0B0", "A1B0", "A1B1", "C0B1"],  # C stage 0, A stage 1
})


def test_checker_names_the_pair_whose_ends_disagree():
    validate(lower(_MISMATCHED))  # a valid, deadlock-free schedule...
    problems = order_mismatches(_MISMATCHED)
    assert problems and all(p.startswith("ranks 0->1") for p in problems), problems  # ...wrong under NCCL
    with pytest.raises(ScheduleError, match="posting order"):
        check_in_order(_MISMATCHED)


def test_order_receives_fixes_it_and_keeps_sends_and_computes_in_place():
    fixed = order_receives(_MISMATCHED)
    check_in_order(fixed)
    validate(fixed)
    naive = lower(_MISMATCHED)
    for rank in naive.order:
        assert [a for a in fixed.order[rank] if a.kind[0] != "R"] == [a for a in naive.order[rank] if a.kind[0] != "R"]
        assert sorted(a for a in fixed.order[rank] if a.kind[0] == "R") == \
            sorted(a for a in naive.order[rank] if a.kind[0] == "R")
    sent, received = message_order(fixed)
    assert sent == received


@pytest.mark.parametrize("stages,mbs", [(2, 4), (4, 8), (8, 16)])
def test_plain_one_f_one_b_is_consistent_and_left_as_lowered(stages, mbs):
    schedule = build("1f1b", [PipeSpec("A", stages, mbs, tuple(range(stages)))])
    assert order_mismatches(schedule) == []
    assert order_receives(schedule).order == lower(schedule).order


@pytest.fixture(scope="module")
def table3_schedules():
    from harness.run.pipeline import compose
    from harness.run.pipeline import build_context
    from systems.rlhfuse.experiments import fused_layout_costs
    from systems.rlhfuse.intra import FusedSearchConfig, search_fused_schedule

    out = {}
    for actor, critic, pp_a, pp_c in TABLE3:
        ctx = build_context(OmegaConf.to_object(compose(["+system=rlhfuse", f"llama@model.actor={actor}",
                                                         f"llama@model.ref={actor}", f"llama@model.critic={critic}",
                                                         f"llama@model.reward={critic}"])))
        for m in TABLE3_MICROBATCHES:
            pipes, costs, _ = fused_layout_costs(ctx, actor, critic, pp_a, pp_c, m, 8)
            result = search_fused_schedule(pipes, costs, config=FusedSearchConfig(seed=0, max_steps=300))
            out[(actor, critic, pp_a, pp_c, m)] = result.schedule
    return out


def test_every_table3_shape_is_order_consistent_after_the_pass(table3_schedules):
    inconsistent_before = 0
    for key, schedule in table3_schedules.items():
        inconsistent_before += bool(order_mismatches(schedule))
        fixed = order_receives(schedule)
        check_in_order(fixed)  # every directed rank pair: receives in the sender's posting order
        validate(fixed)  # and still complete and deadlock-free
    # the searched schedules are what the pass is for: most are wrong under NCCL as lowered
    assert inconsistent_before >= len(table3_schedules) // 2, inconsistent_before
