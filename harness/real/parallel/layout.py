"""Where each parameter of a LLaMA model lives in a (dp, tp, pp) layout, and how pieces move.

The piece model is the one :mod:`harness.planning.realloc` costs: a device at ``(dp k, pp p, tp t)`` holds
the layers of pipeline stage ``p`` (``harness.real.model.split_layers``; the embedding on the first
stage, final norm and head on the last) and slice ``t`` of ``tp`` of each tensor-parallel matrix.
Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, section 3): the query/key/value and
the SwiGLU gate/up projections are split by output rows (column-parallel), the attention output and
down projections by input columns (row-parallel); norms, the embedding and the head are
replicated. Grouped-query attention keeps each rank's query heads with the key/value heads they
read: with ``tp <= num_kv_heads`` the kv heads split evenly, with ``tp > num_kv_heads`` each kv
head is replicated on the ``tp / num_kv_heads`` ranks that share it (as Megatron-LM does).

Everything here is pure (no communication): a worker builds its local module with
:func:`build_local_module` on the meta device and materialises only its own piece, either from the
seeded initial values (:func:`init_local_module`, which computes just the slices it holds, so a
worker never holds the full model) or from a full state dict (:func:`local_piece`); a driver puts
pieces back together with :func:`assemble`, and :func:`transfer_plan` lists the slices each device
must receive when weights change layout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from harness.errors import PlanError
from harness.core.plan import Allocation
from harness.real.model import (DecoderLayer, ModelArgs, PipelineStage, RMSNorm, init_values, split_layers,
                                 token_embedding)

COLUMN_PARALLEL = ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "mlp.w_gate.weight", "mlp.w_up.weight")
ROW_PARALLEL = ("attn.wo.weight", "mlp.w_down.weight")

Coord = tuple[int, int, int]  # (dp rank, pp rank, tp rank)


def check_tp(args: ModelArgs, tp: int, what: str) -> None:
    """Raise PlanError unless heads, kv heads and the MLP split evenly over ``tp`` ranks."""
    h, kv, f = args.num_heads, args.num_kv_heads, args.ffn_hidden_size
    ok = h % tp == 0 and f % tp == 0 and (kv % tp == 0 or tp % kv == 0)
    if not ok:
        raise PlanError(f"{what}: tp={tp} does not split the model evenly (num_heads={h}, num_kv_heads={kv}, "
                        f"ffn_hidden_size={f}); backend=ray needs tp to divide heads and the MLP, and tp and "
                        f"num_kv_heads to divide one another")


def local_args(args: ModelArgs, tp: int) -> ModelArgs:
    """The dimensions one tensor-parallel rank computes with."""
    if tp == 1:
        return args
    return dataclasses.replace(args, num_heads=args.num_heads // tp, num_kv_heads=max(1, args.num_kv_heads // tp),
                               ffn_hidden_size=args.ffn_hidden_size // tp, head_dim=args.dim_per_head)


def head_ranges(args: ModelArgs, tp: int, t: int) -> tuple[int, int, int, int]:
    """Query heads ``[q0, q1)`` and kv heads ``[k0, k1)`` of tp rank ``t``."""
    per_rank = args.num_heads // tp
    q0, q1 = t * per_rank, (t + 1) * per_rank
    rep = args.num_heads // args.num_kv_heads
    return q0, q1, q0 // rep, (q1 - 1) // rep + 1


def tp_slice(name: str, args: ModelArgs, tp: int, t: int) -> tuple[int, int, int] | None:
    """``(dim, start, end)`` of tensor ``name`` held by tp rank ``t``; None when replicated."""
    if tp == 1:
        return None
    d = args.dim_per_head
    q0, q1, k0, k1 = head_ranges(args, tp, t)
    f = args.ffn_hidden_size // tp
    if name.endswith("attn.wq.weight"):
        return 0, q0 * d, q1 * d
    if name.endswith(("attn.wk.weight", "attn.wv.weight")):
        return 0, k0 * d, k1 * d
    if name.endswith("attn.wo.weight"):
        return 1, q0 * d, q1 * d
    if name.endswith(("mlp.w_gate.weight", "mlp.w_up.weight")):
        return 0, t * f, (t + 1) * f
    if name.endswith("mlp.w_down.weight"):
        return 1, t * f, (t + 1) * f
    return None


def is_shared_kv(name: str, args: ModelArgs, tp: int) -> bool:
    """Key/value weights replicated over several tp ranks (tp > num_kv_heads): their gradients
    must be summed over the ranks sharing them."""
    return tp > args.num_kv_heads and name.endswith(("attn.wk.weight", "attn.wv.weight"))


def stage_of(name: str, num_layers: int, pp: int) -> int:
    if name.startswith("embed."):
        return 0
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        for p, (lo, hi) in enumerate(split_layers(num_layers, pp)):
            if lo <= layer < hi:
                return p
    return pp - 1  # final norm and head


def full_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the whole model (no allocation)."""
    with torch.device("meta"):
        stage = build_local_module(args, 1, 0, 1)
    return {n: tuple(p.shape) for n, p in stage.named_parameters()}


