"""Precision and memory of the real backend's replicas, in one process (no Ray, no GPU):

- sharded initialisation: every (pp stage, tp slice) materialised from the seed alone equals the
  same slice of the whole seeded model, in float32 and bf16, and so does native ZeRO-3's flat shard;
- memory: building a tp=2 / pp=2 piece allocates its own parameters and at most one seeded block
  beyond them (live tensor bytes tracked by a dispatch mode), never the full model;
- mixed precision: bf16 parameters, float32 master weights and Adam states, float32 gradients,
  updates below bf16's resolution accumulate in the master; bf16 training of a small model follows
  the float32 run closely;
- offloading: an offloaded replica's weights are swapped around each use;
- typed options (dtype, generation engine, address) and the vLLM engine's layout limits.

CUDA is not exercised here (no GPU in CI): on CUDA the same code runs with ``device=cuda`` and the
allocator's peak (``torch.cuda.max_memory_allocated``) is reported instead of the CPU's RSS.
"""
from __future__ import annotations

import itertools
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.real.parallel.comm import Groups
from harness.backends.ray.config import RayOptions, check_address
from harness.real.parallel.layout import (build_local_module, flat_init_shard, full_shapes, init_local_module, load_pieces,
                                         param_bytes)
from harness.real.parallel.optim import FlatAdam
from harness.backends.ray.driver.options import engine_unsupported
from harness.real.parallel.replica import LocalReplica, NativeZero3Replica
from harness.errors import ConfigError
from harness.core.plan import Allocation, ParallelStrategy
from harness.real.model import INIT_BLOCK_NUMEL, LlamaModel, ModelArgs, init_values, load_llama_config

TINY = ModelArgs.from_llama_config(load_llama_config("tiny"))
# big enough that parameters span several seeded blocks (wq: 512 x 512 = 4 blocks of 128 rows)
MID = ModelArgs(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4, ffn_hidden_size=1024, vocab_size=2048,
                max_seq_len=64)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensors alive at once among those created inside the mode (each storage
    counted once, released when the tensor that created it is collected)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key, storage.nbytes())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp,pp", [(2, 2), (2, 1), (1, 2), (4, 1)])
def test_sharded_init_equals_full_model_sliced(tp, pp, dtype):
    full = LlamaModel(TINY, seed=11).state_dict()
    for p, t in itertools.product(range(pp), range(tp)):
        piece = init_local_module(TINY, pp, p, tp, t, seed=11, dtype=dtype)
        ref = build_local_module(TINY, pp, p, tp)
        load_pieces(ref, full, TINY, tp, t)
        for (name, a), (_, b) in zip(piece.state_dict().items(), ref.state_dict().items()):
            assert a.dtype == dtype
            assert torch.equal(a, b.to(dtype)), name


def test_init_values_slices_equal_the_whole_parameter():
    shape = (300, 700)  # rows per block: 65536 // 700 = 93, so slices straddle blocks
    whole = init_values("layers.0.mlp.w_up.weight", shape, 5)
    assert whole.std().item() == pytest.approx(0.02, rel=0.05)
    for rows, cols in [((0, 300), None), ((90, 190), None), ((299, 300), None), (None, (350, 700)), ((7, 8), (1, 2))]:
        part = init_values("layers.0.mlp.w_up.weight", shape, 5, rows, cols)
        r0, r1 = rows or (0, 300)
        c0, c1 = cols or (0, 700)
        assert torch.equal(part, whole[r0:r1, c0:c1])
    assert torch.equal(init_values("layers.1.attn_norm.weight", (8,), 5), torch.ones(8))
    assert not torch.equal(init_values("a.weight", (4, 4), 5), init_values("b.weight", (4, 4), 5))


