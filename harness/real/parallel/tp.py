"""Tensor parallelism for :class:`harness.real.model.PipelineStage` modules built by
:func:`harness.real.parallel.layout.build_local_module` (Megatron-LM, Shoeybi et al. 2019, section 3).

Each decoder layer's attention and MLP get the two conjugate operators of the paper's Figure 3:
``f`` at the block input (identity forward, all-reduce of the input gradient backward) and ``g``
after the row-parallel output projection (all-reduce forward, identity backward). They are
attached as module hooks, so the model code stays the single-device code. With these, the residual
stream, norms, embedding and head see identical values and gradients on every tp rank; only
key/value weights replicated over several ranks (``tp > num_kv_heads``) need their gradients
summed over the tp group (:func:`sync_shared_kv_grads`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness.real.parallel.layout import head_ranges, is_shared_kv
from harness.real.model import ModelArgs, PipelineStage


class _CopyToTP(torch.autograd.Function):
    """``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def install_tp_hooks(stage: PipelineStage, group) -> list:
    """Attach ``f``/``g`` to every layer of ``stage``; returns the hook handles."""
    handles = []

    def pre(_module, args, kwargs=None):
        return (_CopyToTP.apply(args[0], group),) + tuple(args[1:])

    def post(_module, _args, output):
        return _ReduceFromTP.apply(output, group)

    for layer in stage.layers.values():
        handles.append(layer.attn.register_forward_pre_hook(pre))
        handles.append(layer.mlp.register_forward_pre_hook(pre))
        handles.append(layer.attn.wo.register_forward_hook(post))
        handles.append(layer.mlp.w_down.register_forward_hook(post))
    return handles


def sync_shared_kv_grads(stage: nn.Module, args: ModelArgs, tp: int, t: int, group) -> None:
    """Sum the gradients of key/value heads that several tp ranks hold (``tp > num_kv_heads``):
    each rank places its heads' gradient in a buffer of all kv heads, one all-reduce sums them."""
    if tp <= args.num_kv_heads:
        return
    d = args.dim_per_head
    _, _, k0, k1 = head_ranges(args, tp, t)
    for name, p in sorted(stage.named_parameters()):
        if not is_shared_kv(name, args, tp) or p.grad is None:
            continue
        full = torch.zeros((args.num_kv_heads * d,) + tuple(p.shape[1:]), dtype=p.grad.dtype, device=p.grad.device)
        full[k0 * d:k1 * d] = p.grad
        dist.all_reduce(full, group=group)
        # ranks sharing a head each added the same head's gradient once: the sum is the full gradient
        p.grad.copy_(full[k0 * d:k1 * d])
