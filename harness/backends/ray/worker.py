"""One device's worker process (a Ray actor): process groups, model replicas, task execution.

The driver (:class:`harness.backends.ray.RayBackend`) creates one ``DeviceWorker`` per device,
wires them into one ``torch.distributed`` job (gloo on CPU, NCCL on CUDA), hands every worker the
plan, then calls :meth:`DeviceWorker.run` on the devices of each task's mesh. A worker keeps, per
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

from harness.plan import Allocation, ParallelStrategy, Plan

SpanT = tuple[str, float, float, float, float]


def alloc_from_dict(d: dict) -> Allocation:
    return Allocation(tuple(d["mesh"]), ParallelStrategy(**d["strategy"]))


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
            alloc = alloc_from_dict(home["allocation"])
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

    def release(self, role: str, alloc: Allocation) -> int:
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

    # ---- tasks --------------------------------------------------------------------------
    def run(self, spec: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
        """Execute one task's share on this device: ``spec['op']`` is generate, infer, train,
        move (weight movement) or state (weights for the driver's digest)."""
        from harness.backends.ray import passes, pipeline
        from harness.backends.ray.movement import gather_state, move_weights

        fault = self.options.get("fault_injection")
        if fault and fault.get("task") == spec["task"] and fault.get("device") in (None, self.rank) \
                and fault.get("op") in (None, spec["op"]):
            os._exit(17)  # test hook: die as a crashed worker would, without cleaning up
        op, role = spec["op"], spec["role"]
        if isinstance(payload, dict):  # pipeline messages matched as backend.options.p2p_matching says (comm.PipeChannel)
            payload = {**payload, "p2p_in_order": self.options.get("p2p_matching", "in_order") == "in_order"}
        alloc = alloc_from_dict(spec["allocation"])
        model_cfg = self.setup_info["model_cfgs"][role]
        if op == "move":
            source = self.replica(role, alloc_from_dict(spec["source"])) if self.rank in spec["source"]["mesh"] else None
            target = self.replica(role, alloc, create=True) if self.rank in alloc.mesh else None
            spans, out = move_weights(self, role, source, target, alloc_from_dict(spec["source"]), alloc)
        elif op == "train_fused":
            return self._train_fused(payload)
        elif op.startswith("gen_"):
            return self._generation_session(op, spec, payload, alloc)
        elif op == "state":
            spans, out = [], gather_state(self.replica(role, alloc))
        elif op == "release":
            spans, out = [], {"freed_bytes": self.release(role, alloc) if self.rank in alloc.mesh else 0}
        else:
            fn = {"generate": passes.generate, "infer": passes.infer, "train": pipeline.train}[op]
            replica = self.replica(role, alloc)
            spans, out = fn(replica, payload) if op == "generate" else fn(replica, payload, model_cfg)
        return self._result(spans, out)

    def _generation_session(self, op: str, spec: dict, payload: dict[str, Any], alloc) -> dict[str, Any]:
        """Streamed generation (RLHFuse section 4): open a session, advance it, export its tail,
        migrate KV caches, close it (:mod:`harness.backends.ray.streaming`)."""
        from harness.backends.ray import streaming

        task = spec["task"]
        spans, out = [], None
        if op == "gen_open":
            self.sessions[task] = streaming.GenerationSession(self.replica("actor", alloc), payload)
            out = {"next_finish": self.sessions[task].next_finish()}
        elif op == "gen_steps":
            spans, out = self.sessions[task].steps(int(payload["max_steps"]))
        elif op == "gen_export":
            out = self.sessions[task].export(bool(payload["with_kv"]))
        elif op == "gen_migrate":
            spans = streaming.migrate(self.rank, self.sessions.get(task), payload, self.device, self.dtype)
        elif op == "gen_close":
            self.sessions.pop(task, None)
        else:
            raise ValueError(f"unknown generation op {op!r}")
        return self._result(spans, out)

    def _train_fused(self, payload: dict[str, Any]) -> dict[str, Any]:
        """This device's share of a fused training stage: its replica of every model it trains."""
        from harness.backends.ray import pipeline

        replicas = {}
        for role in payload["roles"]:
            alloc = alloc_from_dict(payload["allocations"][role])
            if self.rank in alloc.mesh:
                replicas[role] = self.replica(role, alloc)
        p = {**payload, "actions": payload["actions_by_device"][str(self.rank)]}
        spans, outs = pipeline.train_fused(replicas, p, {r: self.setup_info["model_cfgs"][r] for r in replicas})
        return {**self._result([], outs), "task_spans": spans}

    def _result(self, spans, out) -> dict[str, Any]:
        self._note_memory()
        return {"rank": self.rank, "spans": spans, "out": out, "memory_gb": self.memory_gb(),
                "memory": self.memory_stats()}

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
