"""Ray and the device workers of ``backend=ray``: start or join Ray, place one worker per device,
wire the workers into one ``torch.distributed`` job, and take them down again.

The driver starts its own local Ray instance (``backend.address`` null, whatever other Ray runs on
the machine) or joins the cluster ``backend.address`` names; it then reserves one bundle per device
(1 GPU, or 1 logical CPU on a CPU run) in a placement group packed onto as few nodes as possible, in
rank order, so consecutive ranks (tp groups) share a node, and creates one
:class:`~harness.backends.ray.worker.device.DeviceWorker` per bundle with its
:class:`~harness.backends.ray.settings.WorkerOptions` (:func:`worker_options`). A cluster without the devices is
refused before any worker starts, and so is an embedded Ray with more CPU workers than
:func:`embedded_worker_cap` allows on this machine.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from harness.backends.ray.config import RayOptions, VllmOptions
from harness.backends.ray.driver.calls import WorkerFailedError, WorkerGroup
from harness.backends.ray.settings import EngineOptions, Fault, WorkerOptions
from harness.backends.ray.worker.device import DeviceWorker
from harness.errors import ConfigError


# CPU worker processes the embedded local Ray may start per CPU core of this machine. Each worker is a
# Python process with torch (about 0.3 GB before any model) that takes part in every collective of
# its task's mesh, so past a few per core every collective waits on time-sliced peers; 16 workers
# on 2 cores (a tiny model) ran an iteration in about 2.5 minutes.
EMBEDDED_WORKERS_PER_CPU = 8


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def embedded_worker_cap() -> int:
    """The most CPU workers the embedded local Ray starts on this machine."""
    return EMBEDDED_WORKERS_PER_CPU * usable_cpus()


def embedded_workers_problem(num_workers: int) -> str | None:
    """Why the embedded local Ray should not start ``num_workers`` CPU worker processes here (one
    phrase), or None."""
    cap = embedded_worker_cap()
    if num_workers <= cap:
        return None
    return (f"the embedded local Ray (backend.address null) would start {num_workers} CPU worker processes "
            f"(one per device: cluster.num_nodes x cluster.gpus_per_node) on this machine, but it starts at most "
            f"{cap} ({EMBEDDED_WORKERS_PER_CPU} per CPU core, {usable_cpus()} cores); use fewer devices, or a Ray "
            f"cluster with {num_workers} CPUs (`ray start --head --num-cpus=...` on its nodes) and "
            f"backend.address=auto (or <host>:<port>)")


def vllm_memory_share(vllm: VllmOptions, memory_frac: float | None, device: str | None) -> VllmOptions:
    """The vLLM options the workers start with: on CUDA a plan's generation memory share
    (``GenerationPolicy.memory_frac``, a system's ``gpu_memory_utilization``, with which the
    simulator sized the KV cache) replaces ``backend.options.vllm.gpu_memory_utilization``, so both
    backends run the plan's share; on CPU vLLM's share is of host memory, not the GPU's, so the
    option stays."""
    if memory_frac is None or device != "cuda":
        return vllm
    return dataclasses.replace(vllm, gpu_memory_utilization=float(memory_frac))


def worker_options(opts: RayOptions) -> WorkerOptions:
    """What every worker is created with, from ``backend.options`` once the driver has resolved the
    device and dtype (:meth:`harness.backends.ray.driver.backend.RayBackend.setup`)."""
    fault = opts.fault_injection
    return WorkerOptions(device=opts.device, dtype=opts.dtype, torch_threads=opts.torch_threads,
                         multi_node=opts.multi_node,
                         engine=EngineOptions(opts.generation_engine, dataclasses.replace(opts.vllm)),
                         p2p_in_order=opts.p2p_matching == "in_order",
                         fault=Fault(fault.task, fault.device, fault.op) if fault.task is not None else None)


class Cluster:
    def __init__(self, address: str | None, opts):
        self.address, self.opts = address, opts
        self.ray = None
        self.started_ray = False
        self.pg = None  # the placement group holding one bundle per device
        self.nodes: list[str] = []

    def device(self) -> str | None:
        """The worker device; ``auto`` is cuda when the machine (or, joining a cluster, the
        cluster) has GPUs: None while joining a cluster has not happened yet."""
        if self.opts.device != "auto":
            return self.opts.device
        if self.address is not None:
            if self.ray is not None and self.ray.is_initialized():
                return "cuda" if self.ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
            return None
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def start_ray(self, num_devices: int, use_cuda: bool):
        try:
            import ray
        except ImportError as e:
            raise ConfigError("backend=ray needs Ray: pip install -e '.[ray]'") from e
        self.ray = ray
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(log_to_driver=True, logging_level="WARNING")
            if self.address is None:
                # embedded: a new local Ray instance of our own, one logical CPU per device process.
                # address="local" starts one even when a cluster runs on this machine: neither the one
                # `ray start` last started (its address in /tmp/ray/ray_current_cluster) nor RAY_ADDRESS
                # (which ray.init follows only for address None or "auto") is joined by accident
                kwargs.update(address="local", num_cpus=max(num_devices, 1), num_gpus=None if use_cuda else 0,
                              include_dashboard=False)
            else:
                kwargs["address"] = self.address
                import harness  # a cluster's workers import this checkout (as installed, or from its path)

                root = str(Path(harness.__file__).resolve().parent.parent)
                kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": root}}
            self._probe_address()
            try:
                ray.init(**kwargs)
            except ConnectionError as e:
                raise ConfigError(f"backend.address={self.address}: no Ray cluster to join ({e}); start one with "
                                  f"`ray start --head --num-cpus=<devices>` (or --num-gpus) first, or leave "
                                  f"backend.address null for an embedded local Ray") from None
            self.started_ray = True
        return ray

    def _probe_address(self) -> None:
        """A ``<host>:<port>`` nobody listens on fails at once (ray.init would retry for minutes)."""
        if self.address is None or self.address == "auto" or self.address.startswith("ray://"):
            return
        import socket

        host, _, port = self.address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as e:
            raise ConfigError(f"backend.address={self.address}: no Ray cluster to join ({e}); start one with "
                              f"`ray start --head --num-cpus=<devices>` (or --num-gpus) first, or leave "
                              f"backend.address null for an embedded local Ray") from None

    def _place(self, n: int, device: str) -> list:
        """One bundle per device, packed, in rank order; refuses a cluster without ``n`` devices."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        key = "GPU" if device == "cuda" else "CPU"
        have = ray.cluster_resources().get(key, 0)
        if have < n:
            where = f"the Ray cluster at {self.address}" if self.address else "the local Ray"
            raise ConfigError(f"backend=ray needs {n} {key}s (one worker per device: cluster.num_nodes x "
                              f"cluster.gpus_per_node), but {where} has {have:g}; start it with "
                              f"`ray start --head --num-{key.lower()}s={n}` or add nodes")
        bundle = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.opts.setup_timeout_s)
        if not ready:
            raise WorkerFailedError(f"the cluster did not grant {n} {key} bundles within "
                                    f"{self.opts.setup_timeout_s:.0f} s (backend.options.setup_timeout_s)")
        return [PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)
                for i in range(n)]

    def spawn(self, n: int, device: str) -> WorkerGroup:
        """Start ``n`` workers (one per device), rendezvous, and join them into one process group."""
        ray = self.start_ray(n, device == "cuda")
        resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        placement = self._place(n, device)
        actor_cls = ray.remote(DeviceWorker)
        opts = worker_options(self.opts)
        workers = [actor_cls.options(max_restarts=0, max_task_retries=0, scheduling_strategy=placement[rank],
                                     **resources).remote(rank, n, opts) for rank in range(n)]
        group = WorkerGroup(ray, workers, [], self.opts.task_timeout_s)
        timeout, everyone = self.opts.setup_timeout_s, list(range(n))
        group.pids = group.wait([w.pid.remote() for w in workers], everyone, "start workers", timeout)
        self.nodes = group.wait([w.node.remote() for w in workers], everyone, "start workers", timeout)
        spread = len(set(self.nodes)) > 1  # several nodes: rendezvous on worker 0's node IP
        multi_node = spread if self.address is not None else None  # None: backend.options.multi_node decides
        ip, port = group.wait([workers[0].address.remote(multi_node)], [0], "rendezvous", timeout)[0]
        group.wait([w.init_distributed.remote(ip, port, self.opts.collective_timeout_s) for w in workers],
                   everyone, "init_process_group", timeout)
        return group

    def close(self, group: WorkerGroup | None) -> None:
        """Shut the workers down cleanly (barrier, destroy_process_group) when they are healthy,
        else kill them; give the devices back; stop the Ray this driver started."""
        ray = self.ray
        if ray is None:
            return
        try:
            workers = group.workers if group is not None else []
            if workers and group.healthy:
                try:
                    done = group.wait([w.shutdown.remote() for w in workers], list(range(len(workers))),
                                      "shutdown", self.opts.shutdown_timeout_s)
                    print(f"[harness] backend=ray: {sum(done)} workers shut down cleanly "
                          f"(barrier, destroy_process_group)")
                except WorkerFailedError as e:
                    print(f"[harness] backend=ray: shutdown incomplete ({e}); killing the workers")
            for w in workers:
                try:
                    ray.kill(w, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if self.pg is not None:  # give the devices back to a cluster we joined
                try:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(self.pg)
                except Exception:  # noqa: BLE001 - the cluster may be gone
                    pass
                self.pg = None
        finally:
            if group is not None:
                group.workers = []
            if self.started_ray:
                ray.shutdown()
                self.started_ray = False
