"""One device's worker process (a Ray actor): process groups, model replicas, task execution.

The driver (:class:`harness.backends.ray.driver.backend.RayBackend`) creates one ``DeviceWorker`` per device with
its :class:`~harness.backends.ray.settings.WorkerOptions`, wires them into one ``torch.distributed``
job (gloo on CPU, NCCL on CUDA), hands every worker the plan and its
:class:`~harness.backends.ray.settings.WorkerSetup`, then sends the devices of each task its typed
requests (:mod:`harness.backends.ray.protocol`): one worker method per request class, each
answering with a :class:`~harness.backends.ray.replies.Result` holding that method's typed output
(:mod:`harness.backends.ray.replies`). A worker's model replicas (a home replica per role, copies in
other tasks' layouts) are a :class:`harness.real.parallel.store.ReplicaStore`.

CUDA set-up follows the torch.distributed docs: each worker makes the one GPU Ray gave it its
current device (``torch.cuda.set_device``, :func:`cuda_local_index`) before anything else touches
CUDA, and passes it as ``device_id`` to ``init_process_group`` (the NCCL communicator is then formed
at once, and sub-groups are split from it). ``batch_isend_irecv`` needs both: without the current
device set NCCL point-to-point traffic may hang, and the first collective call in a group must
involve all of its ranks -- but pipeline activations and weight reallocation are point-to-point
among a few ranks of the default group. So every worker takes part in one all-rank collective on
the default group right after ``init_process_group``, and every member of each sub-group in one on
that group right after it is created (:meth:`harness.real.parallel.comm.Groups.first_collective`),
before any point-to-point traffic. gloo (CPU workers) runs the same sequence without the CUDA steps.

:meth:`shutdown` ends cleanly: a barrier, then ``destroy_process_group`` (without it, gloo in
torch 2.13 aborts the process at exit).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import resource
import socket
import time
from typing import Any

from harness.backends.ray.protocol import (CloseSession, Export, Generate, Infer, Migrate, Move, OpenSession,
                                           Release, Request, State, Steps, Submit, Train)
from harness.backends.ray.replies import (Exported, Generated, Inferred, MemoryPeaks, Moved, Released, Result,
                                          SessionProgress, StatePiece, Trained)
from harness.backends.ray.settings import HomeSetup, WorkerOptions, WorkerSetup
from harness.backends.ray.worker import passes, pipeline, streaming
from harness.core.plan import Plan


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


def store_setup(setup: WorkerSetup) -> dict[str, Any]:
    """``setup`` in the form :class:`harness.real.parallel.store.ReplicaStore` reads it."""
    return {"model_args": {role: dataclasses.asdict(a) for role, a in setup.model_args.items()},
            "seeds": dict(setup.seeds), "checkpoints": dict(setup.checkpoints)}


def store_home(home: HomeSetup) -> dict[str, Any]:
    """A home replica in the form :meth:`harness.real.parallel.store.ReplicaStore.create` reads it."""
    out: dict[str, Any] = {"allocation": home.allocation, "zero3_impl": home.zero3_impl}
    if home.optimizer is not None:
        out["hparams"] = dataclasses.asdict(home.optimizer)
        out.update(micro_batch_size=home.micro_batch_size, grad_accum=home.grad_accum)
    return out


class DeviceWorker:
    def __init__(self, rank: int, world_size: int, options: WorkerOptions):
        self.rank, self.world_size, self.options = rank, world_size, options
        self.use_cuda = options.device == "cuda"
        if not self.use_cuda:
            os.environ["DS_ACCELERATOR"] = "cpu"
        import torch

        torch.set_num_threads(int(options.torch_threads))
        self.device = torch.device("cpu")
        if self.use_cuda:  # the current device is set before anything touches CUDA or torch.distributed
            import ray

            self.device = torch.device("cuda", cuda_local_index(ray.get_gpu_ids(),
                                                                os.environ.get("CUDA_VISIBLE_DEVICES")))
            torch.cuda.set_device(self.device)
        # parameter/activation dtype of every replica (resolved by the driver: bf16 on CUDA, fp32 on CPU)
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[options.dtype]
        self.store = None  # the device's model replicas (ReplicaStore), made by setup()
        self.setup_info: WorkerSetup | None = None
        self.sessions: dict[str, streaming.GenerationSession] = {}  # generate task -> its session here
        self.plan: Plan | None = None

    # ---- set-up -------------------------------------------------------------------------
    def address(self, multi_node: bool | None = None) -> tuple[str, int]:
        """This node's IP (127.0.0.1 when every worker is on one node) and a free TCP port for the
        rendezvous (asked of worker 0)."""
        if self.options.multi_node if multi_node is None else multi_node:
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

        from harness.real.parallel.comm import Groups

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

    def setup(self, plan_json: str, setup: WorkerSetup) -> float:
        """Create process groups and the home replica of every model; returns seconds taken."""
        from harness.real.parallel.comm import Groups
        from harness.real.parallel.store import ReplicaStore

        t0 = time.time()
        self.plan = Plan.from_json(plan_json)
        self.setup_info = setup
        groups = Groups(self.rank, self.world_size, [tuple(r) for r in setup.groups], self.device)
        self.store = ReplicaStore(self.rank, self.device, self.dtype, groups, self.plan, store_setup(setup),
                                  self.options.engine, release_cache=self.use_cuda)
        for role, home in setup.homes.items():
            if self.rank in home.allocation.mesh:
                self.store.create(role, home.allocation, store_home(home))
        return time.time() - t0

    # ---- requests (protocol.py), one method each ---------------------------------------------
    def _enter(self, req: Request) -> None:
        fault = self.options.fault
        if fault is not None and fault.hits(req.task, self.rank, req.method):
            os._exit(17)  # test hook: die as a crashed worker would, without cleaning up

    def generate(self, req: Generate) -> Result[Generated]:
        self._enter(req)
        return self._result(*passes.generate(self.store.get(req.role, req.allocation), req))

    def infer(self, req: Infer) -> Result[Inferred]:
        self._enter(req)
        replica = self.store.get(req.role, req.allocation)
        return self._result(*passes.infer(replica, req, self.setup_info.model_dims[req.role],
                                          self.options.p2p_in_order))

    def train(self, req: Train) -> Result[Trained]:
        """This device's share of a training stage: its replica of every model the stage trains
        here, running this device's logical rank's action list (one model, or two fused)."""
        self._enter(req)
        replicas = {role: self.store.get(role, alloc) for role, alloc in req.allocations.items() if self.rank in alloc.mesh}
        dims = {r: self.setup_info.model_dims[r] for r in replicas}
        return self._result([], pipeline.train(replicas, req, dims, self.options.p2p_in_order))

    def move(self, req: Move) -> Result[Moved]:
        from harness.real.parallel.movement import move_weights

        self._enter(req)
        source = self.store.get(req.role, req.source) if self.rank in req.source.mesh else None
        target = self.store.get(req.role, req.allocation, create=True) if self.rank in req.allocation.mesh else None
        spans, out = move_weights(self.store, req.role, source, target, req.source, req.allocation)
        return self._result(spans, Moved(out["bytes"]))

    def state(self, req: State) -> Result[StatePiece]:
        from harness.real.parallel.movement import gather_state

        self._enter(req)
        piece = gather_state(self.store.get(req.role, req.allocation))
        return self._result([], None if piece is None else StatePiece(tuple(piece["coord"]), piece["state"]))

    def release(self, req: Release) -> Result[Released]:
        self._enter(req)
        return self._result([], Released(self.store.free(req.role, req.allocation)
                                         if self.rank in req.allocation.mesh else 0))

    # streamed generation (RLHFuse section 4): a session per generate task (streaming.py)
    def open_session(self, req: OpenSession) -> Result[SessionProgress]:
        self._enter(req)
        session = streaming.GenerationSession(self.store.get(req.role, req.allocation), req)
        self.sessions[req.task] = session
        return self._result([], session.progress([]))

    def submit(self, req: Submit) -> Result[SessionProgress]:
        self._enter(req)
        return self._result([], self.sessions[req.task].submit(req))

    def steps(self, req: Steps) -> Result[SessionProgress]:
        self._enter(req)
        return self._result(*self.sessions[req.task].steps(req.max_steps))

    def export(self, req: Export) -> Result[Exported]:
        self._enter(req)
        return self._result([], self.sessions[req.task].export(req.with_kv))

    def migrate(self, req: Migrate) -> Result[None]:
        self._enter(req)
        return self._result(streaming.migrate(self.rank, self.sessions.get(req.task), req, self.device, self.dtype),
                            None)

    def close_session(self, req: CloseSession) -> Result[None]:
        self._enter(req)
        self.sessions.pop(req.task, None)
        return self._result([], None)

    def _result(self, spans: list, out: Any) -> Result:
        self.store.note_memory()
        return Result(self.rank, spans, out, self.memory_peaks())

    def memory_peaks(self) -> MemoryPeaks:
        """Peaks since the worker started (:class:`~harness.backends.ray.replies.MemoryPeaks`): CUDA's
        ``torch.cuda.max_memory_allocated``, or on CPU the process's peak resident set; and the
        largest model state this worker held at once."""
        if self.use_cuda:
            import torch

            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        state = self.store.model_state_bytes if self.store is not None else 0
        return MemoryPeaks(peak / 1e9, state / 1e9, self.use_cuda)

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return True