def test_native_zero3_flat_shard_equals_full_model():
    full = LlamaModel(TINY, seed=2).state_dict()
    flat = torch.cat([full[n].reshape(-1) for n in sorted(full)])
    n = flat.numel()
    for lo, hi in [(0, 1000), (1000, n // 2), (n // 2, n), (n - 5, n + 3)]:
        shard = flat_init_shard(TINY, 2, lo, hi)
        assert torch.equal(shard[:max(0, min(hi, n) - lo)], flat[lo:min(hi, n)])
        assert torch.all(shard[max(0, n - lo):] == 0)  # padding


@pytest.mark.parametrize("tp,pp", [(2, 2), (2, 1), (1, 2)])
def test_a_piece_never_materialises_more_than_itself(tp, pp):
    """Peak live bytes while building each piece of a tp x pp layout: the piece's own parameter
    bytes plus at most one slice and one seeded block in flight, and well under the full model."""
    full_bytes = sum(torch.Size(s).numel() * 4 for s in full_shapes(MID).values())
    for p, t in itertools.product(range(pp), range(tp)):
        with LiveBytes() as mode:
            piece = init_local_module(MID, pp, p, tp, t, seed=1)
        own = param_bytes(piece)
        largest = max(q.numel() for q in piece.parameters()) * 4
        assert own == sum(q.numel() * q.element_size() for q in piece.parameters())
        assert mode.peak <= own + largest + INIT_BLOCK_NUMEL * 4, (p, t, mode.peak, own)
        assert mode.peak < 0.75 * full_bytes, (p, t, mode.peak, full_bytes)
    # the pieces of one replica add up to the whole model, replicated tensors once per tp rank
    total = sum(param_bytes(init_local_module(MID, pp, p, tp, t)) for p in range(pp) for t in range(tp))
    assert total >= full_bytes


def _replica(cls, strategy=(1, 1, 1), zero=0, **kw):
    alloc = Allocation((0,), ParallelStrategy(*strategy, zero_stage=zero))
    groups = Groups(0, 1, [])
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return cls("actor", TINY, alloc, 0, groups, torch.device("cpu"), None, hp, **kw)


def test_native_zero3_starts_from_its_shard_only():
    r = _replica(NativeZero3Replica, zero=3, seed=4, dtype=torch.bfloat16)
    assert r.materialised_bytes == 0 and all(p.numel() == 0 for p in r.module.parameters())
    with r.compute():
        got = {n: p.detach().clone() for n, p in r.module.named_parameters()}
    full = LlamaModel(TINY, seed=4).state_dict()
    assert all(torch.equal(got[n], full[n].to(torch.bfloat16)) for n in full)
    assert all(p.numel() == 0 for p in r.module.parameters())  # released after the use
    assert r.opt.master.dtype == torch.float32


def test_mixed_precision_master_weights_and_states_are_fp32():
    r = _replica(LocalReplica, seed=3, dtype=torch.bfloat16)
    assert {p.dtype for p in r.module.parameters()} == {torch.bfloat16}
    assert r.opt.master.dtype == torch.float32
    x = torch.randint(0, TINY.vocab_size, (2, 9))
    r.set_train(True)
    out = r(x)
    assert out.dtype == torch.bfloat16  # activations in bf16
    out.float().logsumexp(-1).mean().backward()
    assert {p.grad.dtype for p in r.module.parameters()} == {torch.bfloat16}
    assert r.opt.flat_grads().dtype == torch.float32
    r.optimizer_step()
    states = next(iter(r.opt.opt.state.values()))
    assert states["exp_avg"].dtype == torch.float32 and states["exp_avg_sq"].dtype == torch.float32
    flat = r.opt.flat_params()  # the module's bf16 weights are the rounded master
    assert torch.equal(flat[:r.opt.numel], r.opt.master.detach()[:r.opt.numel].to(torch.bfloat16).float())
    assert r.state_bytes() == param_bytes(r.module) + r.opt.state_bytes()
    assert r.opt.state_bytes() == 3 * r.opt.master.numel() * 4  # master + two Adam moments


def test_updates_below_bf16_resolution_accumulate_in_the_master():
    r = _replica(LocalReplica, seed=3, dtype=torch.bfloat16)
    before_module = r.opt.flat_params().clone()
    before_master = r.opt.master.detach().clone()
    for g in r.module.parameters():
        g.grad = torch.ones_like(g)
    r.opt.opt.param_groups[0]["lr"] = 1e-7  # Adam's first step moves each weight by ~lr
    r.optimizer_step()
    n = r.opt.numel
    moved = (r.opt.master.detach() - before_master).abs()[:n]
    assert moved.min() > 0  # every float32 master weight moved ...
    same = (r.opt.flat_params() == before_module)[:n].float().mean()
    assert same > 0.99  # ... while bf16 resolves the move only for weights within ~1e-5 of zero


def test_bf16_training_follows_fp32():
    """A few Adam steps of the same model in fp32 and in bf16 (fp32 master): the weights stay within
    bf16's rounding of each other, far below the size of the update."""
    torch.manual_seed(0)
    x = torch.randint(0, TINY.vocab_size, (4, 12))
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        r = _replica(LocalReplica, seed=3, dtype=dtype)
        start = r.opt.master.detach().clone()
        r.set_train(True)
        for _ in range(3):
            out = r(x)
            loss = torch.nn.functional.cross_entropy(out[:, :-1].float().reshape(-1, TINY.vocab_size),
                                                     x[:, 1:].reshape(-1))
            loss.backward()
            r.optimizer_step()
        runs[dtype] = (r.opt.master.detach().clone(), start)
    (m32, s32), (m16, s16) = runs[torch.float32], runs[torch.bfloat16]
    update = (m32 - s32).norm()
    assert update > 0
    assert (m16 - m32).norm() < 0.2 * update


def test_offloaded_replica_swaps_weights_around_each_use(monkeypatch):
    r = _replica(LocalReplica, seed=1, offloaded=True)
    assert r.swaps == 0  # on a CPU device there is nothing to move
    monkeypatch.setattr(LocalReplica, "_swaps", property(lambda self: self.offloaded))
    with r.compute():
        pass
    assert r.swaps == 2  # onload before the use, offload after
    r.offloaded = False
    with r.compute():
        pass
    assert r.swaps == 2


def test_dtype_engine_and_address_options():
    assert RayOptions().resolved_dtype("cpu") == "fp32" and RayOptions().resolved_dtype("cuda") == "bf16"
    assert RayOptions(dtype="bf16").resolved_dtype("cpu") == "bf16"
    assert RayOptions.from_config({"vllm": {"gpu_memory_utilization": 0.2}}).vllm.gpu_memory_utilization == 0.2
    for bad in ({"dtype": "fp16"}, {"generation_engine": "sglang"}, {"vllm": {"tp": 2}}):
        with pytest.raises(ConfigError):
            RayOptions.from_config(bad)
    assert check_address(None) is None and check_address("auto") == "auto"
    assert check_address("10.0.0.1:6379") == "10.0.0.1:6379" and check_address("ray://h:10001") == "ray://h:10001"
    with pytest.raises(ConfigError, match="backend.address"):
        check_address("somewhere")


def test_vllm_engine_layout_limits():
    from harness.core.plan import GenerationPolicy, MigrationPolicy, Plan, Task, TaskKind

    gen = Task("gen", TaskKind.GENERATE, "actor", Allocation((0, 1), ParallelStrategy(1, 2, 1)),
               reads=("prompts",), writes=("responses",))
    plan = Plan("x", [gen])
    args = {"actor": TINY}
    assert engine_unsupported(plan, args, "ours") == []
    problems = engine_unsupported(plan, args, "vllm")
    assert any("tp=2" in p for p in problems) and any("head dimension is 16" in p for p in problems)
    plan.generation = GenerationPolicy(migration=MigrationPolicy(threshold_frac=0.1, num_tail_instances=1))
    assert any("transfer=kv" in p for p in engine_unsupported(plan, args, "vllm"))


def test_an_offloaded_trained_replica_trains_as_a_resident_one(monkeypatch):
    """A trained replica kept in host memory between uses (NeMo-RL's colocated policy) moves its
    weights and its optimizer's master and Adam states out after each use and back before the
    next, and its steps give the weights a resident replica's steps give, bit for bit (the swaps
    forced on, as on a GPU: on a CPU device there is nothing to move)."""
    monkeypatch.setattr(LocalReplica, "_swaps", property(lambda self: self.offloaded))
    torch.manual_seed(0)
    x = torch.randint(0, TINY.vocab_size, (4, 12))
    masters = []
    for offloaded in (False, True):
        r = _replica(LocalReplica, seed=3, offloaded=offloaded)
        r.set_train(True)
        for _ in range(2):
            with r.compute():
                out = r(x)
                loss = torch.nn.functional.cross_entropy(out[:, :-1].float().reshape(-1, TINY.vocab_size),
                                                         x[:, 1:].reshape(-1))
                loss.backward()
                r.optimizer_step()
        masters.append(r.opt.master.detach().clone())
        assert r.swaps == (5 if offloaded else 0)  # out at construction, then in and out around each use
        assert bool(r.opt.opt.state) and r.opt.device == torch.device("cpu")
    assert torch.equal(masters[0], masters[1])
