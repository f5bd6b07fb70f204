"""Weight movement between layouts with real collectives (plan ``WeightMovement`` tasks).

- From a ZeRO-3 layout (DeepSpeed-Chat's hybrid engine, Yao et al. 2023 section 4): the source
  mesh all-gathers the whole model, then every target device keeps its own (pp stage, tp slice);
  a target device outside the source mesh (FSDP training beside generation engines of their own)
  receives its slices from one source device, as from a dp-only layout's replica.
- Otherwise (ReaLHF-style reallocation, Mei et al. 2024; RLHFuse's resharding): each target device
  receives exactly the slices :func:`harness.real.parallel.layout.transfer_plan` lists -- the piece
  model of :func:`harness.planning.realloc.reallocation_transfers`, which the simulator costs -- one flat
  buffer per (source, destination) pair, all pairs at once.

Both return a ``realloc`` span per device with the bytes it received.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from harness.real.parallel.comm import exchange
from harness.real.parallel.layout import _interval, full_shapes, load_pieces, transfer_plan
from harness.core.plan import Allocation, ParallelStrategy


def _zero3_state(replica) -> dict[str, torch.Tensor]:
    if hasattr(replica, "gathered_state"):
        return replica.gathered_state()
    with replica.compute():
        return {n: p.detach().clone() for n, p in replica.module.named_parameters()}


def _narrow(t: torch.Tensor, dim: int | None, offset: int, length: int) -> torch.Tensor:
    return t if dim is None else t.narrow(dim, offset, length)


def move_weights(store, role: str, source, target, source_alloc: Allocation,
                 target_alloc: Allocation) -> tuple[list, Any]:
    """Move ``role``'s weights from ``source_alloc`` to ``target_alloc`` as device ``store.rank``
    (a :class:`~harness.real.parallel.store.ReplicaStore`): ``source`` / ``target`` are its replicas
    in the two layouts, None where it is not in that mesh."""
    rank = store.rank
    args = store.args(role)
    t0 = time.time()
    received = 0.0
    src_tp, src_tp_rank = (source.strategy.tp, source.coord[2]) if source is not None else (1, 0)
    if source_alloc.strategy.zero_stage == 3:
        state = {}
        if source is not None:
            state = _zero3_state(source)  # a collective over the source mesh
            dp = source_alloc.strategy.dp
            received = sum(v.numel() * v.element_size() for v in state.values()) * (dp - 1) / dp
        if set(target_alloc.mesh) <= set(source_alloc.mesh):
            if target is not None:
                load_pieces(target.module, state, args, target.strategy.tp, target.coord[2])
            return [("realloc", t0, time.time(), 0.0, received)], {"bytes": received}
        # targets outside the source mesh: every source device now holds the whole model, as a
        # replica of a dp-only layout does; each target device receives its pieces from one of them
        source_alloc = Allocation(source_alloc.mesh, ParallelStrategy(dp=len(source_alloc.mesh)))
        src_state, src_tp, src_tp_rank = state, 1, 0
    else:
        src_state = source.local_state() if source is not None else {}
    shapes = full_shapes(args)
    plan = transfer_plan(args, source_alloc, target_alloc)
    dst_params = dict(target.module.named_parameters()) if target is not None else {}

    def source_slice(tr) -> torch.Tensor:
        s0, _ = _interval(tr.name, args, shapes[tr.name], src_tp, src_tp_rank)
        return _narrow(src_state[tr.name], tr.dim, tr.start - s0, tr.end - tr.start)

    def target_slice(tr) -> torch.Tensor:
        d0, _ = _interval(tr.name, args, shapes[tr.name], target.strategy.tp, target.coord[2])
        return _narrow(dst_params[tr.name].data, tr.dim, tr.start - d0, tr.end - tr.start)

    sends: dict[int, list[torch.Tensor]] = {}
    recv_numel: dict[int, int] = {}
    with torch.no_grad():
        for tr in plan:
            if tr.src == rank and tr.dst == rank:
                target_slice(tr).copy_(source_slice(tr))
            elif tr.src == rank:
                sends.setdefault(tr.dst, []).append(source_slice(tr).reshape(-1))
            elif tr.dst == rank:
                recv_numel[tr.src] = recv_numel.get(tr.src, 0) + tr.numel(shapes[tr.name])
        flat_sends = {dst: torch.cat(parts) for dst, parts in sends.items()}
        dtype = store.dtype  # weights travel in the replicas' dtype (bf16 on CUDA)
        flat_sends = {dst: buf.to(dtype) for dst, buf in flat_sends.items()}
        got = exchange(rank, flat_sends, recv_numel, dtype, store.device)
        offsets = {src: 0 for src in got}
        for tr in plan:
            if tr.dst == rank and tr.src != rank:
                n = tr.numel(shapes[tr.name])
                dst = target_slice(tr)
                dst.copy_(got[tr.src][offsets[tr.src]:offsets[tr.src] + n].view(dst.shape))
                offsets[tr.src] += n
                received += n * got[tr.src].element_size()
    return [("realloc", t0, time.time(), 0.0, received)], {"bytes": received}


def gather_state(replica) -> dict[str, Any] | None:
    """What this device contributes to the driver's copy of the model: its local piece (replica 0
    of a layout) or, for ZeRO-3, the gathered model (reporting device only; a collective)."""
    if replica.strategy.zero_stage == 3:
        state = replica.full_state()
        if state is None:
            return None
        return {"coord": (0, 0, 0), "state": {n: v.float().cpu().numpy() for n, v in state.items()}}
    if replica.coord[0] != 0:
        return None
    return {"coord": tuple(replica.coord), "state": {n: v.float().cpu().numpy().copy()
                                                   for n, v in replica.local_state().items()}}
