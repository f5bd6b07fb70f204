"""One device's worker process (a Ray actor): process groups, model replicas, task execution.

The driver (:class:`harness.backends.ray.RayBackend`) creates one ``DeviceWorker`` per device,
wires them into one ``torch.distributed`` job (gloo on CPU, NCCL on CUDA), hands every worker the
plan, then sends the devices of each task its typed requests (:mod:`harness.backends.ray.protocol`):
one worker method per request class, each answering with a ``Result``. A worker's model replicas
(a home replica per role, copies in other tasks' layouts) are a
:class:`harness.real.parallel.store.ReplicaStore`.

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

import datetime
import os
import resource
import socket
import time
from typing import Any

from harness.backends.ray.protocol import (CloseSession, Export, Generate, Infer, Migrate, Move, OpenSession,
                                           Release, Request, Result, State, Steps, Train)
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
        self.store = None  # the device's model replicas (ReplicaStore), made by setup()
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

    def setup(self, plan_json: str, setup: dict[str, Any]) -> float:
        """Create process groups and the home replica of every model; returns seconds taken."""
        from harness.real.parallel.comm import Groups
        from harness.real.parallel.store import ReplicaStore

        t0 = time.time()
        self.plan = Plan.from_json(plan_json)
        self.setup_info = setup
        groups = Groups(self.rank, self.world_size, [tuple(r) for r in setup["groups"]], self.device)
        engine = {"generation_engine": self.options.get("generation_engine", "ours"),
                  "vllm": self.options.get("vllm") or {}}
        self.store = ReplicaStore(self.rank, self.device, self.dtype, groups, self.plan, setup, engine,
                                  release_cache=self.use_cuda)
        for role, home in setup["homes"].items():
            if self.rank in home["allocation"].mesh:
                self.store.create(role, home["allocation"], home)
        return time.time() - t0

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
        return self._result(*passes.generate(self.store.get(req.role, req.allocation), req))

    def infer(self, req: Infer) -> Result:
        from harness.backends.ray import passes

        self._enter(req)
        replica = self.store.get(req.role, req.allocation)
        return self._result(*passes.infer(replica, req, self.setup_info["model_cfgs"][req.role], self._in_order))

    def train(self, req: Train) -> Result:
        """This device's share of a training stage: its replica of every model the stage trains
        here, running this device's logical rank's action list (one model, or two fused)."""
        from harness.backends.ray import pipeline

        self._enter(req)
        replicas = {role: self.store.get(role, alloc) for role, alloc in req.allocations.items() if self.rank in alloc.mesh}
        cfgs = {r: self.setup_info["model_cfgs"][r] for r in replicas}
        spans, outs = pipeline.train(replicas, req, cfgs, self._in_order)
        return self._result([], outs, task_spans=spans)

    def move(self, req: Move) -> Result:
        from harness.real.parallel.movement import move_weights

        self._enter(req)
        source = self.store.get(req.role, req.source) if self.rank in req.source.mesh else None
        target = self.store.get(req.role, req.allocation, create=True) if self.rank in req.allocation.mesh else None
        return self._result(*move_weights(self.store, req.role, source, target, req.source, req.allocation))

    def state(self, req: State) -> Result:
        from harness.real.parallel.movement import gather_state

        self._enter(req)
        return self._result([], gather_state(self.store.get(req.role, req.allocation)))

    def release(self, req: Release) -> Result:
        self._enter(req)
        return self._result([], {"freed_bytes": self.store.free(req.role, req.allocation)
                                 if self.rank in req.allocation.mesh else 0})

    # streamed generation (RLHFuse section 4): a session per generate task (streaming.py)
    def open_session(self, req: OpenSession) -> Result:
        from harness.backends.ray import streaming

        self._enter(req)
        self.sessions[req.task] = streaming.GenerationSession(self.store.get(req.role, req.allocation), req)
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
        self.store.note_memory()
        return Result(self.rank, spans, out, self.memory_gb(), self.memory_stats(), task_spans)

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
        state = self.store.model_state_bytes if self.store is not None else 0
        return {key: self.memory_gb(), "model_state_gb": state / 1e9}

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return True
