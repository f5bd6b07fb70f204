"""Data-parallel gradient synchronisation and Adam over one flat buffer per model piece.

One class covers the ZeRO stages a plan can ask for (Rajbhandari et al. 2020, "ZeRO", section 5):

- stage 0: gradients are all-reduced (summed) over the dp group, every rank runs Adam on all of
  its parameters;
- stages 1/2: gradients are reduce-scattered, each rank keeps Adam states for and updates only
  its ``1/dp`` shard of the flat buffer, and the updated shards are all-gathered (the distributed
  optimizer of Megatron-LM that RLHFuse's training engine uses);
- stage 3 (:class:`ShardedParams`): in addition the parameters themselves are kept as ``1/dp``
  shards between uses and all-gathered into the module before a task computes with them
  (whole-model granularity, where DeepSpeed gathers layer by layer).

Gradients are *summed* over dp: the losses are already normalised by the mini-batch's token count
(``harness.real.ppo``'s ``num_tokens``), so the sum is the gradient of the mini-batch mean whatever
the dp and micro-batch split. Adam is elementwise, so sharding changes nothing in the math; the
flat order is parameter-name order, the same on every rank of a dp group.

Mixed precision (Micikevicius et al. 2018, "Mixed Precision Training"; Megatron-LM's distributed
optimizer): the module may hold bf16 parameters, with which forward and backward run; the
optimizer always keeps a float32 *master* copy of its (shard of the) parameters and float32 Adam
states, the gradients are cast to float32 before they are reduced over dp and applied to the master
in float32, and the updated master is rounded back into the module's parameters. With float32
modules this is plain Adam, as before.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

Span = tuple[str, float, float]  # (kind, start, end) in time.time() seconds

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.11 has only the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


MASTER_DTYPE = torch.float32  # master weights, Adam states, gradient reduction


class FlatAdam:
    """Adam over one flat float32 master buffer (its ``1/dp`` shard when ``shard``).

    ``shapes`` (parameter-name order) and ``master_init`` (this rank's float32 master shard, or a
    function of its flat range ``(lo, hi)`` returning it) let a ZeRO-3 replica start from its shard
    alone, with the module's parameters not materialised."""

    def __init__(self, module: nn.Module, group, group_size: int, group_rank: int, *, shard: bool,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 shapes: list[torch.Size] | None = None, master_init=None,
                 device=None):
        self.params = [p for _, p in sorted(module.named_parameters())]
        self.shapes = list(shapes) if shapes is not None else [p.shape for p in self.params]
        self.numels = [s.numel() for s in self.shapes]
        self.device = torch.device(device) if device is not None else self.params[0].device
        self.group, self.size, self.rank = group, group_size, group_rank
        self.shard = shard and group_size > 1
        self.numel = sum(self.numels)
        parts = group_size if self.shard else 1
        self.padded = -(-self.numel // parts) * parts
        self.shard_numel = self.padded // parts
        lo = self.rank * self.shard_numel if self.shard else 0
        self.lo = lo
        if master_init is None:
            master_init = self.flat_params()[lo:lo + self.shard_numel]
        elif callable(master_init):
            master_init = master_init(lo, lo + self.shard_numel)
        if master_init.numel() != self.shard_numel:
            raise ValueError(f"master shard of {master_init.numel()} elements, expected {self.shard_numel}")
        self.master = nn.Parameter(master_init.to(device=self.device, dtype=MASTER_DTYPE, copy=True))
        self.opt = torch.optim.Adam([self.master], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                    foreach=False)

    def flat_params(self) -> torch.Tensor:
        """The module's parameters as one float32 vector (padded)."""
        flat = torch.zeros(self.padded, dtype=MASTER_DTYPE, device=self.device)
        i = 0
        for p, n in zip(self.params, self.numels):
            flat[i:i + n] = p.detach().reshape(-1)
            i += n
        return flat

    def flat_grads(self) -> torch.Tensor:
        """The gradients as one float32 vector (bf16 gradients are cast before any reduction)."""
        flat = torch.zeros(self.padded, dtype=MASTER_DTYPE, device=self.device)
        i = 0
        for p, n in zip(self.params, self.numels):
            if p.grad is not None:
                flat[i:i + n] = p.grad.reshape(-1)
            i += n
        return flat

    def state_bytes(self) -> int:
        """Bytes of the float32 master and Adam states this rank holds."""
        n = self.master.numel() * self.master.element_size()
        for state in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return n

    def move_to(self, device) -> None:
        """The float32 master and the Adam states to ``device`` (host memory between uses, as NeMo-RL's
        colocated policy keeps its optimizer while vLLM generates; back before training)."""
        device = torch.device(device)
        with torch.no_grad():
            self.master.data = self.master.data.to(device)
            for state in self.opt.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        state[key] = value.to(device)
        self.device = device

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _reduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return flat_grad
        if self.shard:
            out = torch.empty(self.shard_numel, dtype=flat_grad.dtype, device=flat_grad.device)
            _reduce_scatter(out, flat_grad, group=self.group)
            return out
        dist.all_reduce(flat_grad, group=self.group)
        return flat_grad

    def gather_flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full flat parameter vector from every rank's shard, in ``dtype`` (default: the
        master's float32; the module's bf16 halves the all-gather's bytes)."""
        shard = self.master.detach()
        if dtype is not None and dtype != shard.dtype:
            shard = shard.to(dtype)
        if not self.shard:
            return shard
        full = torch.empty(self.padded, dtype=shard.dtype, device=shard.device)
        _all_gather(full, shard.contiguous(), group=self.group)
        return full

    def write_params(self, flat: torch.Tensor) -> None:
        """Round the float32 vector ``flat`` into the module's parameters (of any dtype)."""
        with torch.no_grad():
            i = 0
            for p, n in zip(self.params, self.numels):
                p.copy_(flat[i:i + n].view_as(p))
                i += n

    def step(self, write_back: bool = True) -> list[Span]:
        """Synchronise gradients, update, and (``write_back``) refresh the module's parameters."""
        spans: list[Span] = []
        t0 = time.time()
        grad = self._reduce(self.flat_grads())
        t1 = time.time()
        if self.size > 1:
            spans.append(("reduce_scatter" if self.shard else "allreduce", t0, t1))
        self.master.grad = grad
        self.opt.step()
        self.master.grad = None
        t2 = time.time()
        spans.append(("optimizer", t1, t2))
        self.zero_grad()
        if write_back:
            self.write_params(self.gather_flat(self.params[0].dtype))
            if self.shard:
                spans.append(("allgather", t2, time.time()))
        return spans


class ShardedParams:
    """ZeRO-3 parameters: between uses each rank keeps only its optimizer shard; :meth:`gather`
    all-gathers them into the module and :meth:`release` frees the full copies."""

    def __init__(self, module: nn.Module, optimizer: FlatAdam, gathered: bool = True):
        self.module, self.opt = module, optimizer
        self.shapes = optimizer.shapes
        self.gathered = gathered

    def gather(self) -> float:
        """Materialise the full parameters; returns the bytes received."""
        if self.gathered:
            return 0.0
        flat = self.opt.gather_flat(self.opt.params[0].dtype)
        with torch.no_grad():
            i = 0
            for p, shape in zip(self.opt.params, self.shapes):
                n = shape.numel()
                p.data = flat[i:i + n].view(shape).to(p.dtype, copy=True)
                i += n
        self.gathered = True
        return float(flat.numel() - self.opt.shard_numel) * flat.element_size()

    def release(self) -> None:
        if not self.gathered:
            return
        for p in self.opt.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.gathered = False
