"""The real backend's piece model (no Ray, no processes): slicing, reassembly, tensor-parallel
arithmetic in one process, and weight-movement plans against harness.planning.realloc's byte counts."""
from __future__ import annotations

import itertools

import pytest
import torch

from harness.backends.ray.driver.experience import minibatch_indices
from harness.real.parallel.layout import (assemble, build_local_module, coords, full_shapes, load_pieces, local_args,
                                         received_bytes, transfer_plan)
from harness.costmodel.llama import matmul_params_per_layer
from harness.core.plan import Allocation, ParallelStrategy
from harness.real.model import LlamaModel, ModelArgs, load_llama_config
from harness.planning.realloc import reallocation_transfers

ARGS = ModelArgs.from_llama_config(load_llama_config("tiny"))  # 4 heads, 2 kv heads, ffn 172, 2 layers
LAYOUTS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 2)]


def alloc(dp, tp, pp):
    return Allocation(tuple(range(dp * tp * pp)), ParallelStrategy(dp, tp, pp))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 2)])
def test_pieces_reassemble_to_the_full_model(tp, pp):
    full = LlamaModel(ARGS, seed=3).state_dict()
    pieces = {}
    for p, t in itertools.product(range(pp), range(tp)):
        with torch.device("meta"):
            module = build_local_module(ARGS, pp, p, tp)
        module.to_empty(device="cpu")
        load_pieces(module, full, ARGS, tp, t)
        pieces[(0, p, t)] = dict(module.state_dict())
    back = assemble(pieces, ARGS, pp, tp)
    assert set(back) == set(full)
    for name in full:
        assert torch.equal(back[name], full[name]), name


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_split_sums_to_the_full_layer(tp):
    """Column/row-parallel attention and MLP: the sum of the ranks' partial outputs (the all-reduce)
    equals the unsplit layer, including kv heads shared by several ranks (tp=4 > 2 kv heads)."""
    torch.manual_seed(0)
    full = LlamaModel(ARGS, seed=5).state_dict()
    x = torch.randn(2, 7, ARGS.hidden_size)
    pos = torch.arange(7).expand(2, 7)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    whole = build_local_module(ARGS, 1, 0, 1)
    load_pieces(whole, full, ARGS, 1, 0)
    layer = whole.layers["0"]
    ref_attn = layer.attn(x, pos, mask, None, None)
    ref_mlp = layer.mlp(x)
    attn = mlp = 0
    for t in range(tp):
        part = build_local_module(ARGS, 1, 0, tp)
        load_pieces(part, full, ARGS, tp, t)
        attn = attn + part.layers["0"].attn(x, pos, mask, None, None)
        mlp = mlp + part.layers["0"].mlp(x)
    assert local_args(ARGS, tp).num_heads == ARGS.num_heads // tp
    torch.testing.assert_close(attn, ref_attn, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mlp, ref_mlp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("src,dst", [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b and a[2] <= 2 and b[2] <= 2
                                     and 4 in (a[0] * a[1] * a[2], b[0] * b[1] * b[2])])
def test_transfer_plan_matches_realloc(src, dst):
    """Receivers are those harness.planning.realloc charges; layer matmul bytes agree exactly where kv heads
    are not replicated (tp <= num_kv_heads)."""
    source, target = alloc(*src), alloc(*dst)
    plan = transfer_plan(ARGS, source, target)
    shapes = full_shapes(ARGS)
    # every target device gets exactly its pieces, each element once
    covered: dict[tuple[int, str], int] = {}
    for tr in plan:
        covered[(tr.dst, tr.name)] = covered.get((tr.dst, tr.name), 0) + tr.numel(shapes[tr.name])
    for dev, (k, p, t) in coords(target).items():
        with torch.device("meta"):
            want = {n: q.numel() for n, q in build_local_module(ARGS, dst[2], p, dst[1]).named_parameters()}
        assert {n: covered[(dev, n)] for n in want} == want
    layer_bytes = matmul_params_per_layer(load_llama_config("tiny")) * 4
    expected = {t.device: t.bytes for t in reallocation_transfers(source, target, ARGS.num_layers, layer_bytes, 8)}
    got = received_bytes(plan, ARGS)
    assert {d for d, b in got.items() if b > 0} <= {d for d, b in expected.items() if b > 0} | \
        {d for d in target.mesh if d not in source.mesh}
    if src[1] <= ARGS.num_kv_heads and dst[1] <= ARGS.num_kv_heads:
        matmul = ("attn.w", "mlp.w")
        layer_only = {}
        for tr in plan:
            if tr.src != tr.dst and tr.name.startswith("layers.") and any(m in tr.name for m in matmul):
                layer_only[tr.dst] = layer_only.get(tr.dst, 0) + tr.numel(shapes[tr.name]) * 4
        for dev, b in expected.items():
            assert layer_only.get(dev, 0) == pytest.approx(b), dev


def test_minibatches_partition_the_batch_the_same_way_for_everyone():
    a = minibatch_indices(8, 4, seed=0, iteration=1)
    b = minibatch_indices(8, 4, seed=0, iteration=1)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert sorted(sum((x.tolist() for x in a), [])) == list(range(8))
