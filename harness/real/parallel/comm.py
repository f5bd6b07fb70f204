"""Process groups and point-to-point exchanges between device workers.

``torch.distributed.new_group`` must be called by every rank, in the same order, for every group
(torch.distributed docs, "Groups"). The driver therefore derives one sorted list of rank sets
from the plan (:func:`plan_group_ranks`: each allocation's mesh, its tensor-parallel groups and
its data-parallel groups) and every worker creates them in that order at set-up. Right after a
sub-group is created, its members take part in one collective on it, and every rank in one on the
default group right after ``init_process_group`` (:meth:`Groups.first_collective`, called by the
worker): ``batch_isend_irecv`` is undefined when it is the first collective call of its group and
not every rank of the group takes part (its docs), and on CUDA each worker has set its current
device before (harness/backends/ray/worker/device.py).

Point-to-point traffic (pipeline activations, weight reallocation) uses the default group with
global ranks, after its all-rank first collective. :func:`exchange` sends one flat buffer per
(source, destination) pair, posting all sends and receives at once with ``batch_isend_irecv`` so no
pair waits on another.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from harness.core.plan import Allocation, Plan


def allocation_group_ranks(alloc: Allocation) -> set[tuple[int, ...]]:
    s = alloc.strategy
    out = {tuple(sorted(alloc.mesh))}
    for k in range(s.dp):
        for p in range(s.pp):
            out.add(tuple(sorted(alloc.stage_devices(k, p))))
    for p in range(s.pp):
        for t in range(s.tp):
            out.add(tuple(sorted(alloc.device(k, p, t) for k in range(s.dp))))
    return out


def plan_group_ranks(plan: Plan, extra: Iterable[Allocation] = ()) -> list[tuple[int, ...]]:
    """Every rank set a worker may use as a group, in one deterministic order."""
    sets: set[tuple[int, ...]] = set()
    for alloc in [t.allocation for t in plan.tasks] + [a for m in plan.weight_movements
                                                       for a in (m.source, m.target)] + list(extra):
        sets |= allocation_group_ranks(alloc)
    return sorted((r for r in sets if len(r) > 1), key=lambda r: (len(r), r))


class Groups:
    """Rank set -> process group (None for a set of one rank: no communication needed).

    Every rank creates every group, in ``rank_sets`` order (``new_group`` is collective over the
    default group; with NCCL bound to a device it splits the default communicator, which all ranks
    must call); the members of a new group then run its first collective together before the next
    group is created, on ``device`` (the worker's). A set of every rank is the default group, whose
    first collective the worker ran after ``init_process_group``."""

    def __init__(self, rank: int, world_size: int, rank_sets: list[tuple[int, ...]], device=None):
        self.rank, self.world_size = rank, world_size
        device = torch.device("cpu") if device is None else device
        self._groups = {}
        for ranks in rank_sets:
            if len(ranks) == world_size:
                group = dist.group.WORLD
            else:
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    self.first_collective(group, device)
            if rank in ranks:
                self._groups[ranks] = group

    @staticmethod
    def first_collective(group, device) -> None:
        """The first collective of ``group`` (None: the default group), by every member: an
        all-reduce of one element, waited for and checked (it must count every member), so that no
        later ``batch_isend_irecv`` among a subset of the group's ranks is its first call."""
        ones = torch.ones(1, device=device)
        dist.all_reduce(ones, group=group)
        size = dist.get_world_size(group)
        if int(ones.item()) != size:  # .item() waits for the collective (on CUDA: synchronises)
            raise RuntimeError(f"first collective of a group of {size} ranks counted {int(ones.item())}")

    def get(self, ranks: Iterable[int]):
        key = tuple(sorted(ranks))
        if len(key) == 1:
            return None
        if key not in self._groups:
            raise KeyError(f"rank {self.rank}: no process group for ranks {key} (not set up from the plan)")
        return self._groups[key]


def exchange(rank: int, sends: dict[int, torch.Tensor], recv_numel: dict[int, int], dtype, device) -> dict[int, torch.Tensor]:
    """Send ``sends[dst]`` to each destination and receive ``recv_numel[src]`` elements from each
    source, all at once. Returns the received flat buffers by source rank."""
    ops, received = [], {}
    for peer in sorted(set(sends) | set(recv_numel)):
        if peer in sends:
            ops.append(dist.P2POp(dist.isend, sends[peer].contiguous(), peer))
        if peer in recv_numel:
            buf = torch.empty(recv_numel[peer], dtype=dtype, device=device)
            received[peer] = buf
            ops.append(dist.P2POp(dist.irecv, buf, peer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


class PipeChannel:
    """Activations and gradients between pipeline stages, safe under NCCL as well as gloo.

    A send is queued when its tensor is produced and posted together with the next receives, in
    one ``batch_isend_irecv`` group (or alone, by :meth:`post`, before the next computation). Under
    NCCL a send posted on its own ahead of a blocking receive can deadlock when two stages send to
    each other at once (each send waits for a receive queued behind the other's send); grouping the
    pending sends with the receives lets NCCL progress both, which is what torch's pipelining
    runtime does by batching each action's point-to-point operations.

    Matching. NCCL ignores tags and matches the messages between two ranks in posting order; with
    ``in_order`` (the default, and the only mode on CUDA) this channel posts every message with tag
    0, so gloo matches the same way and a CPU run sees exactly what an NCCL run would. The caller
    must then post, per rank pair, receives in the sender's send order: the training pass runs
    lowered action lists ordered by :func:`harness.schedule.p2p_order.order_receives`, checked by
    :func:`~harness.schedule.p2p_order.check_in_order`. With ``in_order=False`` messages keep
    their tags (gloo matches by tag and source; for comparison only)."""

    def __init__(self, device, in_order: bool = True):
        self.device = device
        self.in_order = in_order
        self.queued: list = []  # P2POps not yet posted (sends)
        self.in_flight: list = []  # (work, tensor) of posted sends

    def _tag(self, tag: int) -> int:
        return 0 if self.in_order else tag

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.queued.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), dst, tag=self._tag(tag)))

    def recv(self, shape: tuple[int, ...], src: int, tag: int = 0, dtype=torch.float32) -> torch.Tensor:
        return self.recv_all([(shape, src, tag, dtype)])[0]

    def recv_all(self, specs: list[tuple[tuple[int, ...], int, int, torch.dtype]]) -> list[torch.Tensor]:
        """Post the queued sends and a receive for each ``(shape, src, tag, dtype)``, in list order,
        in one group; wait for the receives and return their buffers."""
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, _, _, dtype in specs]
        ops = [dist.P2POp(dist.irecv, buf, src, tag=self._tag(tag)) for buf, (_, src, tag, _) in zip(bufs, specs)]
        for work in self._post(ops):
            work.wait()
        return bufs

    def post(self) -> None:
        """Post the queued sends (before computing, so no peer waits on a send held back)."""
        if self.queued:
            self._post([])

    def _post(self, receives: list) -> list:
        """Post the queued sends, then ``receives``, as one group; return the works to wait for
        the receives. gloo gives one work per operation; NCCL one coalesced work for the group
        (its ``wait`` makes the compute stream wait, not the host), which then stands for both."""
        sends = self.queued
        self.queued = []
        works = dist.batch_isend_irecv(sends + receives)
        if len(works) == len(sends) + len(receives):
            self.in_flight.append((works[:len(sends)], [op.tensor for op in sends]))
            return works[len(sends):]
        self.in_flight.append((works, [op.tensor for op in sends]))  # keep the sent tensors alive
        return works

    def flush(self) -> None:
        self.post()
        for works, _ in self.in_flight:
            for work in works:
                work.wait()
        self.in_flight.clear()
