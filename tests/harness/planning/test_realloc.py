"""Reallocation bytes against hand counts (fractions of one model's bytes)."""
import pytest

from harness.core.plan import Allocation, ParallelStrategy as S
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


def _per_device_oracle(source, target, num_layers, layer_bytes, gpus_per_node):
    """What each target device receives, counted device by device from the definition: the piece
    it needs, minus what it holds itself, and whether its node holds all of the piece."""
    def piece(alloc, coord):
        _, p, t = coord
        per = num_layers / alloc.strategy.pp
        return (p * per, (p + 1) * per), (t / alloc.strategy.tp, (t + 1) / alloc.strategy.tp)

    def overlap(a, b):
        return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))

    def coords(alloc):
        s = alloc.strategy
        return {alloc.device(k, p, t): (k, p, t) for k in range(s.dp) for p in range(s.pp) for t in range(s.tp)}

    src = coords(source)
    shard = 1.0 / source.strategy.dp if source.strategy.zero_stage == 3 else 1.0
    out = []
    for dev, coord in coords(target).items():
        layers, cols = piece(target, coord)
        need = (layers[1] - layers[0]) * (cols[1] - cols[0])
        held = 0.0
        if dev in src:
            s_layers, s_cols = piece(source, src[dev])
            held = overlap(layers, s_layers) * overlap(cols, s_cols) * shard
        on_node = {(p, t) for d, (_, p, t) in src.items() if d // gpus_per_node == dev // gpus_per_node}
        covered = sum(overlap(layers, l) * overlap(cols, c) for l, c in (piece(source, (0, p, t)) for p, t in on_node))
        if source.strategy.zero_stage == 3:
            intra = all(d // gpus_per_node == dev // gpus_per_node for d in source.mesh)
        else:
            intra = covered >= need - 1e-9
        out.append((dev, max(0.0, need - held) * layer_bytes, intra))
    return out


def test_transfers_equal_a_per_device_count_on_random_layouts():
    """The per-(node, piece) bookkeeping gives each device's bytes and tier as counted one by one."""
    import random

    from harness.planning.strategies import mesh_options, strategy_options

    rng = random.Random(0)
    for num_nodes, per_node, layers in [(4, 8, 24), (3, 4, 7), (2, 8, 40)]:
        meshes = mesh_options(num_nodes, per_node)
        for _ in range(150):
            a, b = rng.choice(meshes), rng.choice(meshes)
            sa = rng.choice(strategy_options(len(a), per_node, layers, False, 64, 1, 0))
            sb = rng.choice(strategy_options(len(b), per_node, layers, False, 64, 1, 0))
            source = Allocation(a, S(sa.dp, sa.tp, sa.pp, rng.choice([0, 1, 3])))
            target = Allocation(b, sb)
            got = [(t.device, t.bytes, t.intra_node)
                   for t in reallocation_transfers(source, target, layers, 1e6, per_node)]
            expected = _per_device_oracle(source, target, layers, 1e6, per_node)
            assert [(d, pytest.approx(x, rel=1e-12, abs=1e-6), i) for d, x, i in expected] == got
