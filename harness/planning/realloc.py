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

import numpy as np

from harness.core.plan import Allocation


@dataclass(frozen=True)
class DeviceTransfer:
    device: int
    bytes: float
    intra_node: bool  # every needed piece has a holder on the device's node


@lru_cache(maxsize=1024)
def _coords(alloc: Allocation) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``alloc``'s devices in mesh order (:meth:`Allocation.device`'s indexing) with the pp and tp
    rank of each. Memoised (a layout search prices movements between the same allocations again
    and again): read them, do not change them."""
    s = alloc.strategy
    i = np.arange(len(alloc.mesh), dtype=np.int64)
    return np.array(alloc.mesh, dtype=np.int64), (i // s.tp) % s.pp, i % s.tp


@lru_cache(maxsize=1024)
def _holders_by_node(source: Allocation, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """The nodes ``source`` occupies (ascending) and, per node, which (stage, tp-slice) pieces it
    holds (``held[i, stage, slice]``: 1 or 0; memoised)."""
    devices, stages, slices = _coords(source)
    nodes = devices // gpus_per_node
    node_ids = np.unique(nodes)
    held = np.zeros((len(node_ids), source.strategy.pp, source.strategy.tp))
    held[np.searchsorted(node_ids, nodes), stages, slices] = 1.0
    return node_ids, held


def _overlap(lo_a, hi_a, lo_b, hi_b) -> np.ndarray:
    """Length of the overlap of intervals ``[lo_a, hi_a)`` and ``[lo_b, hi_b)``, elementwise
    (broadcasting: columns against rows give every pair)."""
    return np.maximum(0.0, np.minimum(hi_a, hi_b) - np.maximum(lo_a, lo_b))


def transfer_arrays(source: Allocation, target: Allocation, num_layers: int, layer_bytes: float,
                    gpus_per_node: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`reallocation_transfers` as arrays over the target's devices in mesh order: the
    devices, the bytes each receives, and whether every piece it needs has a holder on its node."""
    devices, stages, slices = _coords(target)
    t, s = target.strategy, source.strategy
    per, source_per = num_layers / t.pp, num_layers / s.pp
    lo, hi = stages * per, (stages + 1) * per  # the layer range and tp columns each device needs
    left, right = slices / t.tp, (slices + 1) / t.tp
    need = (hi - lo) * (right - left)
    # what a device holds itself, where it is in the source mesh
    src_devices, src_stages, src_slices = _coords(source)
    size = int(max(devices.max(), src_devices.max())) + 1
    where = np.full(size, -1, dtype=np.int64)
    where[src_devices] = np.arange(len(src_devices))
    at = where[devices]
    mine = at >= 0
    s_stage, s_slice = src_stages[at[mine]], src_slices[at[mine]]
    src_shard = 1.0 / s.dp if s.zero_stage == 3 else 1.0
    held = np.zeros(len(devices))
    held[mine] = (_overlap(lo[mine], hi[mine], s_stage * source_per, (s_stage + 1) * source_per)
                  * _overlap(left[mine], right[mine], s_slice / s.tp, (s_slice + 1) / s.tp) * src_shard)
    moved = np.maximum(0.0, need - held) * layer_bytes
    nodes = devices // gpus_per_node
    node_ids, pieces = _holders_by_node(source, gpus_per_node)
    if s.zero_stage == 3:  # each piece is spread over every dp rank of the source
        intra = (nodes == node_ids[0]) if len(node_ids) == 1 else np.zeros(len(devices), dtype=bool)
        return devices, moved, intra
    # the area of each target piece that each source node's pieces cover: pieces of one replica
    # tile the model disjointly, and a node's pieces are counted once however many replicas hold them
    k, ks = np.arange(t.pp)[:, None], np.arange(s.pp)[None, :]
    layer_cover = _overlap(k * per, (k + 1) * per, ks * source_per, (ks + 1) * source_per)
    j, js = np.arange(t.tp)[:, None], np.arange(s.tp)[None, :]
    col_cover = _overlap(j / t.tp, (j + 1) / t.tp, js / s.tp, (js + 1) / s.tp)
    covered = layer_cover @ pieces @ col_cover.T  # (source node, target stage, target slice)
    node_at = np.searchsorted(node_ids, nodes)
    on_source_node = (node_at < len(node_ids)) & (node_ids[np.minimum(node_at, len(node_ids) - 1)] == nodes)
    area = np.zeros(len(devices))
    area[on_source_node] = covered[node_at[on_source_node], stages[on_source_node], slices[on_source_node]]
    return devices, moved, area >= need - 1e-9


def reallocation_transfers(source: Allocation, target: Allocation, num_layers: int,
                           layer_bytes: float, gpus_per_node: int) -> list[DeviceTransfer]:
    """Bytes each target device must receive, and over which tier. ``layer_bytes`` is the size of
    one layer's weights (embedding and head are folded into the per-layer size by the caller)."""
    devices, moved, intra = transfer_arrays(source, target, num_layers, layer_bytes, gpus_per_node)
    return [DeviceTransfer(d, b, i) for d, b, i in zip(devices.tolist(), moved.tolist(), intra.tolist())]


def total_bytes(transfers: list[DeviceTransfer]) -> float:
    return sum(t.bytes for t in transfers)