def build_local_module(args: ModelArgs, pp: int, p: int, tp: int) -> PipelineStage:
    """The (uninitialised) module of pipeline stage ``p`` with tp-local dimensions."""
    largs = local_args(args, tp)
    lo, hi = split_layers(args.num_layers, pp)[p]
    first, last = p == 0, p == pp - 1
    embed = token_embedding(args.vocab_size, args.hidden_size) if first else None
    layers = {str(i): DecoderLayer(largs, i) for i in range(lo, hi)}
    norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if last else None
    head = nn.Linear(args.hidden_size, 1 if args.value_head else args.vocab_size, bias=False) if last else None
    return PipelineStage(largs, lo, hi, embed, layers, norm, head)


def local_piece(full: Tensor, name: str, args: ModelArgs, tp: int, t: int) -> Tensor:
    sl = tp_slice(name, args, tp, t)
    if sl is None:
        return full
    dim, start, end = sl
    return full.narrow(dim, start, end - start)


def load_pieces(module: nn.Module, full_state: dict[str, Tensor], args: ModelArgs, tp: int, t: int) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(local_piece(full_state[name], name, args, tp, t))


def piece_ranges(name: str, args: ModelArgs, tp: int, t: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """``(rows, cols)`` of the full tensor ``name`` that tp rank ``t`` holds (None: all of that dim)."""
    sl = tp_slice(name, args, tp, t)
    if sl is None:
        return None, None
    dim, start, end = sl
    return ((start, end), None) if dim == 0 else (None, (start, end))


def init_pieces(module: nn.Module, args: ModelArgs, tp: int, t: int, seed: int) -> None:
    """Fill a local module (materialised, any dtype/device) with its slices of the seeded initial
    weights (:func:`harness.real.model.init_values`): equal to :func:`load_pieces` from
    ``LlamaModel(args, seed=seed).state_dict()``, without building that full model."""
    shapes = full_shapes(args)
    with torch.no_grad():
        for name, p in module.named_parameters():
            rows, cols = piece_ranges(name, args, tp, t)
            p.copy_(init_values(name, shapes[name], seed, rows, cols))


def init_local_module(args: ModelArgs, pp: int, p: int, tp: int, t: int, *, device="cpu",
                      dtype: torch.dtype = torch.float32, seed: int | None = None,
                      full_state: dict[str, Tensor] | None = None) -> PipelineStage:
    """Stage ``p``, tp slice ``t`` of a model, built on the meta device and materialised on
    ``device`` in ``dtype`` (only this piece is ever allocated), filled from ``full_state`` when
    given, else from the seeded initial weights when ``seed`` is given, else left uninitialised."""
    with torch.device("meta"):
        module = build_local_module(args, pp, p, tp)
    module.to(dtype=dtype)  # on meta: no memory
    module.to_empty(device=device)
    if full_state is not None:
        load_pieces(module, full_state, args, tp, t)
    elif seed is not None:
        init_pieces(module, args, tp, t, seed)
    return module


def flat_init_shard(args: ModelArgs, seed: int, lo: int, hi: int) -> Tensor:
    """Elements ``[lo, hi)`` (float32) of the whole model's flat parameter vector in parameter-name
    order (the order of :class:`harness.real.parallel.optim.FlatAdam`), from the seeded initial
    weights; past the last parameter (padding) zeros. Materialises only the rows it needs."""
    out = torch.zeros(max(hi - lo, 0))
    offset = 0
    for name, shape in sorted(full_shapes(args).items()):
        n = 1
        for size in shape:
            n *= size
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            row = n // shape[0]
            r0, r1 = (a - offset) // row, -(-(b - offset) // row)
            values = init_values(name, shape, seed, (r0, r1)).reshape(-1)
            start = offset + r0 * row
            out[a - lo:b - lo] = values[a - start:b - start]
        offset += n
    return out


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters materialised in ``module`` (meta and released tensors count 0)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)


