"""The model replicas one device holds, by model role and layout, and the memory they take.

A device keeps, per model role, a *home* replica in the layout where the model trains (actor,
critic) or infers (ref, reward), plus copies in the layouts of other tasks, which weight movements
fill and the driver frees when their phase ends. Home replicas start from the role's seeded initial
weights (computed piece by piece, never the full model) or from its checkpoint (read whole and
sliced, :mod:`harness.real.checkpoints`); copies start empty.

``model_state_bytes`` is the largest model state (parameters materialised on the device, float32
master weights, Adam states; native ZeRO-3's gathered parameters included) held at once.
"""
from __future__ import annotations

from typing import Any

from harness.core.plan import Allocation, Plan


def layout_key(alloc: Allocation) -> str:
    """Layouts that place the same pieces on the same devices share replicas: ZeRO stages 0-2
    differ only in how the optimizer is sharded, which matters to the home (training) replica alone."""
    s = alloc.strategy
    return f"{list(alloc.mesh)}:dp{s.dp}tp{s.tp}pp{s.pp}" + (":zero3" if s.zero_stage == 3 else "")


class ReplicaStore:
    """``setup``: ``model_args``, ``seeds`` and optional ``checkpoints`` per role (the driver's
    :mod:`harness.backends.ray.driver.homes`); ``engine_options``: what the generation engine of every
    replica is (``generation_engine``, ``vllm``)."""

    def __init__(self, rank: int, device: Any, dtype: Any, groups: Any, plan: Plan, setup: dict[str, Any],
                 engine_options: dict[str, Any], release_cache: bool = False):
        self.rank, self.device, self.dtype, self.groups, self.plan = rank, device, dtype, groups, plan
        self.setup, self.engine_options, self.release_cache = setup, engine_options, release_cache
        self.replicas: dict[tuple[str, str], Any] = {}
        self.model_state_bytes = 0

    def args(self, role: str):
        from harness.real.model import ModelArgs

        return ModelArgs(**self.setup["model_args"][role])

    def full_init_state(self, role: str):
        """Seeded random, or from the role's checkpoint."""
        from harness.real.checkpoints import initial_state

        return initial_state(self.args(role), self.setup["seeds"][role], self.setup.get("checkpoints", {}).get(role))

    def create(self, role: str, alloc: Allocation, home: dict | None) -> Any:
        """A replica of ``role`` in ``alloc``: a home replica (``home``: its allocation, ``hparams`` if
        it trains, ``zero3_impl``, batch sizes) or an empty copy (``home=None``)."""
        from harness.real.parallel.replica import LocalReplica, NativeZero3Replica

        args = self.args(role)
        hparams = home.get("hparams") if home else None
        seeded = home is not None and not self.setup.get("checkpoints", {}).get(role)
        seed = self.setup["seeds"][role] if seeded else None
        common = (role, args, alloc, self.rank, self.groups, self.device)
        if alloc.strategy.zero_stage == 3 and home is not None:
            if home["zero3_impl"] == "deepspeed":
                from harness.real.parallel.zero3 import DeepSpeedReplica

                state = self.full_init_state(role)  # DeepSpeed partitions the model it is given
                replica = DeepSpeedReplica(*common, state, hparams, home.get("micro_batch_size", 1),
                                           home.get("grad_accum", 1), dtype=self.dtype)
                replica.lockstep = True
            else:
                state = None if seeded else self.full_init_state(role)
                replica = NativeZero3Replica(*common, state, hparams, seed=seed, dtype=self.dtype)
        else:
            state = None if seeded or home is None else self.full_init_state(role)
            offloaded = home is not None and role in (self.plan.offloaded if self.plan else [])
            replica = LocalReplica(*common, state, hparams, seed=seed, dtype=self.dtype, offloaded=offloaded)
        replica.engine_options = self.engine_options
        self.replicas[(role, layout_key(alloc))] = replica
        self.note_memory()
        return replica

    def get(self, role: str, alloc: Allocation, create: bool = False) -> Any:
        key = (role, layout_key(alloc))
        if key not in self.replicas:
            if not create:
                raise RuntimeError(f"device {self.rank} holds no {role} replica in layout {layout_key(alloc)}")
            return self.create(role, alloc, None)
        return self.replicas[key]

    def free(self, role: str, alloc: Allocation) -> int:
        """Free this device's copy of ``role`` in ``alloc``; a later weight movement builds it again.
        Returns the bytes freed."""
        replica = self.replicas.pop((role, layout_key(alloc)), None)
        if replica is None:
            return 0
        freed = replica.state_bytes()
        replica.module = None
        replica.vllm_engine = None
        if self.release_cache:
            import torch

            torch.cuda.empty_cache()
        return freed

    def note_memory(self) -> None:
        now = sum(r.state_bytes() for r in self.replicas.values() if r.module is not None)
        # native ZeRO-3 holds its whole model while a task computes (released at the task's end)
        now += max((getattr(r, "gathered_peak_bytes", 0) for r in self.replicas.values()), default=0)
        self.model_state_bytes = max(self.model_state_bytes, now)
