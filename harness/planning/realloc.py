"""Bytes moved when a model's weights go from one (dp, tp, pp) layout to another.

One function serves the cost model and (later) the real backend, so simulated and real weight
movement agree on what moves (ReaLHF's parameter reallocation, Mei et al. arXiv 2406.14088; the
hybrid engine's ZeRO-3 gather of DeepSpeed-Chat; RLHFuse's resharding of the critic).

Parameter space: the model's pieces are its layers (plus embedding on the first stage and the head
on the last), each cut into ``tp`` equal column slices. A device of the target layout at
(dp k, pp p, tp t) needs the layers of stage p, slice t of tp. What it already holds in the source
layout (if it is in the source mesh) is subtracted: the overlap of the layer ranges times the
overlap of the tp slices, times 1/dp of it when the source is ZeRO-3 sharded. The rest is
received from a holder; the transfer runs over NVLink when every piece it needs has a holder on
its own node, else over the inter-node NIC.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from harness.core.plan import Allocation


@dataclass(frozen=True)
class DeviceTransfer:
    device: int
    bytes: float
    intra_node: bool  # every needed piece has a holder on the device's node


def _stage_layer_range(num_layers: int, pp: int, stage: int) -> tuple[float, float]:
    per = num_layers / pp
    return stage * per, (stage + 1) * per


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


@lru_cache(maxsize=1024)
def _coords(alloc: Allocation) -> dict[int, tuple[int, int, int]]:
    """Device -> (dp, pp, tp) rank in ``alloc``, in mesh order (:meth:`Allocation.device`'s indexing).
    Memoised (a layout search prices movements between the same allocations again and again): read
    it, do not change it."""
    s = alloc.strategy
    return {dev: (i // (s.pp * s.tp), (i // s.tp) % s.pp, i % s.tp) for i, dev in enumerate(alloc.mesh)}


@lru_cache(maxsize=1024)
def _holders_by_node(source: Allocation, gpus_per_node: int) -> dict[int, tuple[tuple[int, int], ...]]:
    """Distinct (stage, tp-slice) pieces ``source`` holds on each node, in the order a set of them
    built in mesh order iterates (memoised): nodes holding the same pieces in the same order get
    equal tuples, whose covered areas are the same sum."""
    holders: dict[int, set[tuple[int, int]]] = {}
    for dev, (_, p, t) in _coords(source).items():
        holders.setdefault(dev // gpus_per_node, set()).add((p, t))
    return {node: tuple(pieces) for node, pieces in holders.items()}


def _piece(alloc: Allocation, num_layers: int, coord: tuple[int, int, int]):
    _, p, t = coord
    s = alloc.strategy
    return _stage_layer_range(num_layers, s.pp, p), (t / s.tp, (t + 1) / s.tp)


def reallocation_transfers(source: Allocation, target: Allocation, num_layers: int,
                           layer_bytes: float, gpus_per_node: int) -> list[DeviceTransfer]:
    """Bytes each target device must receive, and over which tier. ``layer_bytes`` is the size of
    one layer's weights (embedding and head are folded into the per-layer size by the caller)."""
    src_coords = _coords(source)
    src_shard = 1.0 / source.strategy.dp if source.strategy.zero_stage == 3 else 1.0
    # Distinct (stage, tp-slice) pieces held on each node: pieces of one replica tile the model
    # disjointly, so de-duplicating across dp replicas makes the covered area exact.
    holders_by_node = _holders_by_node(source, gpus_per_node)
    source_nodes = {d // gpus_per_node for d in source.mesh}
    # (the node's source pieces, stage, tp slice) of the target -> covered: nodes with the same pieces share it
    covered_by: dict[tuple, float] = {}
    transfers = []
    for dev, coord in _coords(target).items():
        layers, cols = _piece(target, num_layers, coord)
        need = (layers[1] - layers[0]) * (cols[1] - cols[0])
        held = 0.0
        if dev in src_coords:
            s_layers, s_cols = _piece(source, num_layers, src_coords[dev])
            held = _overlap(layers, s_layers) * _overlap(cols, s_cols) * src_shard
        node = dev // gpus_per_node
        if source.strategy.zero_stage == 3:  # each piece is spread over every dp rank of the source
            intra = source_nodes == {node}
        else:
            holders = holders_by_node.get(node, ())
            key = (holders, coord[1], coord[2])  # every dp replica on a node needs the same piece
            if key not in covered_by:
                covered_by[key] = sum(_overlap(layers, l) * _overlap(cols, c)
                                      for l, c in (_piece(source, num_layers, (0, p, t)) for p, t in holders))
            intra = covered_by[key] >= need - 1e-9
        transfers.append(DeviceTransfer(dev, max(0.0, need - held) * layer_bytes, intra))
    return transfers


def total_bytes(transfers: list[DeviceTransfer]) -> float:
    return sum(t.bytes for t in transfers)
