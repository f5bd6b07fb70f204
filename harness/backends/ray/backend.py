"""``backend=ray``: execute a Plan for real on Ray actors, one per device (DESIGN sections 2, 6).

The driver is a single controller (as in verl/HybridFlow): it starts (or joins) Ray, creates one
:class:`~harness.backends.ray.worker.DeviceWorker` per device, wires them into one
``torch.distributed`` job, then walks the plan's tasks in dependency order, calling the devices of
each task's mesh and routing the (small) per-sample data between tasks itself. Weights never pass
through the driver during an iteration: they move between workers with collectives.

Failure: every wait on workers is bounded (``ray.wait`` with a timeout). A worker whose process
dies surfaces as ``RayActorError`` on its own call at once, even while its peers are blocked in a
collective with it; the driver then raises :class:`WorkerFailedError` naming the device and task,
and :meth:`close` kills every worker rather than waiting on them.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from harness.backends.base import Backend
from harness.backends.ray.experience import stable_seed
from harness.backends.ray.config import RayOptions
from harness.backends.ray.options import unsupported_features
from harness.errors import ConfigError, PlanError
from harness.plan import Allocation, Plan, TaskKind, TrainingStage
from harness.real.model import ModelArgs
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
        self.args = model_args(ctx.models)
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

    def unsupported(self, plan: Plan) -> list[str]:
        return unsupported_features(plan, self.args)

    # ---- set-up ---------------------------------------------------------------------------
    def _start_ray(self, num_devices: int, use_cuda: bool):
        try:
            import ray
        except ImportError as e:
            raise ConfigError("backend=ray needs Ray: pip install -e '.[ray]'") from e
        self._ray = ray
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, logging_level="WARNING")
            if self.cfg.address is None:  # embedded local Ray: one logical CPU per device process
                kwargs.update(num_cpus=max(num_devices, 1), num_gpus=None if use_cuda else 0)
            ray.init(address=self.cfg.address, **kwargs)
            self._started_ray = True
        return ray

    def _device(self) -> str:
        if self.opts.device != "auto":
            return self.opts.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def setup(self, plan: Plan) -> None:
        n = self.ctx.num_devices
        if self.cfg.num_devices is not None and self.cfg.num_devices != n:
            raise ConfigError(f"backend.num_devices={self.cfg.num_devices} but the cluster has {n} devices "
                              f"(cluster.num_nodes x cluster.gpus_per_node); leave it null")
        self.check(plan)
        device = self._device()
        self.opts.device = device
        self.opts.multi_node = self.opts.multi_node or self.cfg.address is not None
        ray = self._start_ray(n, device == "cuda")
        from harness.backends.ray.worker import DeviceWorker

        resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        actor_cls = ray.remote(DeviceWorker).options(max_restarts=0, max_task_retries=0, **resources)
        opts = self.opts.to_dict()
        self.workers = [actor_cls.remote(rank, n, opts) for rank in range(n)]
        timeout = self.opts.setup_timeout_s
        self.pids = self._wait([w.pid.remote() for w in self.workers], list(range(n)), "start workers", timeout)
        ip, port = self._wait([self.workers[0].address.remote()], [0], "rendezvous", timeout)[0]
        self._wait([w.init_distributed.remote(ip, port, self.opts.collective_timeout_s) for w in self.workers],
                   list(range(n)), "init_process_group", timeout)
        setup = self._setup_info(plan)
        plan_json = plan.to_json(indent=None)
        self._wait([w.setup.remote(plan_json, setup) for w in self.workers], list(range(n)), "setup models", timeout)
        zero3 = sorted({impl for role, impl in setup["zero3"].items() if self.home[role].strategy.zero_stage == 3})
        print(f"[harness] backend=ray: {n} workers ({device}, {'nccl' if device == 'cuda' else 'gloo'})"
              + (f", ZeRO-3 by {'/'.join(zero3)}" if zero3 else ""))

    def _setup_info(self, plan: Plan) -> dict[str, Any]:
        from harness.backends.ray.comm import plan_group_ranks
        from harness.backends.ray.zero3 import deepspeed_available

        seeds = role_seeds(self.ctx.seed, self.args)
        stages = {name: st for st in plan.training for name in st.tasks}
        homes = {}
        for role in ("actor", "critic", "ref", "reward"):
            task = home_task(plan, role)
            task_name = task.name
            alloc = task.allocation
            s = alloc.strategy
            impl = "native"
            if s.zero_stage == 3 and self.opts.zero3_impl != "native":
                # DeepSpeed runs over the default group, so only a mesh of every device can use it
                usable = len(alloc.mesh) == self.ctx.num_devices and deepspeed_available()
                if usable:
                    impl = "deepspeed"
                elif self.opts.zero3_impl == "deepspeed":
                    raise ConfigError(f"backend.options.zero3_impl=deepspeed: task {task_name} cannot use DeepSpeed "
                                      "(it must be installed, pip install -e '.[deepspeed]', and the task's mesh "
                                      "must span every device)")
            home: dict[str, Any] = {"allocation": dataclasses.asdict(alloc), "zero3_impl": impl}
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
            from harness.real.model import LlamaModel

            self.init_states = {r: LlamaModel(self.args[r], seed=seeds[r]).state_dict() for r in ("actor", "critic")}
        return {
            "groups": [list(r) for r in plan_group_ranks(plan)],
            "homes": homes, "seeds": seeds,
            "model_args": {r: dataclasses.asdict(a) for r, a in self.args.items()},
            "model_cfgs": {r: dataclasses.asdict(getattr(self.ctx.models, r)) for r in self.args},
            "zero3": {r: h["zero3_impl"] for r, h in homes.items()},
        }

    # ---- waiting on workers ---------------------------------------------------------------
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

    @staticmethod
    def outputs(results: list[dict]) -> list:
        return [r["out"] for r in results if r["out"] is not None]
