"""The plan features and layouts ``backend=ray`` executes (:func:`unsupported_features`; the
backend refuses the others with one clear error before any worker starts), and the combinations of
options it runs (:func:`option_conflicts`, :func:`zero3_engine`: refused with a ConfigError before
Ray or any worker starts). Its typed options live in :mod:`.config`."""
from __future__ import annotations

from typing import Optional

from harness.backends.ray.config import RayOptions
from harness.backends.ray.driver.homes import stale_movement_sources
from harness.real.parallel.layout import check_tp
from harness.errors import ConfigError, PlanError
from harness.core.plan import Feature, ModelRole, Plan, TaskKind
from harness.planning.iterations import check_off_policy_plan
from harness.planning.partial import check_partial_plan
from harness.real.model import ModelArgs


# Plan features the Ray driver executes so far; the others are refused before any worker starts.
SUPPORTED_FEATURES: frozenset[Feature] = frozenset({Feature.FUSED_TRAINING, Feature.STREAMING, Feature.MIGRATION,
                                                  Feature.PER_REPLICA_MOVEMENT, Feature.OFFLOAD, Feature.OFF_POLICY,
                                                  Feature.LENGTH_DISPATCH, Feature.SEQUENCE_PACKING})


def pin_hint(plan: Plan, task: str, layout: str, more: str = "") -> str:
    """`` (pin a layout it executes: <key>=<layout>...)`` with the key that pins ``task``'s layout in
    the system that made ``plan`` (``Plan.layout_keys``: ``system.layouts.<task>``, ``system.layout``,
    ...), and ``more`` after it; just `` (<more>)`` (or nothing) when the system pins no layouts."""
    key = plan.layout_keys.get(task)
    parts = ([f"pin a layout it executes: {key}={layout}"] if key else []) + ([more] if more else [])
    return f" ({', or '.join(parts)})" if parts else ""


def unsupported_features(plan: Plan, model_args: dict[str, ModelArgs]) -> list[str]:
    """Every plan feature or layout backend=ray does not execute, one phrase each."""
    hints = {Feature.STREAMING: " (system.inter_stage=false runs RLHFuse's intra-stage fusion alone)"}
    out = [f"{feature.value}: not executed yet{hints.get(feature, '')}" for feature in plan.features()
           if feature not in SUPPORTED_FEATURES]
    policy = plan.off_policy
    if policy is not None:  # driver/off_policy.py: batched rollout, continuous.py: continuous, partial.py: the rest
        if Feature.STREAMING in plan.features():
            out.append("an off-policy plan with streamed generation")
        try:
            if policy.rollout in ("partial", "tail_batching"):  # synchronous iterations: devices may be shared
                check_partial_plan(plan)
            else:
                check_off_policy_plan(plan)
        except PlanError as e:
            out.append(str(e))
    for t in plan.tasks:
        s = t.allocation.strategy
        if t.kind == TaskKind.GENERATE and s.pp > 1:
            out.append(f"task {t.name} generates with pp={s.pp}; generation runs with pp=1 only"
                       + pin_hint(plan, t.name, f"dp{s.dp}tp{s.tp * s.pp}pp1"))  # same dp: same batch split
        if t.kind == TaskKind.GENERATE and s.zero_stage == 3:
            out.append(f"task {t.name} generates from ZeRO-3 shards; give generation its own layout (a weight "
                       f"movement gathers the weights, as DeepSpeed-Chat's hybrid engine does)")
        if s.zero_stage == 3 and (s.tp > 1 or s.pp > 1):
            out.append(f"task {t.name} combines ZeRO-3 with tp={s.tp}, pp={s.pp}"
                       + pin_hint(plan, t.name, f"dp{s.dp * s.tp * s.pp}tp1pp1"))
        if t.kind == TaskKind.TRAIN and t.model not in (ModelRole.ACTOR, ModelRole.CRITIC):
            out.append(f"task {t.name} trains {t.model}")
        try:
            check_tp(model_args[t.model], s.tp, f"task {t.name}")
        except (ConfigError, PlanError) as e:
            out.append(str(e))
    for m in plan.weight_movements:
        if m.target.strategy.zero_stage == 3:
            out.append(f"weight movement {m.task} targets a ZeRO-3 layout")
    for name in stale_movement_sources(plan):
        m = plan.movement_of(name)
        out.append(f"weight movement {name} sends {m.model.value} from {m.source.strategy} on {list(m.source.mesh)}, "
                   f"whose copy is stale when it runs (trained since it was filled); move from the home layout")
    for role in plan.offloaded:  # offloading swaps a local replica's weights (and optimizer) around each use
        for t in plan.tasks:
            if t.model == role and t.allocation.strategy.zero_stage == 3:
                out.append(f"{role} is offloaded but task {t.name} holds it as ZeRO-3 shards")
    return out


