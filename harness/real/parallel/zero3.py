"""ZeRO-3 with DeepSpeed (Rajbhandari et al. 2020; DeepSpeed-Chat, Yao et al. 2023, section 4).

A :class:`DeepSpeedReplica` wraps the whole model in a DeepSpeed engine with
``zero_optimization.stage = 3`` over the task's mesh, as DeepSpeed-Chat does for actor and critic
training (with an optimizer) and for reference/reward inference (without one). DeepSpeed gathers
each layer's parameters around its forward and backward and reduce-scatters gradients; we pass
our own ``torch.optim.Adam`` as the client optimizer.

Loss scaling: ``engine.backward`` divides the loss by ``gradient_accumulation_steps`` and the
gradient reduction averages over the dp ranks (DeepSpeed config docs, "gradient_accumulation_steps";
ZeRO's reduce-scatter averages), so the loss is multiplied by ``dp * gas`` to obtain the summed
gradient that the other layouts compute. ``stage3_param_persistence_threshold = 0`` makes DeepSpeed
partition even small parameters (its default keeps parameters under 1e5 elements whole on every
rank, which for the tiny test models would be all of them).

Precision: in bf16 runs (``backend.options.dtype=bf16``, the default on CUDA) the engine runs in
DeepSpeed's own bf16 mode (``"bf16": {"enabled": true}``, DeepSpeed config docs, "BFLOAT16 training
options"): the module's parameters are bf16 and DeepSpeed's ZeRO-3 optimizer keeps the float32 master
partition and hands our Adam float32 parameters, so its states are float32 as well. Gradients are
reduce-scattered and accumulated in float32 (``communication_data_type`` and
``data_types.grad_accum_dtype``), as the native ZeRO-3 does (harness/real/parallel/optim.py), so the two
differ only in summation order and rounding. DeepSpeed's CPU accelerator supports bf16
(``is_bf16_supported``), which is how CI tests this path.

On CPU, DeepSpeed needs ``DS_ACCELERATOR=cpu`` (set by the worker before import) and we keep it
from JIT-compiling its shared-memory all-reduce kernel, which only its inference kernels use.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch import Tensor

from harness.real.parallel.layout import build_local_module, load_pieces
from harness.real.parallel.replica import Replica

Span = tuple[str, float, float]


def deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (checked without importing it in the driver)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _import_deepspeed():
    import importlib

    import deepspeed
    from deepspeed.utils import logger

    # ``import deepspeed.comm.torch as m`` would bind the torch package (deepspeed.comm re-exports it)
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")

    logger.setLevel(logging.WARNING)
    # DeepSpeed's CPU shared-memory all-reduce kernel (deepspeed/comm/torch.py, build_shm_op) is
    # JIT-compiled on first use (~30 s, needs a C++ toolchain) and serves only inference_all_reduce,
    # which ZeRO-3 never calls: skip building it.
    ds_torch_comm.build_shm_op = lambda: None
    return deepspeed


def ds_config(micro_batch_size: int, grad_accum: int, dp: int, dtype: torch.dtype = torch.float32) -> dict:
    """The DeepSpeed config of one ZeRO-3 engine; ``dtype=torch.bfloat16`` turns on DeepSpeed's bf16
    mode with float32 master weights, gradient reduction and accumulation."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * dp,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": False},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if dtype == torch.bfloat16:
        config.update({"bf16": {"enabled": True}, "communication_data_type": "fp32",
                       "data_types": {"grad_accum_dtype": "fp32"}})
    elif dtype != torch.float32:
        raise ValueError(f"DeepSpeed ZeRO-3 here runs in float32 or bf16, not {dtype}")
    return config


class DeepSpeedReplica(Replica):
    def __init__(self, role, args, alloc, rank, groups, device, full_state: dict[str, Tensor],
                 hparams: dict | None = None, micro_batch_size: int = 1, grad_accum: int = 1,
                 dtype: torch.dtype = torch.float32):
        super().__init__(role, args, alloc, rank, groups, device)
        self.dtype = dtype  # DeepSpeed casts the module to bf16 itself (its master stays float32)
        deepspeed = _import_deepspeed()
        self._ds = deepspeed
        with torch.device("meta"):
            module = build_local_module(args, 1, 0, 1)
        module.to_empty(device=device)
        load_pieces(module, full_state, args, 1, 0)
        dp = self.strategy.dp
        self.scale = float(dp * grad_accum)
        optimizer = None
        if hparams is not None:
            self.trainable = True
            optimizer = torch.optim.Adam(module.parameters(), lr=hparams["lr"], betas=hparams["betas"],
                                         eps=hparams["eps"], weight_decay=hparams["weight_decay"], foreach=False)
        self.engine, *_ = deepspeed.initialize(
            model=module, optimizer=optimizer,
            config=ds_config(micro_batch_size if optimizer else 1, grad_accum if optimizer else 1, dp, dtype))
        self.module = self.engine.module

    def __call__(self, x: Tensor, **kwargs) -> Tensor:
        return self.engine(x, **kwargs)

    def set_train(self, mode: bool) -> None:
        self.engine.train(mode)

    def backward(self, loss: Tensor, output: Tensor | None = None, grad: Tensor | None = None) -> None:
        self.engine.backward(loss * self.scale)

    def micro_step(self) -> list[Span]:
        boundary = self.engine.is_gradient_accumulation_boundary()
        t0 = time.time()
        self.engine.step()
        return [("optimizer", t0, time.time())] if boundary else []

    @contextlib.contextmanager
    def gathered(self):
        with self._ds.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
            yield

    def gathered_state(self) -> dict[str, Tensor]:
        """The whole model on every rank of the mesh (a collective: all of them must call)."""
        with self.gathered():
            return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def full_state(self) -> dict[str, Tensor] | None:
        state = self.gathered_state()
        return state if self.rank == min(self.alloc.mesh) else None
