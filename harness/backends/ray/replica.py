"""A model laid out as one task's allocation says, as seen from one device worker.

:class:`Replica` is what the passes compute with: the device's coordinates ``(dp k, pp p, tp t)``
in the layout, its process groups, a module to call, and -- for a trained model -- the training
hooks (``backward``, ``micro_step``, ``optimizer_step``). Three kinds:

- :class:`LocalReplica`: the device holds its pipeline stage's layers, tp slice, and (ZeRO 0-2)
  Adam over the dp group (:class:`~harness.backends.ray.optim.FlatAdam`);
- :class:`NativeZero3Replica`: ZeRO-3 with our own sharding (tp = pp = 1): parameters sharded
  between uses, gathered for a task (:class:`~harness.backends.ray.optim.ShardedParams`);
- ``DeepSpeedReplica`` (:mod:`harness.backends.ray.zero3`): a DeepSpeed ZeRO-3 engine.

Initial weights come from :class:`harness.real.model.LlamaModel` with the role's seed, built on
every worker and sliced, so every layout starts from the same numbers.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch import Tensor

from harness.backends.ray.comm import Groups
from harness.backends.ray.layout import build_local_module, check_tp, coords, load_pieces
from harness.backends.ray.optim import FlatAdam, ShardedParams
from harness.backends.ray.tp import install_tp_hooks, sync_shared_kv_grads
from harness.plan import Allocation
from harness.real.model import ModelArgs

Span = tuple[str, float, float]


class Replica:
    trainable = False

    def __init__(self, role: str, args: ModelArgs, alloc: Allocation, rank: int, groups: Groups, device):
        self.role, self.args, self.alloc, self.rank, self.device = role, args, alloc, rank, device
        s = self.strategy = alloc.strategy
        self.coord = coords(alloc)[rank]
        k, p, t = self.coord
        self.tp_group = groups.get(alloc.stage_devices(k, p))
        self.dp_ranks = tuple(alloc.device(j, p, t) for j in range(s.dp))
        self.dp_group = groups.get(self.dp_ranks)
        self.mesh_group = groups.get(alloc.mesh)
        self.module: torch.nn.Module | None = None

    # ---- layout queries -------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.coord[1] == 0

    @property
    def is_last(self) -> bool:
        return self.coord[1] == self.strategy.pp - 1

    def neighbour(self, delta: int) -> int:
        k, p, t = self.coord
        return self.alloc.device(k, p + delta, t)

    @property
    def reports(self) -> bool:
        """This device returns the replica's outputs (last stage, tp rank 0)."""
        return self.is_last and self.coord[2] == 0

    # ---- compute --------------------------------------------------------------------------
    @contextlib.contextmanager
    def compute(self):
        """Around a task's use of the weights (ZeRO-3 gathers them here)."""
        yield

    def __call__(self, x: Tensor, **kwargs) -> Tensor:
        return self.module(x, **kwargs)

    def set_train(self, mode: bool) -> None:
        self.module.train(mode)

    # ---- training -------------------------------------------------------------------------
    def backward(self, loss: Tensor, output: Tensor | None = None, grad: Tensor | None = None) -> None:
        if output is not None:
            output.backward(grad)
        else:
            loss.backward()

    def micro_step(self) -> list[Span]:
        return []

    def optimizer_step(self) -> list[Span]:
        return []

    # ---- weights --------------------------------------------------------------------------
    def local_state(self) -> dict[str, Tensor]:
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def full_state(self) -> dict[str, Tensor] | None:
        """Collective over the mesh for sharded replicas; the whole model on the reporting device
        of a ZeRO-3 layout, None elsewhere. Local replicas return None (use ``local_state``)."""
        return None


class LocalReplica(Replica):
    def __init__(self, role, args, alloc, rank, groups, device, full_state: dict[str, Tensor] | None,
                 hparams: dict | None = None):
        super().__init__(role, args, alloc, rank, groups, device)
        s = self.strategy
        check_tp(args, s.tp, f"{role} layout {s}")
        k, p, t = self.coord
        with torch.device("meta"):
            module = build_local_module(args, s.pp, p, s.tp)
        module.to_empty(device=device)
        if full_state is not None:
            load_pieces(module, full_state, args, s.tp, t)
        self.module = module
        if s.tp > 1:
            install_tp_hooks(module, self.tp_group)
        self.opt = None
        if hparams is not None:
            self.trainable = True
            dp_rank = self.dp_ranks.index(rank)
            self.opt = FlatAdam(module, self.dp_group, s.dp, dp_rank, shard=s.zero_stage in (1, 2), **hparams)

    def optimizer_step(self) -> list[Span]:
        spans: list[Span] = []
        s = self.strategy
        if s.tp > 1 and s.tp > self.args.num_kv_heads:
            t0 = time.time()
            sync_shared_kv_grads(self.module, self.args, s.tp, self.coord[2], self.tp_group)
            spans.append(("allreduce", t0, time.time()))
        return spans + self.opt.step()


class NativeZero3Replica(Replica):
    """ZeRO-3 over the mesh without DeepSpeed: one flat shard per rank between uses."""

    def __init__(self, role, args, alloc, rank, groups, device, full_state: dict[str, Tensor],
                 hparams: dict | None = None):
        super().__init__(role, args, alloc, rank, groups, device)
        s = self.strategy
        with torch.device("meta"):
            module = build_local_module(args, 1, 0, 1)
        module.to_empty(device=device)
        load_pieces(module, full_state, args, 1, 0)
        self.module = module
        dp_rank = self.dp_ranks.index(rank)
        defaults = dict(lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        self.opt = FlatAdam(module, self.dp_group, s.dp, dp_rank, shard=True, **(hparams or defaults))
        self.trainable = hparams is not None
        self.params = ShardedParams(module, self.opt)
        self.params.release()
        self.gathered_bytes = 0.0

    @contextlib.contextmanager
    def compute(self):
        self.gathered_bytes += self.params.gather()
        try:
            yield
        finally:
            self.params.release()

    def optimizer_step(self) -> list[Span]:
        spans = self.opt.step(write_back=False)
        t0 = time.time()
        self.params.release()
        self.gathered_bytes += self.params.gather()
        spans.append(("allgather", t0, time.time()))
        return spans

    def full_state(self) -> dict[str, Tensor] | None:
        with self.compute():
            state = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        return state if self.rank == min(self.alloc.mesh) else None
