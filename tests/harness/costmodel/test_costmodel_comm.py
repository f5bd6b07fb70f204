"""Alpha-beta collectives and link-tier selection."""
from __future__ import annotations

import pytest

from harness.core.config import LinkConfig
from harness.costmodel import allgather_s, allreduce_s, link_for_group, p2p_s, reduce_scatter_s

LINK = LinkConfig(bandwidth_gbps=100.0, latency_us=2.0, efficiency_frac=0.5)  # 50 GB/s achieved


def test_ring_closed_forms():
    b = 1e9
    assert allreduce_s(b, 4, LINK) == pytest.approx(6 * 2e-6 + 2 * 3 / 4 * b / 50e9)
    assert allgather_s(b, 4, LINK) == pytest.approx(3 * 2e-6 + 3 / 4 * b / 50e9)
    assert reduce_scatter_s(b, 4, LINK) == pytest.approx(3 * 2e-6 + 3 / 4 * b / 50e9)
    assert p2p_s(b, LINK) == pytest.approx(2e-6 + b / 50e9)


def test_allreduce_is_reduce_scatter_plus_allgather():
    for n in (2, 3, 8, 64):
        both = reduce_scatter_s(1e8, n, LINK) + allgather_s(1e8, n, LINK)
        assert allreduce_s(1e8, n, LINK) == pytest.approx(both)


def test_trivial_groups_are_free():
    assert allreduce_s(1e9, 1, LINK) == 0.0
    assert allgather_s(0, 8, LINK) == 0.0
    assert p2p_s(0, LINK) == 0.0


def test_link_for_group(testbed):
    assert link_for_group(testbed, range(8)) is testbed.intra_node
    assert link_for_group(testbed, [8, 15]) is testbed.intra_node
    assert link_for_group(testbed, [7, 8]) is testbed.inter_node
    assert link_for_group(testbed, [0, 8, 16, 24]) is testbed.inter_node
    with pytest.raises(ValueError, match="256"):
        link_for_group(testbed, [0, 256])


def test_cost_model_collectives_pick_the_tier(cost_model):
    assert cost_model.link_between(0, 7) == cost_model.intra_node
    assert cost_model.link_between(0, 8) == cost_model.inter_node
    intra = cost_model.allreduce_s(1e9, list(range(8)))
    inter = cost_model.allreduce_s(1e9, list(range(0, 64, 8)))
    assert intra == pytest.approx(allreduce_s(1e9, 8, cost_model.intra_node))
    assert inter == pytest.approx(allreduce_s(1e9, 8, cost_model.inter_node))
    assert inter > 10 * intra  # 25 GB/s NIC vs 450 GB/s NVLink
    assert cost_model.p2p_s(1e6, 3, 3) == 0.0
    assert cost_model.p2p_s(1e6, 0, 9) == pytest.approx(p2p_s(1e6, cost_model.inter_node))


def test_multi_node_collectives_use_one_ring_channel_per_nic(cost_model):
    """A group with g members on each node drives g NICs in parallel: bandwidth min(NVLink, g x NIC)."""
    nic = cost_model.inter_node.bandwidth_gbps * cost_model.inter_node.efficiency_frac
    nvlink = cost_model.intra_node.bandwidth_gbps * cost_model.intra_node.efficiency_frac
    one_per_node = cost_model.allgather_s(8e9, list(range(0, 256, 8)))
    full_nodes = cost_model.allgather_s(8e9, list(range(256)))
    assert one_per_node == pytest.approx(31 * 5e-6 + 31 / 32 * 8e9 / (nic * 1e9))
    assert full_nodes == pytest.approx(255 * 5e-6 + 255 / 256 * 8e9 / (min(nvlink, 8 * nic) * 1e9))
    assert full_nodes < one_per_node / 4
