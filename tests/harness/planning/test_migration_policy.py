"""Long-tail migration's decisions (harness/planning/taskmodels/migration.py), shared by the
simulator and backend=ray: hand-worked cases."""
from harness.planning.taskmodels.migration import destination, due, tail_instances, threshold


def test_threshold_and_when_it_is_due():
    assert threshold(0.25, 16) == 4 and threshold(0.2, 16) == 4 and threshold(0.0, 16) == 0
    assert [due(n, 4) for n in (0, 1, 3, 4, 5)] == [False, True, True, False, False]


def test_tails_hold_the_most_unfinished_ties_to_the_lower_index():
    assert tail_instances({0: 1, 1: 3, 2: 3, 3: 0}, 1) == ([1], [2, 0, 3])
    assert tail_instances({0: 1, 1: 3, 2: 3, 3: 0}, 2) == ([1, 2], [0, 3])
    # never an instance without work as a tail, but always one tail
    assert tail_instances({0: 0, 1: 2, 2: 0}, 2) == ([1], [0, 2])
    assert tail_instances({0: 0, 1: 0}, 0) == ([0], [1])


def test_samples_spread_round_robin_over_the_tails():
    tails = [1, 2]
    assert [destination(tails, 0, j) for j in range(4)] == [1, 2, 1, 2]
    assert [destination(tails, 3, j) for j in range(3)] == [2, 1, 2]
