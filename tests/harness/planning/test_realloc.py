"""Reallocation bytes against hand counts (fractions of one model's bytes)."""
import pytest

from harness.plan import Allocation, ParallelStrategy as S
from harness.planning.realloc import reallocation_transfers, total_bytes

LAYERS, LAYER_BYTES = 8, 1.0  # model = 8 bytes, so answers read as fractions x 8


def transfers(src, dst, gpus_per_node=8):
    return {t.device: t for t in reallocation_transfers(src, dst, LAYERS, LAYER_BYTES, gpus_per_node)}


def test_identical_layouts_move_nothing():
    a = Allocation(tuple(range(8)), S(dp=2, tp=2, pp=2))
    assert total_bytes(list(transfers(a, a).values())) == 0


def test_tp8_to_tp4_within_a_node():
    # tp8: device d holds columns [d/8, (d+1)/8). tp4 x dp2: device k*4+t needs columns [t/4, (t+1)/4).
    # device 0 needs [0, .25), holds [0, .125): receives 1/8 of the model = 1 byte.
    # device 5 (k=1, t=1) needs [.25, .5), holds [.625, .75): receives 1/4 = 2 bytes.
    src = Allocation(tuple(range(8)), S(dp=1, tp=8))
    dst = Allocation(tuple(range(8)), S(dp=2, tp=4))
    t = transfers(src, dst)
    assert t[0].bytes == pytest.approx(1.0)
    assert t[1].bytes == pytest.approx(2.0)  # needs [.25, .5), holds [.125, .25): no overlap
    assert t[5].bytes == pytest.approx(2.0)
    assert all(x.intra_node for x in t.values())


def test_pp2_to_pp1_across_nodes():
    # one GPU per node; pp2: device 0 holds layers 0-3, device 1 layers 4-7. pp1 x dp2: each needs all
    # 8 layers, holds 4: receives 4 bytes over the inter-node link.
    src = Allocation((0, 1), S(dp=1, pp=2))
    dst = Allocation((0, 1), S(dp=2, pp=1))
    t = transfers(src, dst, gpus_per_node=1)
    assert [t[0].bytes, t[1].bytes] == pytest.approx([4.0, 4.0])
    assert not t[0].intra_node and not t[1].intra_node


def test_zero3_gather_to_tp8():
    # ZeRO-3 over 8: each device holds 1/8 of every piece. tp8 needs 1/8 of the columns (1 byte),
    # of which it holds 1/8: receives 7/8 byte, inside the node.
    src = Allocation(tuple(range(8)), S(dp=8, zero_stage=3))
    dst = Allocation(tuple(range(8)), S(dp=1, tp=8))
    t = transfers(src, dst)
    assert all(x.bytes == pytest.approx(7 / 8) for x in t.values())
    assert all(x.intra_node for x in t.values())
    far = transfers(Allocation(tuple(range(16)), S(dp=16, zero_stage=3)),
                    Allocation(tuple(range(16)), S(dp=2, tp=8)))
    assert not far[0].intra_node
