"""What a device worker of ``backend=ray`` is started and set up with: its options when the driver
creates it (:class:`WorkerOptions`, from the resolved ``backend.options``) and, once the plan is
known, the models it holds (:class:`WorkerSetup`). Frozen dataclasses, pickled by Ray as they are;
the requests that follow are :mod:`harness.backends.ray.protocol`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from harness.backends.ray.config import VllmOptions
from harness.core.plan import Allocation
from harness.costmodel.llama import ModelDims
from harness.real.model import ModelArgs


@dataclass(frozen=True)
class EngineOptions:
    """The generation engine of every replica on a worker: ``ours`` (:mod:`harness.real.engine`)
    or ``vllm`` with its options (docs/ENGINES.md)."""
    name: str = "ours"
    vllm: VllmOptions = field(default_factory=VllmOptions)


@dataclass(frozen=True)
class Fault:
    """Test hook (``backend.options.fault_injection``): the worker of ``device`` (None: every worker)
    exits without cleaning up when a request of ``task`` (with ``op``: only that worker method)
    reaches it."""
    task: str
    device: Optional[int] = None
    op: Optional[str] = None

    def hits(self, task: str, rank: int, method: str) -> bool:
        return self.task == task and self.device in (None, rank) and self.op in (None, method)


@dataclass(frozen=True)
class WorkerOptions:
    """A worker's options, resolved by the driver before it starts the workers."""
    device: str = "cpu"  # cpu | cuda
    dtype: str = "fp32"  # fp32 | bf16: every replica's parameter and activation dtype
    torch_threads: int = 1
    multi_node: bool = False  # rendezvous on the node's IP instead of 127.0.0.1
    engine: EngineOptions = field(default_factory=EngineOptions)
    # pipeline messages matched in posting order per rank pair, as NCCL does (else by tag, gloo only)
    p2p_in_order: bool = True
    fault: Optional[Fault] = None


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam's hyper-parameters of a trained model's home replica."""
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class HomeSetup:
    """A model's home replica: the layout of its training task (actor, critic) or of its first
    inference task (ref, reward), where the workers create it from its initial weights; its ZeRO-3
    engine (``deepspeed`` or ``native``: chosen by the driver); and for a trained model its optimizer,
    micro-batch size and gradient-accumulation steps."""
    allocation: Allocation
    zero3_impl: str = "native"
    optimizer: Optional[OptimizerSettings] = None
    micro_batch_size: int = 1
    grad_accum: int = 1


@dataclass(frozen=True)
class WorkerSetup:
    """What every worker needs to hold the plan's models, by model role: the process groups of the
    plan's meshes (``groups``, rank sets in creation order), each model's home, dimensions
    (``model_args``: what the worker builds; ``model_dims``: what its FLOPs are counted from), seed
    and checkpoint (:func:`harness.real.checkpoints.resolve_checkpoints`' spec; None: seeded)."""
    groups: tuple[tuple[int, ...], ...]
    homes: dict[str, HomeSetup]
    seeds: dict[str, int]
    model_args: dict[str, ModelArgs]
    model_dims: dict[str, ModelDims]
    checkpoints: dict[str, Optional[dict[str, Any]]] = field(default_factory=dict)
