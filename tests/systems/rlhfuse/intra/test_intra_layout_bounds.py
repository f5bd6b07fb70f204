"""Fused layout, per-stage costs, the serial baseline and the lower bound (RLHFuse section 5)."""
import pytest

from harness.schedule import PipeCosts, PipeSpec, simulate, validate
from systems.rlhfuse.intra import (fused_costs, fused_pipes, lower_bound, lower_bound_terms,
                                   pipe_names, serial_schedule)


def test_layout_one_actor_pipe_two_critic_pipes_in_reverse():
    pipes = fused_pipes(16, 8, 4, 6)
    assert list(pipes) == ["A", "Ca", "Cb"]
    assert pipes["A"].stage_to_rank == tuple(range(16))
    assert pipes["Ca"].stage_to_rank == tuple(range(15, 7, -1))
    assert pipes["Cb"].stage_to_rank == tuple(range(7, -1, -1))
    assert [p.num_mbs for p in pipes.values()] == [4, 6, 6]
    assert [p.model for p in pipes.values()] == ["actor", "critic", "critic"]


@pytest.mark.parametrize("n1,n2", [(2, 2), (4, 2), (2, 4), (3, 2), (6, 4), (1, 3)])
def test_every_rank_holds_one_stage_of_each_model(n1, n2):
    pipes = fused_pipes(n1, n2, 2, 3, "model1", "model2")
    for model in ("model1", "model2"):
        ranks = [r for p in pipes.values() if p.model == model for r in p.stage_to_rank]
        assert sorted(ranks) == list(range(max(ranks) + 1))
    assert all(name.isalpha() for name in pipes)


def test_pipe_names_are_letters():
    assert pipe_names("A", 1) == ["A"]
    assert pipe_names("C", 3) == ["Ca", "Cb", "Cc"]
    assert pipe_names("A", 28)[-2:] == ["Aaa", "Aab"]


@pytest.mark.parametrize("bad", [dict(n1=0), dict(m2=0), dict(n2=-1), dict(m1=1.5)])
def test_layout_rejects_bad_counts(bad):
    args = dict(n1=2, n2=2, m1=1, m2=1) | bad
    with pytest.raises(ValueError):
        fused_pipes(**args)


def test_costs_uniform_per_stage_and_default_backward():
    pipes = fused_pipes(4, 2, 2, 2)
    costs = fused_costs(pipes, 1.0, (0.5, 0.25), mem1=2.0, mem2=(1.0, 3.0), p2p=0.1)
    assert costs["A"] == PipeCosts((1.0,) * 4, (2.0,) * 4, (2.0,) * 4, 0.1)
    assert costs["Ca"].fwd == (0.5, 0.25) and costs["Ca"].bwd == (1.0, 0.5)
    assert costs["Cb"].activation == (1.0, 3.0)
    with pytest.raises(ValueError, match="2 per-stage"):
        fused_costs(pipes, 1.0, (1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="> 0"):
        fused_costs(pipes, 0.0, 1.0)


def test_serial_is_model1_then_model2_1f1b():
    pipes = fused_pipes(2, 2, 2, 2)
    serial = serial_schedule(pipes)
    validate(serial)
    assert [a.token() for a in serial.order[0]] == [
        "A0F0", "A0F1", "A0B0", "A0B1", "C1F0", "C1B0", "C1F1", "C1B1"]
    # actor 1F1B alone ends at (M + P - 1)(F + B) = 9 on rank 0 but at 7 on rank 1, where the
    # critic's stage 0 starts: C0F0 [7,8], C0F1 [8,9]; rank 0: C1F0 [9,10], C1B0 [10,12],
    # C1F1 [12,13], C1B1 [13,15]; rank 1: C0B0 [12,14], C0B1 [15,17].
    assert simulate(serial, fused_costs(pipes, 1, 1)).makespan == 17


def test_lower_bound_hand_case():
    """4 + 2 stages, M = (2, 3), actor F=1 B=2, critic F=2 B=4 (``fused_costs`` defaults B=2F).

    Ranks 0..3 hold actor stages 0..3 and critic pipes ``Ca`` on ranks (3, 2), ``Cb`` on (1, 0).
    - (a) actor last stage: head 3 + 2 * 3 + tail 6 = 15; critic last stage: head 2 + 3 * 6 +
      tail 4 = 24 -> model term 24.
    - work per rank: actor 2 * 3 = 6, critic 3 * 6 = 18 -> 24 each; (b) = (c) = 24.
    - (d) rank 0: actor stage 0 (head 0, tail 0), Cb stage 1 (head 2, tail 4): 0 + 24 + 0 = 24;
      rank 1: actor stage 1 (head 1, tail 2), Cb stage 0 (head 0, tail 0): 0 + 24 + 0 = 24;
      rank 2: actor stage 2 (head 2, tail 4), Ca stage 1 (head 2, tail 4): 2 + 24 + 4 = 30;
      rank 3: actor stage 3 (head 3, tail 6), Ca stage 0 (0, 0): 24. -> 30.
    """
    pipes = fused_pipes(4, 2, 2, 3)
    costs = fused_costs(pipes, 1.0, 2.0)
    lb = lower_bound_terms(pipes, costs)
    assert lb.per_model == {"actor": 15.0, "critic": 24.0}
    assert (lb.model, lb.average, lb.rank_work) == (24.0, 24.0, 24.0)
    assert lb.per_rank_window == {0: 24.0, 1: 24.0, 2: 30.0, 3: 24.0}
    assert lb.value == lower_bound(pipes, costs) == 30.0


def test_lower_bound_counts_p2p_on_rank_changes():
    pipe = PipeSpec("A", 3, 2, (0, 1, 1))
    costs = {"A": PipeCosts.uniform(3, 1.0, 2.0, p2p=0.5)}
    # stage 2: head = F0 + F1 + one rank change = 2.5, tail = 4.5, work 6 -> 13
    assert lower_bound_terms({"A": pipe}, costs).per_model == {"": 13.0}


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_model_term_is_1f1b_makespan_for_uniform_costs(p, m):
    pipes = fused_pipes(p, p, m, m)
    costs = fused_costs(pipes, 1.0, 1.0)
    assert lower_bound_terms(pipes, costs).model == (m + p - 1) * 3.0


@pytest.mark.parametrize("n1,n2", [(2, 2), (4, 2), (4, 4), (8, 4), (3, 2)])
@pytest.mark.parametrize("m1,m2", [(1, 1), (2, 4), (8, 3)])
def test_lower_bound_below_serial(n1, n2, m1, m2):
    pipes = fused_pipes(n1, n2, m1, m2)
    for f1, f2, p2p in ((1.0, 1.0, 0.0), (2.0, 0.5, 0.1)):
        costs = fused_costs(pipes, f1, f2, p2p=p2p)
        assert lower_bound(pipes, costs) <= simulate(serial_schedule(pipes), costs).makespan + 1e-9
