"""``backend.options`` of ``backend=ray`` (typed, unknown keys refused) and the plan features
the real backend executes (:func:`unsupported_features`; the backend refuses the others with one
clear error before any worker starts)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from harness.backends.ray.layout import check_tp
from harness.errors import ConfigError, PlanError
from harness.plan import Feature, ModelRole, Plan, TaskKind
from harness.real.model import ModelArgs


@dataclass
class RayOptions:
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
    torch_threads: int = 1  # per worker; tiny models on shared CPUs run fastest single-threaded
    # PPO hyper-parameters: of the order of DeepSpeed-Chat's step-3 defaults; what matters here is
    # that every system uses the same ones
    actor_lr: float = 1e-5
    critic_lr: float = 5e-5
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    temperature: float = 1.0
    whiten_advantages: bool = True
    zero3_impl: str = "auto"  # auto (DeepSpeed when importable) | deepspeed | native
    # failure handling (seconds)
    setup_timeout_s: float = 600.0
    task_timeout_s: float = 600.0
    collective_timeout_s: float = 300.0
    shutdown_timeout_s: float = 60.0
    digest: bool = True  # full weights to the driver after each iteration (small models only)
    dump_weights_dir: Optional[str] = None  # torch.save the full actor/critic there each iteration
    multi_node: bool = False  # rendezvous on the node's IP instead of 127.0.0.1
    fault_injection: Optional[dict[str, Any]] = None  # {task, device}: that worker dies there (tests)

    @staticmethod
    def from_config(options: dict[str, Any] | None) -> "RayOptions":
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(RayOptions)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"backend.options: unknown key(s) {unknown} for backend=ray; known: {sorted(names)}")
        if "adam_betas" in options:
            options["adam_betas"] = tuple(float(b) for b in options["adam_betas"])
        opts = RayOptions(**options)
        if opts.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"backend.options.device={opts.device!r}: use auto, cpu or cuda")
        if opts.zero3_impl not in ("auto", "deepspeed", "native"):
            raise ConfigError(f"backend.options.zero3_impl={opts.zero3_impl!r}: use auto, deepspeed or native")
        return opts

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Plan features the Ray driver executes so far; the others are refused before any worker starts.
SUPPORTED_FEATURES: frozenset[Feature] = frozenset()


def unsupported_features(plan: Plan, model_args: dict[str, ModelArgs]) -> list[str]:
    """Every plan feature or layout backend=ray does not execute, one phrase each."""
    out = [f"{feature.value} is not executed yet" for feature in plan.features() if feature not in SUPPORTED_FEATURES]
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
    return out
