"""The plan features and layouts ``backend=ray`` executes (:func:`unsupported_features`; the
backend refuses the others with one clear error before any worker starts). Its typed options
live in :mod:`.config`."""
from __future__ import annotations

from harness.backends.ray.layout import check_tp
from harness.errors import ConfigError, PlanError
from harness.plan import Feature, ModelRole, Plan, TaskKind
from harness.real.model import ModelArgs


# Plan features the Ray driver executes so far; the others are refused before any worker starts.
SUPPORTED_FEATURES: frozenset[Feature] = frozenset({Feature.FUSED_TRAINING, Feature.STREAMING, Feature.MIGRATION,
                                                  Feature.PER_REPLICA_MOVEMENT, Feature.OFFLOAD})


def unsupported_features(plan: Plan, model_args: dict[str, ModelArgs]) -> list[str]:
    """Every plan feature or layout backend=ray does not execute, one phrase each."""
    hints = {Feature.STREAMING: " (system.inter_stage=false runs RLHFuse's intra-stage fusion alone)"}
    out = [f"{feature.value}: not executed yet{hints.get(feature, '')}" for feature in plan.features()
           if feature not in SUPPORTED_FEATURES]
    pin = " (pin layouts it executes, e.g. system.layouts.<task>=dp2tp2pp1)"
    for t in plan.tasks:
        s = t.allocation.strategy
        if t.kind == TaskKind.GENERATE and s.pp > 1:
            out.append(f"task {t.name} generates with pp={s.pp}; generation runs with pp=1 only{pin}")
        if t.kind == TaskKind.GENERATE and s.zero_stage == 3:
            out.append(f"task {t.name} generates from ZeRO-3 shards; give generation its own layout (a weight "
                       f"movement gathers the weights, as DeepSpeed-Chat's hybrid engine does)")
        if s.zero_stage == 3 and (s.tp > 1 or s.pp > 1):
            out.append(f"task {t.name} combines ZeRO-3 with tp={s.tp}, pp={s.pp}{pin}")
        if t.kind == TaskKind.TRAIN and t.model not in (ModelRole.ACTOR, ModelRole.CRITIC):
            out.append(f"task {t.name} trains {t.model}")
        try:
            check_tp(model_args[t.model], s.tp, f"task {t.name}")
        except (ConfigError, PlanError) as e:
            out.append(str(e))
    for m in plan.weight_movements:
        if m.target.strategy.zero_stage == 3:
            out.append(f"weight movement {m.task} targets a ZeRO-3 layout")
    for role in plan.offloaded:  # offloading swaps a local replica's weights around each use (replica.py)
        for t in plan.tasks:
            if t.model == role and t.allocation.strategy.zero_stage == 3:
                out.append(f"{role} is offloaded but task {t.name} holds it as ZeRO-3 shards")
            if t.model == role and t.kind == TaskKind.TRAIN:
                out.append(f"{role} is offloaded but trained by task {t.name} (only inference models are offloaded)")
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
            out.append(f"task {t.name} generates with tp={s.tp}; generation_engine=vllm runs tp=1 instances "
                       f"(pin e.g. system.layouts.{t.name}=dp{s.dp * s.tp}tp1pp1, or use generation_engine=ours)")
    m = plan.generation.migration
    if m is not None and m.transfer == "kv":
        out.append("migration with transfer=kv: generation_engine=vllm migrates tokens only (its paged KV cache "
                   "is not exported)")
    d = model_args["actor"].dim_per_head
    if d < 32:
        out.append(f"the actor's head dimension is {d}; vLLM's attention kernels need 32 or more (its CPU "
                   f"kernels: 32, 64, 80, 96, 112, 128, ...)")
    return out
