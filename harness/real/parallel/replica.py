"""A model laid out as one task's allocation says, as seen from one device worker.

:class:`Replica` is what the passes compute with: the device's coordinates ``(dp k, pp p, tp t)``
in the layout, its process groups, a module to call, and -- for a trained model -- the training
hooks (``backward``, ``micro_step``, ``optimizer_step``). Three kinds:

- :class:`LocalReplica`: the device holds its pipeline stage's layers, tp slice, and (ZeRO 0-2)
  Adam over the dp group (:class:`~harness.real.parallel.optim.FlatAdam`);
- :class:`NativeZero3Replica`: ZeRO-3 with our own sharding (tp = pp = 1): parameters sharded
  between uses, gathered for a task (:class:`~harness.real.parallel.optim.ShardedParams`);
- ``DeepSpeedReplica`` (:mod:`harness.real.parallel.zero3`): a DeepSpeed ZeRO-3 engine.

Initial weights: a replica is built on the meta device and materialises only its own piece (its
pipeline stage's layers, its tp slice; for native ZeRO-3 only its flat optimizer shard), computed
from the role's seed by :func:`harness.real.model.init_values`, which gives every slice the
numbers the whole seeded :class:`harness.real.model.LlamaModel` holds there, so every layout
starts from the same weights and no worker ever holds the full model to initialise it. A full
state dict (a checkpoint) may be given instead and is sliced.

Precision: the module holds ``dtype`` parameters (bf16 on CUDA by default) and computes in them;
trained replicas keep float32 master weights and Adam states (:class:`FlatAdam`). A replica of a
model the plan *offloads* keeps its weights in host memory between uses and copies them to the
device around each use (:meth:`Replica.compute`; nothing to move when the device is the CPU).
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch import Tensor

from harness.real.parallel.comm import Groups
from harness.real.parallel.layout import (build_local_module, check_tp, coords, flat_init_shard, init_local_module,
                                         param_bytes)
from harness.real.parallel.optim import FlatAdam, ShardedParams
from harness.real.parallel.tp import install_tp_hooks, sync_shared_kv_grads
from harness.core.plan import Allocation
from harness.real.model import ModelArgs

Span = tuple[str, float, float]


class Replica:
    trainable = False
    dtype = torch.float32
    offloaded = False  # weights live in host memory between uses (the plan's ``offloaded`` models)

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
        """Around a task's use of the weights (ZeRO-3 gathers them here; an offloaded model's
        weights are copied to the device here and back to host memory after)."""
        if not self._swaps:
            yield
            return
        self.onload()
        try:
            yield
        finally:
            self.offload()

    @property
    def _swaps(self) -> bool:
        return self.offloaded and torch.device(self.device).type != "cpu" and self.module is not None

    def offload(self) -> None:
        """Weights (and a trained replica's optimizer states) to (pinned) host memory; the device
        copies are freed."""
        if not self._swaps:
            return
        with torch.no_grad():
            for p in self.module.parameters():
                if p.device.type != "cpu":
                    host = p.data.to("cpu")
                    p.data = host.pin_memory() if torch.cuda.is_available() else host
        if getattr(self, "opt", None) is not None:
            self.opt.move_to("cpu")
        self.swaps += 1

    def onload(self) -> None:
        """Weights (and optimizer states) from host memory back to the device."""
        if not self._swaps:
            return
        with torch.no_grad():
            for p in self.module.parameters():
                if p.device.type == "cpu":
                    p.data = p.data.to(self.device, non_blocking=True)
        if getattr(self, "opt", None) is not None:
            self.opt.move_to(self.device)
        self.swaps += 1

    swaps = 0  # host <-> device copies of the weights so far

    # ---- memory ---------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of model state this replica holds on its device now: parameters materialised on
        the device, plus the optimizer's float32 master and Adam states."""
        dev = torch.device(self.device).type
        n = sum(p.numel() * p.element_size() for p in self.module.parameters()
                if not p.is_meta and p.device.type == dev) if self.module is not None else 0
        opt = getattr(self, "opt", None)
        return n + (opt.state_bytes() if opt is not None and hasattr(opt, "state_bytes") else 0)

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
    """``full_state``: the whole model to slice (a checkpoint); else ``seed``: the seeded initial
    weights, of which only this device's piece is computed; neither: left for a weight movement."""

    def __init__(self, role, args, alloc, rank, groups, device, full_state: dict[str, Tensor] | None,
                 hparams: dict | None = None, *, seed: int | None = None, dtype: torch.dtype = torch.float32,
                 offloaded: bool = False):
        super().__init__(role, args, alloc, rank, groups, device)
        s = self.strategy
        check_tp(args, s.tp, f"{role} layout {s}")
        k, p, t = self.coord
        self.dtype = dtype
        module = init_local_module(args, s.pp, p, s.tp, t, device=device, dtype=dtype, seed=seed,
                                   full_state=full_state)
        self.materialised_bytes = param_bytes(module)
        self.module = module
        self.offloaded = offloaded
        if s.tp > 1:
            install_tp_hooks(module, self.tp_group)
        self.opt = None
        if hparams is not None:
            self.trainable = True
            dp_rank = self.dp_ranks.index(rank)
            self.opt = FlatAdam(module, self.dp_group, s.dp, dp_rank, shard=s.zero_stage in (1, 2), **hparams)
        self.offload()  # an offloaded model waits in host memory for its first use

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

    def __init__(self, role, args, alloc, rank, groups, device, full_state: dict[str, Tensor] | None,
                 hparams: dict | None = None, *, seed: int | None = None, dtype: torch.dtype = torch.float32):
        super().__init__(role, args, alloc, rank, groups, device)
        s = self.strategy
        self.dtype = dtype
        dp_rank = self.dp_ranks.index(rank)
        defaults = dict(lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        if full_state is not None or seed is None:
            module = init_local_module(args, 1, 0, 1, 0, device=device, dtype=dtype, full_state=full_state)
            self.materialised_bytes = param_bytes(module)
            self.opt = FlatAdam(module, self.dp_group, s.dp, dp_rank, shard=True, **(hparams or defaults))
            self.params = ShardedParams(module, self.opt)
            self.params.release()
        else:  # only this rank's flat shard of the seeded weights is ever computed (rounded to
            # ``dtype`` as a module copy would be, so the master equals the other layouts' masters)
            with torch.device("meta"):
                module = build_local_module(args, 1, 0, 1)
            module.to(dtype=dtype)
            shapes = [p.shape for _, p in sorted(module.named_parameters())]
            for mod in module.modules():
                for name, p in list(mod._parameters.items()):
                    if p is not None:
                        mod._parameters[name] = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=device))
            self.opt = FlatAdam(module, self.dp_group, s.dp, dp_rank, shard=True, shapes=shapes, device=device,
                                master_init=lambda lo, hi: flat_init_shard(args, seed, lo, hi).to(dtype).float(),
                                **(hparams or defaults))
            self.materialised_bytes = 0
            self.params = ShardedParams(module, self.opt, gathered=False)
        self.module = module
        self.trainable = hparams is not None
        self.gathered_bytes = 0.0

    gathered_peak_bytes = 0  # the whole model's parameters, held while a task computes

    @contextlib.contextmanager
    def compute(self):
        self.gathered_bytes += self.params.gather()
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, param_bytes(self.module))
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
