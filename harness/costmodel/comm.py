"""Alpha-beta cost of point-to-point transfers and ring collectives (docs/DESIGN.md section 4).

Owns the communication half of the analytic cost model: how long a transfer or a
collective takes on one tier of the network (intra-node NVLink or inter-node NIC), and
which tier a group of devices talks over.

Model. A message of ``B`` bytes over a link costs ``alpha + B / (bw * eff)`` where ``alpha``
is ``LinkConfig.latency_us``, ``bw`` the unidirectional per-GPU ``bandwidth_gbps`` (GB/s,
1e9 bytes) and ``eff`` the achievable fraction (NCCL bus bandwidth / link peak). Ring
collectives over ``n`` ranks follow the standard closed forms (Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; the
same bus-bandwidth factors NCCL's nccl-tests report, see its doc/PERFORMANCE.md):

* all-reduce (reduce-scatter then all-gather): ``2 (n-1) alpha + 2 (n-1)/n * B / (bw eff)``
* all-gather, reduce-scatter: ``(n-1) alpha + (n-1)/n * B / (bw eff)``
* all-to-all (each rank sends ``B/n`` of its ``B`` bytes to each of the other ``n-1``, as
  ``n-1`` concurrent sends; nccl-tests' bus bandwidth factor for alltoall is also ``(n-1)/n``):
  ``(n-1) alpha + (n-1)/n * B / (bw eff)``

``B`` is always the *full* buffer: the per-rank message for all-reduce (every rank holds
all ``B`` bytes before and after), the gathered output for all-gather, the un-reduced
input for reduce-scatter, each rank's input for all-to-all.

Tier selection. Device ``d`` lives on node ``d // gpus_per_node``. A group on one node uses
``cluster.intra_node``; a group that spans nodes uses ``cluster.inter_node``, whose bandwidth
is per GPU (one NIC per GPU on a rail-optimised fabric). ``link_for_group`` here is the plain
tier choice; :meth:`harness.costmodel.model.CostModel.link_for_group` refines the multi-node
case for collectives, where NCCL drives one ring channel per NIC (effective bandwidth
``min(NVLink, g x NIC)`` for ``g`` group members per node).
"""
from __future__ import annotations

from typing import Any, Iterable

from harness.core.config import LinkConfig


def plain_link(link: Any) -> LinkConfig:
    """A plain ``LinkConfig`` dataclass with float fields, from a ``LinkConfig`` or an
    OmegaConf node. Reading attributes of a plain dataclass is ~100x faster than of a
    ``DictConfig``, which matters on the simulator's hot paths."""
    return LinkConfig(
        bandwidth_gbps=float(link.bandwidth_gbps),
        latency_us=float(link.latency_us),
        efficiency_frac=float(link.efficiency_frac),
    )


def _seconds_per_byte(link: LinkConfig) -> float:
    return 1.0 / (link.bandwidth_gbps * 1e9 * link.efficiency_frac)


def p2p_s(num_bytes: float, link: LinkConfig) -> float:
    """One point-to-point send of ``num_bytes``."""
    if num_bytes <= 0:
        return 0.0
    return link.latency_us * 1e-6 + num_bytes * _seconds_per_byte(link)


def allreduce_s(num_bytes: float, n: int, link: LinkConfig) -> float:
    """Ring all-reduce of a ``num_bytes`` buffer held by each of ``n`` ranks."""
    if n <= 1 or num_bytes <= 0:
        return 0.0
    steps = 2 * (n - 1)
    return steps * link.latency_us * 1e-6 + steps / n * num_bytes * _seconds_per_byte(link)


def allgather_s(num_bytes: float, n: int, link: LinkConfig) -> float:
    """Ring all-gather whose gathered output is ``num_bytes`` (each rank holds 1/n)."""
    if n <= 1 or num_bytes <= 0:
        return 0.0
    steps = n - 1
    return steps * link.latency_us * 1e-6 + steps / n * num_bytes * _seconds_per_byte(link)


def alltoall_s(num_bytes: float, n: int, link: LinkConfig) -> float:
    """All-to-all over ``n`` ranks, each holding ``num_bytes`` of which it sends ``1/n`` to every
    other rank (``(n-1)/n`` of it leaves the rank)."""
    if n <= 1 or num_bytes <= 0:
        return 0.0
    steps = n - 1
    return steps * link.latency_us * 1e-6 + steps / n * num_bytes * _seconds_per_byte(link)


def reduce_scatter_s(num_bytes: float, n: int, link: LinkConfig) -> float:
    """Ring reduce-scatter of a ``num_bytes`` input (each rank ends with 1/n reduced)."""
    # Same traffic pattern as all-gather, run in reverse.
    return allgather_s(num_bytes, n, link)


def node_of(device_id: int, gpus_per_node: int) -> int:
    """The node that holds global device ``device_id``."""
    return device_id // gpus_per_node


def spans_nodes(device_ids: Iterable[int], gpus_per_node: int, num_devices: int) -> bool:
    """Whether the devices sit on more than one node; raises on an id outside the cluster."""
    nodes = set()
    for d in device_ids:
        if not 0 <= d < num_devices:
            raise ValueError(f"device id {d} outside the cluster's {num_devices} devices")
        nodes.add(d // gpus_per_node)
    return len(nodes) > 1


def link_for_group(cluster: Any, device_ids: Iterable[int]) -> LinkConfig:
    """The tier a group of devices communicates over: ``cluster.intra_node`` when all are
    on one node, else ``cluster.inter_node`` (per-GPU NIC bandwidth, rail-optimised)."""
    gpus_per_node = int(cluster.gpus_per_node)
    num_devices = int(cluster.num_nodes) * gpus_per_node
    if spans_nodes(device_ids, gpus_per_node, num_devices):
        return cluster.inter_node
    return cluster.intra_node