def assemble(pieces: dict[Coord, dict[str, Tensor]], args: ModelArgs, pp: int, tp: int) -> dict[str, Tensor]:
    """Full state dict from the pieces of one replica: ``{(k, p, t): local state dict}``."""
    shapes = full_shapes(args)
    out: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        p = stage_of(name, args.num_layers, pp)
        full = torch.zeros(shape)
        for (_, pp_rank, t), state in pieces.items():
            if pp_rank != p or name not in state:
                continue
            sl = tp_slice(name, args, tp, t)
            if sl is None:
                full.copy_(state[name])
            else:
                dim, start, end = sl
                full.narrow(dim, start, end - start).copy_(state[name])
        out[name] = full
    return out


def coords(alloc: Allocation) -> dict[int, Coord]:
    s = alloc.strategy
    return {alloc.device(k, p, t): (k, p, t) for k in range(s.dp) for p in range(s.pp) for t in range(s.tp)}


@dataclass(frozen=True)
class Transfer:
    """Rows/columns ``[start, end)`` along ``dim`` of tensor ``name`` go from ``src`` to ``dst``
    (``dim`` None: the whole tensor). ``src == dst`` is a local copy."""

    name: str
    src: int
    dst: int
    dim: int | None
    start: int
    end: int

    def numel(self, shape: tuple[int, ...]) -> int:
        n = 1
        for i, size in enumerate(shape):
            n *= (self.end - self.start) if i == self.dim else size
        return n


def tp_dim(name: str) -> int | None:
    """The dimension tensor-parallel ranks split ``name`` along (None: replicated)."""
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def _interval(name: str, args: ModelArgs, shape: tuple[int, ...], tp: int, t: int) -> tuple[int, int]:
    """Range held by tp rank ``t`` along ``tp_dim(name)`` (the whole range when not split)."""
    sl = tp_slice(name, args, tp, t)
    dim = tp_dim(name)
    if sl is None:
        return 0, shape[dim] if dim is not None else shape[0]
    return sl[1], sl[2]


def transfer_plan(args: ModelArgs, source: Allocation, target: Allocation) -> list[Transfer]:
    """Slices each target device needs. A slice comes from the device itself when it holds it in
    the source layout, else from the source replica whose dp index is the target's modulo the
    source dp (spreading the senders). Neither layout may be ZeRO-3 sharded (gather first)."""
    shapes = full_shapes(args)
    src_coords = coords(source)
    s_src, s_dst = source.strategy, target.strategy
    plan: list[Transfer] = []
    for dev, (k, p, t) in sorted(coords(target).items()):
        mine = src_coords.get(dev)
        for name, shape in shapes.items():
            if stage_of(name, args.num_layers, s_dst.pp) != p:
                continue
            dim = tp_dim(name)
            start, end = _interval(name, args, shape, s_dst.tp, t)
            sp = stage_of(name, args.num_layers, s_src.pp)
            taken: set[tuple[int, int]] = set()
            for ts in range(s_src.tp):
                s0, s1 = _interval(name, args, shape, s_src.tp, ts)
                lo, hi = max(start, s0), min(end, s1)
                if lo >= hi or (lo, hi) in taken:  # replicated kv heads: one holder is enough
                    continue
                taken.add((lo, hi))
                holds = mine is not None and mine[1] == sp and mine[2] == ts
                src = dev if holds else source.device(k % s_src.dp, sp, ts)
                plan.append(Transfer(name, src, dev, dim, lo, hi))
                if dim is None:
                    break
            if mine is not None and mine[1] == sp:  # whatever this device holds itself, it keeps
                own0, own1 = _interval(name, args, shape, s_src.tp, mine[2])
                if own0 <= start and end <= own1:
                    plan = [tr for tr in plan if not (tr.dst == dev and tr.name == name)]
                    plan.append(Transfer(name, dev, dev, dim, start, end))
    return plan


def received_bytes(plan: list[Transfer], args: ModelArgs, bytes_per_elem: int = 4) -> dict[int, int]:
    shapes = full_shapes(args)
    out: dict[int, int] = {}
    for tr in plan:
        if tr.src != tr.dst:
            out[tr.dst] = out.get(tr.dst, 0) + tr.numel(shapes[tr.name]) * bytes_per_elem
    return out