def engine_unsupported(plan: Plan, model_args: dict[str, ModelArgs], engine: str) -> list[str]:
    """What ``backend.options.generation_engine=<engine>`` cannot execute in ``plan``.

    vLLM (:mod:`harness.real.vllm_engine`) runs one engine per generation instance in the worker of
    that instance, from the actor's weights written as a Hugging Face checkpoint: so tp = pp = 1
    per instance, and migration moves tokens (vLLM's paged KV blocks are not exported)."""
    if engine != "vllm":
        return []
    out = []
    for t in plan.tasks:
        s = t.allocation.strategy
        if t.kind == TaskKind.GENERATE and s.tp > 1:
            out.append(f"task {t.name} generates with tp={s.tp}; generation_engine=vllm runs tp=1 instances"
                       + pin_hint(plan, t.name, f"dp{s.dp * s.tp}tp1pp{s.pp}", "use generation_engine=ours"))
    m = plan.generation.migration
    if m is not None and m.transfer == "kv":
        out.append("migration with transfer=kv: generation_engine=vllm migrates tokens only (its paged KV cache "
                   "is not exported)")
    d = model_args["actor"].dim_per_head
    if d < 32:
        out.append(f"the actor's head dimension is {d}; vLLM's attention kernels need 32 or more (its CPU "
                   f"kernels: 32, 64, 80, 96, 112, 128, ...)")
    return out


def zero3_engine(requested: str, task: str, mesh_size: int, num_devices: int,
                 deepspeed_installed: bool) -> tuple[str, Optional[str]]:
    """The ZeRO-3 engine (``deepspeed`` or ``native``) of a home layout sharded with ZeRO-3, for
    ``backend.options.zero3_impl=requested``, and why ``requested`` cannot be honoured (None when
    it can). DeepSpeed runs over the default process group, so only a mesh of every device can use
    it; ``auto`` takes DeepSpeed where it can (in float32 and in bf16: DeepSpeed's own bf16 mode,
    :mod:`harness.real.parallel.zero3`) and the native ZeRO-3 elsewhere."""
    if requested == "native":
        return "native", None
    if deepspeed_installed and mesh_size == num_devices:
        return "deepspeed", None
    if requested == "deepspeed":
        why = ("DeepSpeed is not installed: pip install -e '.[deepspeed]'" if not deepspeed_installed else
               f"its mesh has {mesh_size} of the {num_devices} devices, and DeepSpeed runs over the default "
               f"process group, i.e. on a mesh of every device only")
        return "native", (f"backend.options.zero3_impl=deepspeed: task {task} cannot use DeepSpeed ({why}); "
                          f"use backend.options.zero3_impl=auto or native")
    return "native", None


def option_conflicts(opts: RayOptions, device: Optional[str], num_devices: int,
                     cuda_devices: Optional[int] = None) -> list[str]:
    """Combinations of ``backend.options`` (and of them with this machine) that ``backend=ray``
    does not run, one phrase each; the backend refuses them with a ConfigError before Ray or any
    worker starts (the plan's ZeRO-3 layouts are checked by :func:`zero3_engine`, the generation
    engine's limits by :func:`engine_unsupported`).

    ``device``: the resolved worker device, ``cpu`` or ``cuda``; None while it is not known yet
    (``device=auto`` joining a cluster: the backend checks again once it has joined, still before any
    worker starts). ``cuda_devices``: how many CUDA devices the workers can use when they run on this
    machine (the embedded Ray); None when they run on a cluster (its resources are checked when the
    devices are placed)."""
    out = []
    if device == "cuda" and cuda_devices is not None and cuda_devices < num_devices:
        out.append(f"backend.options.device={opts.device} needs one CUDA device per worker ({num_devices}, "
                   f"cluster.num_nodes x cluster.gpus_per_node) but this machine has {cuda_devices}; use "
                   f"backend.options.device=cpu (one CPU process per device), or fewer devices")
    if device == "cuda" and getattr(opts, "p2p_matching", "in_order") != "in_order":
        out.append(f"backend.options.p2p_matching={opts.p2p_matching} on CUDA: NCCL ignores tags (messages "
                   f"between two ranks match in posting order); use in_order")
    if opts.torch_threads < 1:
        out.append(f"backend.options.torch_threads={opts.torch_threads}: give 1 or more (threads per worker)")
    for name in ("setup_timeout_s", "task_timeout_s", "collective_timeout_s", "shutdown_timeout_s"):
        if not getattr(opts, name) > 0:
            out.append(f"backend.options.{name}={getattr(opts, name)}: give a positive number of seconds")
    fault = opts.fault_injection
    if fault.device is not None and not 0 <= fault.device < num_devices:
        out.append(f"backend.options.fault_injection.device={fault.device}: the run has devices 0-{num_devices - 1}")
    return out
