"""One device's worker process (a Ray actor): process groups, model replicas, task execution.

The driver (:class:`harness.backends.ray.RayBackend`) creates one ``DeviceWorker`` per device,
wires them into one ``torch.distributed`` job (gloo on CPU, NCCL on CUDA), hands every worker the
plan, then sends the devices of each task its typed requests (:mod:`harness.backends.ray.protocol`):
one worker method per request class, each answering with a ``Result``. A worker keeps, per
model role, a *home* replica in the layout where the model trains (actor, critic) or infers (ref,
reward), plus copies in the layouts of other tasks, which weight movements refresh.

CUDA set-up follows the torch.distributed docs: each worker makes the one GPU Ray gave it its
current device (``torch.cuda.set_device``, :func:`cuda_local_index`) before anything else touches
CUDA, and passes it as ``device_id`` to ``init_process_group`` (the NCCL communicator is then formed
at once, and sub-groups are split from it). ``batch_isend_irecv`` needs both: without the current
device set NCCL point-to-point traffic may hang, and the first collective call in a group must
involve all of its ranks -- but pipeline activations and weight reallocation are point-to-point
among a few ranks of the default group. So every worker takes part in one all-rank collective on
the default group right after ``init_process_group``, and every member of each sub-group in one on
that group right after it is created (:meth:`harness.backends.ray.comm.Groups.first_collective`),
before any point-to-point traffic. gloo (CPU workers) runs the same sequence without the CUDA steps.

:meth:`shutdown` ends cleanly: a barrier, then ``destroy_process_group`` (without it, gloo in
torch 2.13 aborts the process at exit).
"""
from __future__ import annotations

import datetime
import os
import resource
import socket
import time
from typing import Any

from harness.backends.ray.protocol import (CloseSession, Export, Generate, Infer, Migrate, Move, OpenSession,
                                           Release, Request, Result, State, Steps, Train)
from harness.plan import Allocation, Plan


