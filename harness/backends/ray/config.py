"""Typed config of ``backend=ray`` (``conf/backend/ray.yaml`` extends it): registered with Hydra
like every other group, so an unknown key or a wrong type is refused when the config is composed,
with the same message as everywhere else. Imports neither Ray nor torch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from harness.config import BackendConfig
from harness.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
ZERO3_IMPLS = ("auto", "deepspeed", "native")
REWARD_KINDS = ("model", "token_range")


@dataclass
class RewardOptions:
    """Where the reward stage's per-sample scores come from.

    ``model`` (default): the reward model's value head on the last token (a randomly initialised
    model here, so its scores carry no task). ``token_range``: a programmatic learning task
    (docs/LEARNING.md, :mod:`harness.backends.ray.rewards`): the score is the fraction of the
    sample's response tokens whose id lies in ``[low, high)``. The reward model's forward pass
    still runs either way, so the reward stage costs what the plan says; only its output changes."""

    kind: str = "model"  # model | token_range
    low: int = 0  # token_range: first rewarded token id
    high: int = 32  # token_range: one past the last rewarded token id


@dataclass
class FaultInjection:
    """Test hook: the worker of ``device`` dies (exits without cleaning up) when ``task`` reaches it
    (with ``op``: only that operation of the task, e.g. ``gen_migrate`` mid-stream, ``train_fused``)."""

    task: Optional[str] = None  # None = no fault
    device: Optional[int] = None  # None = every device that runs it (the first to do so ends the run)
    op: Optional[str] = None


@dataclass
class RayOptions:
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
    torch_threads: int = 1  # per worker; tiny models on shared CPUs run fastest single-threaded
    # PPO hyper-parameters: of the order of DeepSpeed-Chat's step-3 defaults; what matters here is
    # that every system uses the same ones
    actor_lr: float = 1e-5
    critic_lr: float = 5e-5
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
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
    # torch.save the full actor/critic there each iteration, with experience.npz (per-sample
    # scores, ref log-probs, values, old log-probs) of the last iteration
    dump_weights_dir: Optional[str] = None
    multi_node: bool = False  # rendezvous on the node's IP instead of 127.0.0.1
    fault_injection: "FaultInjection" = field(default_factory=lambda: FaultInjection())
    reward: "RewardOptions" = field(default_factory=lambda: RewardOptions())

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"backend.options.device={self.device!r}: use one of {', '.join(DEVICES)}")
        if self.zero3_impl not in ZERO3_IMPLS:
            raise ConfigError(f"backend.options.zero3_impl={self.zero3_impl!r}: use one of {', '.join(ZERO3_IMPLS)}")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"backend.options.adam_betas={list(self.adam_betas)}: give two numbers")
        self.adam_betas = [float(b) for b in self.adam_betas]
        r = self.reward
        if r.kind not in REWARD_KINDS:
            raise ConfigError(f"backend.options.reward.kind={r.kind!r}: use one of {', '.join(REWARD_KINDS)}")
        if r.kind == "token_range" and not 0 <= r.low < r.high:
            raise ConfigError(f"backend.options.reward: low={r.low}, high={r.high} must satisfy 0 <= low < high")

    @staticmethod
    def from_config(options: "RayOptions | dict[str, Any] | None") -> "RayOptions":
        """The options of a composed config (already typed), or a plain dict (scripts, tests)."""
        if isinstance(options, RayOptions):
            return dataclasses.replace(options)
        options = dict(options or {})
        for key, cls in (("fault_injection", FaultInjection), ("reward", RewardOptions)):
            if isinstance(options.get(key), dict):
                known = {f.name for f in dataclasses.fields(cls)}
                unknown = sorted(set(options[key]) - known)
                if unknown:
                    raise ConfigError(f"backend.options.{key}: unknown key(s) {unknown}; known: {sorted(known)}")
                options[key] = cls(**options[key])
        names = {f.name for f in dataclasses.fields(RayOptions)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"backend.options: unknown key(s) {unknown} for backend=ray; known: {sorted(names)}")
        return RayOptions(**options)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RayBackendConfig(BackendConfig):
    name: str = "ray"
    _target_: str = "harness.backends.ray.RayBackend"
    num_iterations: int = 3
    address: Optional[str] = None  # Ray cluster address; None = start an embedded local Ray
    num_devices: Optional[int] = None  # must equal cluster.num_nodes x cluster.gpus_per_node when set
    options: RayOptions = field(default_factory=RayOptions)