def cuda_local_index(gpu_ids: list, visible: str | None) -> int:
    """This process's index of the one GPU Ray assigned to the worker (``ray.get_gpu_ids()``).

    Ray sets ``CUDA_VISIBLE_DEVICES`` of a GPU actor to the GPUs it was given, so the one GPU is index
    0; with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` it leaves the variable alone and the index
    is the GPU's position in it (or the id itself when the variable is unset)."""
    if len(gpu_ids) != 1:
        raise RuntimeError(f"a CUDA worker needs exactly one GPU from Ray, got {list(gpu_ids)} "
                           f"(ray.get_gpu_ids(); the driver asks for num_gpus=1 per worker)")
    gpu = str(gpu_ids[0])
    if visible is None:
        return int(gpu)
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if gpu not in listed:
        raise RuntimeError(f"Ray assigned GPU {gpu}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
    return listed.index(gpu)


def layout_key(alloc: Allocation) -> str:
    """Layouts that place the same pieces on the same devices share replicas: ZeRO stages 0-2
    differ only in how the optimizer is sharded, which matters to the home (training) replica alone."""
    s = alloc.strategy
    return f"{list(alloc.mesh)}:dp{s.dp}tp{s.tp}pp{s.pp}" + (":zero3" if s.zero_stage == 3 else "")


class DeviceWorker:
    def __init__(self, rank: int, world_size: int, options: dict[str, Any]):
        self.rank, self.world_size, self.options = rank, world_size, options
        self.use_cuda = options["device"] == "cuda"
        if not self.use_cuda:
            os.environ["DS_ACCELERATOR"] = "cpu"
        import torch

        torch.set_num_threads(int(options["torch_threads"]))
        self.device = torch.device("cpu")
        if self.use_cuda:  # the current device is set before anything touches CUDA or torch.distributed
            import ray

            self.device = torch.device("cuda", cuda_local_index(ray.get_gpu_ids(),
                                                                os.environ.get("CUDA_VISIBLE_DEVICES")))
            torch.cuda.set_device(self.device)
        # parameter/activation dtype of every replica (resolved by the driver: bf16 on CUDA, fp32 on CPU)
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[options.get("dtype", "fp32")]
        self.peak_state_bytes = 0  # largest model state (params + master + Adam) held at once
        self.replicas: dict[tuple[str, str], Any] = {}
        self.sessions: dict[str, Any] = {}  # generate task -> streamed generation session
        self.plan: Plan | None = None

    # ---- set-up -------------------------------------------------------------------------
    def address(self, multi_node: bool | None = None) -> tuple[str, int]:
        """This node's IP (127.0.0.1 when every worker is on one node) and a free TCP port for the
        rendezvous (asked of worker 0)."""
        if self.options.get("multi_node") if multi_node is None else multi_node:
            import ray

            ip = ray.util.get_node_ip_address()
        else:
            ip = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def init_distributed(self, ip: str, port: int, timeout_s: float) -> int:
        """Join the job's default process group, then take part in its first collective (every
        rank, before any point-to-point traffic: see the module docstring)."""
        import torch.distributed as dist

        from harness.backends.ray.comm import Groups

        os.environ.update(MASTER_ADDR=ip, MASTER_PORT=str(port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.device.index or 0))
        # on CUDA, device_id binds the group to this worker's GPU: NCCL connects now (eagerly) and
        # sub-groups are split from this communicator (torch.distributed.init_process_group docs)
        extra = {"device_id": self.device} if self.use_cuda else {}
        dist.init_process_group("nccl" if self.use_cuda else "gloo", init_method=f"tcp://{ip}:{port}",
                                rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **extra)
        Groups.first_collective(None, self.device)
        return self.rank

    def setup(self, plan_json: str, setup: dict[str, Any]) -> float:
        """Create process groups and the home replica of every model; returns seconds taken."""
        from harness.backends.ray.comm import Groups

        t0 = time.time()
        self.plan = Plan.from_json(plan_json)
        self.setup_info = setup
        self.groups = Groups(self.rank, self.world_size, [tuple(r) for r in setup["groups"]], self.device)
        for role, home in setup["homes"].items():
            alloc = home["allocation"]
            if self.rank in alloc.mesh:
                self._create(role, alloc, home)
        return time.time() - t0

    def _full_init_state(self, role: str):
        """Seeded random, or from the role's checkpoint (harness/backends/ray/checkpoints.py)."""
        from harness.backends.ray.checkpoints import initial_state

        return initial_state(self._args(role), self.setup_info["seeds"][role],
                             self.setup_info.get("checkpoints", {}).get(role))

    def _args(self, role: str):
        from harness.real.model import ModelArgs

        return ModelArgs(**self.setup_info["model_args"][role])

    def _create(self, role: str, alloc: Allocation, home: dict | None) -> Any:
        """A replica of ``role`` in ``alloc``: home replicas start from the seeded initial weights
        (and train if ``home['hparams']``), copies start empty and are filled by a weight movement."""
        from harness.backends.ray.replica import LocalReplica, NativeZero3Replica

        args = self._args(role)
        hparams = home.get("hparams") if home else None
        # seeded random weights are computed piece by piece on the replica (never the full model);
        # a checkpoint is read whole and sliced
        seeded = home is not None and not self.setup_info.get("checkpoints", {}).get(role)
        seed = self.setup_info["seeds"][role] if seeded else None
        if alloc.strategy.zero_stage == 3 and home is not None:
            if home["zero3_impl"] == "deepspeed":
                from harness.backends.ray.zero3 import DeepSpeedReplica

                state = self._full_init_state(role)  # DeepSpeed partitions the model it is given
                replica = DeepSpeedReplica(role, args, alloc, self.rank, self.groups, self.device, state, hparams,
                                           home.get("micro_batch_size", 1), home.get("grad_accum", 1),
                                           dtype=self.dtype)
                replica.lockstep = True
            else:
                state = None if seeded else self._full_init_state(role)
                replica = NativeZero3Replica(role, args, alloc, self.rank, self.groups, self.device, state, hparams,
                                             seed=seed, dtype=self.dtype)
        else:
            state = None if seeded or home is None else self._full_init_state(role)
            offloaded = home is not None and role in (self.plan.offloaded if self.plan else [])
            replica = LocalReplica(role, args, alloc, self.rank, self.groups, self.device, state, hparams,
                                   seed=seed, dtype=self.dtype, offloaded=offloaded)
        replica.engine_options = {"generation_engine": self.options.get("generation_engine", "ours"),
                                  "vllm": self.options.get("vllm") or {}}
        self.replicas[(role, layout_key(alloc))] = replica
        self._note_memory()
        return replica

    def _free(self, role: str, alloc: Allocation) -> int:
        """Free this device's copy of ``role`` in ``alloc`` (a layout whose phase has ended and that
        the plan does not keep resident); a later weight movement builds it again. Returns the
        bytes freed."""
        replica = self.replicas.pop((role, layout_key(alloc)), None)
        if replica is None:
            return 0
        freed = replica.state_bytes()
        replica.module = None
        replica.vllm_engine = None
        if self.use_cuda:
            import torch

            torch.cuda.empty_cache()
        return freed

    def replica(self, role: str, alloc: Allocation, create: bool = False):
        key = (role, layout_key(alloc))
        if key not in self.replicas:
            if not create:
                raise RuntimeError(f"device {self.rank} holds no {role} replica in layout {layout_key(alloc)}")
            return self._create(role, alloc, None)
        return self.replicas[key]

    # ---- requests (protocol.py), one method each ---------------------------------------------
    def _enter(self, req: Request) -> None:
        fault = self.options.get("fault_injection")
        if fault and fault.get("task") == req.task and fault.get("device") in (None, self.rank) \
                and fault.get("op") in (None, req.method):
            os._exit(17)  # test hook: die as a crashed worker would, without cleaning up

    @property
    def _in_order(self) -> bool:
        """Pipeline messages matched in posting order, as NCCL does (backend.options.p2p_matching)."""
        return self.options.get("p2p_matching", "in_order") == "in_order"

    def generate(self, req: Generate) -> Result:
        from harness.backends.ray import passes

        self._enter(req)
        return self._result(*passes.generate(self.replica(req.role, req.allocation), req))

    def infer(self, req: Infer) -> Result:
        from harness.backends.ray import passes

        self._enter(req)
        replica = self.replica(req.role, req.allocation)
        return self._result(*passes.infer(replica, req, self.setup_info["model_cfgs"][req.role], self._in_order))

    def train(self, req: Train) -> Result:
        """This device's share of a training stage: its replica of every model the stage trains
        here, running this device's logical rank's action list (one model, or two fused)."""
        from harness.backends.ray import pipeline

        self._enter(req)
        replicas = {role: self.replica(role, alloc) for role, alloc in req.allocations.items() if self.rank in alloc.mesh}
        cfgs = {r: self.setup_info["model_cfgs"][r] for r in replicas}
        spans, outs = pipeline.train(replicas, req, cfgs, self._in_order)
        return self._result([], outs, task_spans=spans)

    def move(self, req: Move) -> Result:
        from harness.backends.ray.movement import move_weights

        self._enter(req)
        source = self.replica(req.role, req.source) if self.rank in req.source.mesh else None
        target = self.replica(req.role, req.allocation, create=True) if self.rank in req.allocation.mesh else None
        return self._result(*move_weights(self, req.role, source, target, req.source, req.allocation))

    def state(self, req: State) -> Result:
        from harness.backends.ray.movement import gather_state

        self._enter(req)
        return self._result([], gather_state(self.replica(req.role, req.allocation)))

    def release(self, req: Release) -> Result:
        self._enter(req)
        return self._result([], {"freed_bytes": self._free(req.role, req.allocation)
                                 if self.rank in req.allocation.mesh else 0})

    # streamed generation (RLHFuse section 4): a session per generate task (streaming.py)
    def open_session(self, req: OpenSession) -> Result:
        from harness.backends.ray import streaming

        self._enter(req)
        self.sessions[req.task] = streaming.GenerationSession(self.replica(req.role, req.allocation), req)
        return self._result([], {"next_finish": self.sessions[req.task].next_finish()})

    def steps(self, req: Steps) -> Result:
        self._enter(req)
        return self._result(*self.sessions[req.task].steps(req.max_steps))

    def export(self, req: Export) -> Result:
        self._enter(req)
        return self._result([], self.sessions[req.task].export(req.with_kv))

    def migrate(self, req: Migrate) -> Result:
        from harness.backends.ray import streaming

        self._enter(req)
        return self._result(streaming.migrate(self.rank, self.sessions.get(req.task), req, self.device, self.dtype),
                            None)

    def close_session(self, req: CloseSession) -> Result:
        self._enter(req)
        self.sessions.pop(req.task, None)
        return self._result([], None)

    def _result(self, spans, out, task_spans: dict | None = None) -> Result:
        self._note_memory()
        return Result(self.rank, spans, out, self.memory_gb(), self.memory_stats(), task_spans)

    def _note_memory(self) -> None:
        now = sum(r.state_bytes() for r in self.replicas.values() if r.module is not None)
        # native ZeRO-3 holds its whole model while a task computes (released at the task's end)
        now += max((getattr(r, "gathered_peak_bytes", 0) for r in self.replicas.values()), default=0)
        self.peak_state_bytes = max(self.peak_state_bytes, now)

    def memory_gb(self) -> float:
        """Peak device memory: CUDA allocator peak, or the process's peak resident set on CPU."""
        if self.use_cuda:
            import torch

            return torch.cuda.max_memory_allocated() / 1e9
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9

    def memory_stats(self) -> dict[str, float]:
        """Peaks since the worker started, in GB, each named for what it measures:
        ``peak_allocated_gb`` (CUDA: ``torch.cuda.max_memory_allocated``), ``peak_rss_gb`` (CPU:
        the process's peak resident set, which includes the Python/torch runtime), and
        ``model_state_gb`` (both: the largest model state this worker held at once, counted from
        its tensors: parameters materialised on the device, float32 master weights and Adam
        states; native ZeRO-3's gathered parameters included)."""
        key = "peak_allocated_gb" if self.use_cuda else "peak_rss_gb"
        return {key: self.memory_gb(), "model_state_gb": self.peak_state_bytes / 1e9}

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return True
