"""Execution engines: how a framework's engines run a plan's work (issue 26).

A system decides *where* and *in what layout* each PPO task runs (its :class:`~harness.core.plan.Plan`);
an execution engine is *how* the framework it reimplements runs that work on the GPUs: padding,
host overhead per step, how weights reach generation, optimizer offload, and how far its kernels
fall short of our per-op profiles. Two systems with the same plan differ by up to 10x in published
measurements for these reasons alone (../shared/published/README.md), so they are modelled here,
as data, once for every system:

- a **generation engine** (``conf/engine/generation/<name>.yaml``, :class:`GenerationEngine`):
  static or continuous batching, CUDA graphs or an eager host loop (``launches_per_layer`` kernels
  issued from Python per layer per step), whether it generates from weights gathered once into its
  own layout or from the training engine's module in place (``weights``: under ZeRO-3 every step
  then all-gathers every layer), synced rounds under ZeRO-3, padding, how many times a step moves the
  KV cache (``kv_cache_passes``: copies made by the framework's cache and attention code) and how
  often the host waits for the GPU (``host_syncs_per_layer``);
- a **training engine** (``conf/engine/training/<name>.yaml``, :class:`TrainingEngine`): which
  parallelism it supports, CPU optimizer offload (ZeRO-Offload), whether its attention writes the
  score matrices to HBM (an eager attention: ``attention_score_bytes_*``), the speed of its kernels.

Each system names its default engines (``system.generation_engine`` / ``system.training_engine``:
the engines of the implementation it reimplements); ``engine.generation=<name or yaml path>`` and
``engine.training=...`` run any system on any compatible engine. The chosen engines are plan data
(``Plan.engines``) and the simulator applies them through :class:`EngineCosts`.

Fitted constants. Every mechanism constant is cited in its YAML file. The few constants no
measurement gives (marked ``fitted`` below: a GPU-time factor per generation engine and, for
eager ones, a host-time factor; a compute factor per training engine; the CPU optimizer's streaming
rate) are
fitted by ``python -m harness.replay FILE --fit`` on the published end-to-end measurements of
``data/published/replay.jsonl`` and stored, with their provenance, in ``data/engines/fitted.json``;
they are shared by every run of an engine, never per point. ``engine.fitted=false`` runs with every
fitted constant at its prior (factors 1, CPU Adam at its placeholder rate): the mechanisms alone. With
DeepSpeed-Chat's issue-12 generation engine (``benchmarks/engines_before/ds_hybrid_issue12.yaml``) that
is the simulator as it was before issue 26 (``benchmarks/fig7_engines.py``). See docs/VALIDATION.md.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, get_type_hints

import numpy as np
from omegaconf import OmegaConf

from harness.errors import ConfigError, PlanError
from harness.core.files import file_kind
from harness.core.option_effects import effective_when

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = ROOT / "conf" / "engine"
FITTED_PATH = ROOT / "data" / "engines" / "fitted.json"
KINDS = ("generation", "training")

# The fitted constants of each kind of engine and their priors (the value when unfitted).
FITTED_PRIORS = {
    "generation": {"gpu_time_scale": 1.0, "host_time_scale": 1.0},
    "training": {"compute_time_scale": 1.0, "cpu_adam_gbps": 50.0},
}
# The prior of the CPU optimizer's rate: a two-socket DGX A100 host (2 x AMD EPYC 7742, 8 channels of
# DDR4-3200 each: 409.6 GB/s peak, AMD datasheet) streaming Adam's states at about an eighth of peak,
# since eight ranks' optimizer processes share it. A placeholder until fitted (data/engines/fitted.json).

# Set by harness.cli.replay while fitting: replaces the fit file's table for every engine resolved.
_TABLE_OVERRIDE: Optional[dict[str, dict[str, float]]] = None


@dataclass
class EngineSelection:
    """``engine.*`` of the run config: which engines run the plan (null: the system's defaults)."""

    generation: Optional[str] = None  # a name under conf/engine/generation/ or a YAML path
    # a name under conf/engine/training/ or a YAML path; one that cannot run the ZeRO stages the
    # system's config asks for is refused (training_engine_applies)
    training: Optional[str] = field(default=None, metadata=effective_when(
        check=lambda value, cfg: training_engine_applies(value, cfg)))
    fitted: bool = True  # false: every fitted constant at its prior (the mechanism model alone)


@dataclass(frozen=True)
class GenerationEngine:
    """How the actor's generation runs (see the module docstring)."""

    name: str
    batching: str = "continuous"  # continuous (Orca / vLLM iteration scheduling) | static (rounds)
    kernels: str = "graph"  # graph (CUDA graphs: host cost hidden) | eager (host issues every kernel)
    launches_per_layer: Optional[int] = None  # eager: kernels the host issues per layer per step
    # inference_layout: weights gathered once into the engine's own (tp, pp) layout (DeepSpeed
    # hybrid engine, vLLM); training_layout: generate() on the training engine's module in place
    # (ZeRO-3 shards are then all-gathered layer by layer at every step)
    weights: str = "inference_layout"
    synced_under_zero3: bool = False  # generate(synced_gpus=True): rounds end on the longest rank
    pad_to_longest: bool = False  # later passes see the round's padded tensor
    pad_prompts_to_max: bool = False  # prompts padded to the workload's longest prompt
    # false: no KV cache is reused, so every decode step runs the whole sequence so far (a prefill
    # of the batch's context), not one token per sequence
    kv_cache: bool = True
    # times a decode step moves the KV cache's bytes (reads plus writes). Our kernel profiles read it
    # once (gpt-fast's static cache, as a paged or preallocated cache is); every pass beyond the
    # first costs its bytes at the measured streaming rate (copies made by the framework's Python)
    kv_cache_passes: float = 1.0
    # host-device synchronisations per layer per step (a ``.item()`` or ``nonzero`` in the model
    # code): the host cannot run ahead of the GPU across one, and the GPU idles until the host
    # issues the next kernel, so each costs one launch of host time on top of the step
    host_syncs_per_layer: int = 0
    # fitted (None: data/engines/fitted.json, else the prior)
    gpu_time_scale: Optional[float] = None  # GPU time of a step relative to our kernel profiles
    # eager engines: host time per kernel launch relative to gpt-fast's eager loop (the calibrated
    # EAGER_HOST_S_PER_LAUNCH); a framework's Python per layer (module hooks, generate()'s logits
    # processing) costs more than gpt-fast's. No effect on CUDA-graph engines.
    host_time_scale: Optional[float] = None
    fit_key: Optional[str] = None  # engines sharing fitted constants (None: its own name)
    source: str = ""  # where the mechanism facts come from

    def __post_init__(self) -> None:
        _check_choice(self.name, "batching", self.batching, ("continuous", "static"))
        _check_choice(self.name, "kernels", self.kernels, ("graph", "eager"))
        _check_choice(self.name, "weights", self.weights, ("inference_layout", "training_layout"))
        if self.kernels == "eager" and (self.launches_per_layer or 0) < 1:
            raise ConfigError(f"generation engine {self.name}: kernels=eager needs launches_per_layer >= 1")
        if self.kernels == "graph" and self.launches_per_layer is not None:
            raise ConfigError(f"generation engine {self.name}: launches_per_layer is for kernels=eager")
        if self.kv_cache_passes < 1:
            raise ConfigError(f"generation engine {self.name}: kv_cache_passes={self.kv_cache_passes} < 1 "
                              f"(attention reads the cache at least once)")
        if self.host_syncs_per_layer < 0 or (self.host_syncs_per_layer and self.kernels != "eager"):
            raise ConfigError(f"generation engine {self.name}: host_syncs_per_layer is a count >= 0 of an "
                              f"eager engine (kernels=eager)")
        if (self.synced_under_zero3 or self.pad_to_longest) and self.batching != "static":
            raise ConfigError(f"generation engine {self.name}: synced_under_zero3 / pad_to_longest need "
                              f"batching=static (rounds)")


@dataclass(frozen=True)
class TrainingEngine:
    """How forward/backward passes and optimizer steps run (training and ref/reward/critic inference)."""

    name: str
    # parallelism the engine runs: zero (DeepSpeed ZeRO data parallelism over HF modules: tp = pp = 1)
    # or megatron (3D: tp, pp, dp with a distributed optimizer)
    parallelism: str = "megatron"
    optimizer_offload: bool = False  # ZeRO-Offload: fp32 states and Adam on the CPU
    # bytes a forward / backward moves per attention-score element (heads x queries x keys, per layer)
    # beyond a fused attention kernel's (0: fused, FlashAttention-style, scores never leave the chip).
    # An eager attention writes the score matrix to HBM and rereads it at each elementwise op; the
    # YAML files derive the counts from the framework's attention code. Charged at the measured
    # streaming rate; the backward's count includes the forward again under activation recomputation.
    attention_score_bytes_forward: float = 0.0
    attention_score_bytes_backward: float = 0.0
    # fitted (None: data/engines/fitted.json, else the prior)
    compute_time_scale: Optional[float] = None  # forward/backward time relative to our kernel profiles
    cpu_adam_gbps: Optional[float] = None  # per node: optimizer-state bytes CPU Adam streams per second
    fit_key: Optional[str] = None
    source: str = ""

    def __post_init__(self) -> None:
        _check_choice(self.name, "parallelism", self.parallelism, ("zero", "megatron"))
        for key in ("attention_score_bytes_forward", "attention_score_bytes_backward"):
            value = getattr(self, key)
            if not (value >= 0.0 and value < float("inf")):
                raise ConfigError(f"training engine {self.name}: {key}={value} must be a finite count of "
                                  f"bytes >= 0")


@dataclass(frozen=True)
class Engines:
    """The engines a plan runs on, with their fitted constants resolved."""

    generation: GenerationEngine
    training: TrainingEngine

    def to_dict(self) -> dict[str, Any]:
        return {"generation": asdict(self.generation), "training": asdict(self.training)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Engines":
        return Engines(GenerationEngine(**d["generation"]), TrainingEngine(**d["training"]))


def _check_choice(name: str, key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"engine {name}: {key}={value!r}, expected one of {allowed}")


def available(kind: str) -> list[str]:
    """Engine names under ``conf/engine/<kind>/``."""
    return sorted(p.stem for p in (ENGINE_DIR / kind).glob("*.yaml"))


def _engine_file(kind: str, name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            if path.exists():  # a directory, a device, a pipe
                raise ConfigError(f"engine.{kind}={name_or_path}: is {file_kind(path)}, not a file")
            raise ConfigError(f"engine.{kind}={name_or_path}: no such file")
        return path
    path = ENGINE_DIR / kind / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"engine.{kind}={name_or_path!r} is not a {kind} engine; available: "
                          f"{', '.join(available(kind))} (or a path to a .yaml file)")
    return path


def load_engine(kind: str, name_or_path: str) -> GenerationEngine | TrainingEngine:
    """The engine ``name_or_path`` of ``kind`` as written in its YAML file (fitted constants unresolved).
    A file that is not YAML, not a mapping, has unknown keys or values of the wrong type is refused
    (ConfigError naming the file and the line)."""
    if kind not in KINDS:
        raise ValueError(f"engine kind must be one of {KINDS}, not {kind!r}")
    cls = GenerationEngine if kind == "generation" else TrainingEngine
    path = _engine_file(kind, name_or_path)
    data, lines = _read_engine_yaml(path, kind)
    data.setdefault("name", path.stem)
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - allowed, key=lambda k: lines.get(k, 0))
    if unknown:
        raise ConfigError(f"{path}:{lines.get(unknown[0], 1)}: unknown {kind}-engine key(s) {unknown}; "
                          f"allowed: {sorted(allowed)}")
    hints = get_type_hints(cls)
    for key, value in data.items():
        expected = _type_problem(value, hints[key])
        if expected is not None:
            raise ConfigError(f"{path}:{lines.get(key, 1)}: {key}={value!r} must be {expected}")
    return cls(**data)


def _read_engine_yaml(path: Path, kind: str) -> tuple[dict[str, Any], dict[str, int]]:
    """An engine file's mapping (interpolations resolved) and the line of each top-level key."""
    import yaml
    from omegaconf._utils import get_yaml_loader
    from omegaconf.errors import OmegaConfBaseException

    expected = f"a {kind}-engine file is a YAML mapping of the engine's fields"
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text ({e.reason}); {expected}") from None
    try:
        node = yaml.compose(text, Loader=get_yaml_loader())
        obj = yaml.load(text, Loader=get_yaml_loader())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{line}: not valid YAML ({problem}); {expected}") from None
    if obj is None:  # an empty file: every field at its default
        return {}, {}
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}:1: {expected}, not a {'list' if isinstance(obj, list) else type(obj).__name__}")
    lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value} if isinstance(node, yaml.MappingNode) else {}
    try:
        data = OmegaConf.to_container(OmegaConf.create(obj), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    return data, lines


# The engine fields' value types that are checked: how each is named, and the Python types it takes.
_CHECKED_TYPES = {str: ("a string", (str,)), int: ("an integer", (int,)), float: ("a number", (int, float)),
                  bool: ("true or false", (bool,))}


def _type_problem(value: Any, hint: Any) -> Optional[str]:
    """What ``value`` must be for an engine field of type ``hint`` ('a string', 'an integer', 'a
    number', 'true or false', with ' or null' for an optional field) when it is not that; None when
    it is, or when the field's type is not one that is checked."""
    args = getattr(hint, "__args__", ())
    optional = type(None) in args
    others = [a for a in args if a is not type(None)]
    base = others[0] if optional and len(others) == 1 else hint
    if base not in _CHECKED_TYPES:
        return None
    name, types = _CHECKED_TYPES[base]
    if value is None:
        ok = optional
    else:  # a bool is an int to Python, never a number here
        ok = isinstance(value, types) and (base is bool or not isinstance(value, bool))
    return None if ok else name + (" or null" if optional else "")


def fitted_table(path: Path = FITTED_PATH) -> dict[str, dict[str, float]]:
    """``kind/fit_key -> {constant: value}`` from the fit file (empty when there is none)."""
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("constants", {})


def fit_key(kind: str, engine: GenerationEngine | TrainingEngine) -> str:
    return f"{kind}/{engine.fit_key or engine.name}"


def resolve(kind: str, engine: Any, use_fitted: bool = True,
            table: Optional[dict[str, dict[str, float]]] = None) -> Any:
    """``engine`` with every fitted constant set: the value its YAML pins, else the fit file's (when
    ``use_fitted``), else the prior."""
    if table is None and use_fitted:
        table = _TABLE_OVERRIDE if _TABLE_OVERRIDE is not None else fitted_table()
    table = table or {}
    fitted = table.get(fit_key(kind, engine), {}) if use_fitted else {}
    values = {}
    for key, prior in FITTED_PRIORS[kind].items():
        pinned = getattr(engine, key)
        values[key] = float(pinned if pinned is not None else fitted.get(key, prior))
    return replace(engine, **values)


def chosen_engine_names(selection: Any, system_cfg: Any) -> dict[str, str]:
    """``kind -> engine name or path``: ``engine.*`` where set, else the system's defaults
    (``system.generation_engine`` / ``system.training_engine``)."""
    names = {}
    for kind in KINDS:
        name = getattr(selection, kind, None) or getattr(system_cfg, f"{kind}_engine", None)
        if not name:
            raise ConfigError(f"system {getattr(system_cfg, 'name', '?')} names no default {kind} engine "
                              f"(system.{kind}_engine); set engine.{kind}=<{'|'.join(available(kind))}>")
        names[kind] = str(name)
    return names


def select_engines(selection: Any, system_cfg: Any,
                   table: Optional[dict[str, dict[str, float]]] = None) -> Engines:
    """The run's engines (:func:`chosen_engine_names`), fitted constants resolved."""
    use_fitted = bool(getattr(selection, "fitted", True))
    chosen = {kind: resolve(kind, load_engine(kind, name), use_fitted, table)
              for kind, name in chosen_engine_names(selection, system_cfg).items()}
    return Engines(chosen["generation"], chosen["training"])


# ZeRO stages each training parallelism runs: DeepSpeed ZeRO all of them; Megatron-LM's distributed
# optimizer shards the optimizer states over the data-parallel ranks (ZeRO-1), never the gradients or
# the weights.
ZERO_STAGES = {"zero": (0, 1, 2, 3), "megatron": (0, 1)}
PARALLELISM = {"zero": "DeepSpeed ZeRO data parallelism",
               "megatron": "Megatron-LM 3D parallelism, whose distributed optimizer is ZeRO-1"}


def training_engine_applies(name: Any, cfg: Any) -> Optional[str]:
    """Why the training engine ``name`` (``engine.training``) does not apply to the plans of the
    run's system (``cfg.system``), or None: every ZeRO stage the system's config sets
    (``system.zero_stage`` and each ``system.*_zero_stage`` that is not null) must be one the
    engine runs (:data:`ZERO_STAGES`). The reason names the training engines that do."""
    system = cfg.get("system") if name is not None else None
    if system is None or not hasattr(system, "keys"):
        return None
    stages = {}
    for key in system.keys():
        if key == "zero_stage" or str(key).endswith("_zero_stage"):
            value = system[key]
            if isinstance(value, int) and not isinstance(value, bool):
                stages[f"system.{key}"] = value
    engine = load_engine("training", str(name))
    if all(v in ZERO_STAGES[engine.parallelism] for v in stages.values()):
        return None
    runs = ZERO_STAGES[engine.parallelism]
    fit = [n for n in available("training")
           if all(v in ZERO_STAGES[load_engine("training", n).parallelism] for v in stages.values())]
    asked = " and ".join(f"{k}={v}" for k, v in stages.items() if v not in runs)
    return (f"does not apply to {system.get('name', 'the system')}'s plan ({asked}): training engine "
            f"{engine.name} ({PARALLELISM[engine.parallelism]}) runs ZeRO stages "
            f"{', '.join(map(str, runs[:-1]))} and {runs[-1]} only; training engines that apply: "
            f"{', '.join(fit) or 'none'}")


def check_compatible(engines: Engines, allocations: dict[str, Any], migration: bool) -> None:
    """Refuse a plan its engines cannot run (PlanError naming the engine)."""
    gen, train = engines.generation, engines.training
    if migration and gen.batching != "continuous":
        raise PlanError(f"generation engine {gen.name} batches statically; long-tail migration needs a "
                        f"continuous-batching engine (engine.generation=vllm)")
    if train.optimizer_offload:
        for name in ("update_actor", "update_critic"):
            if allocations[name].strategy.zero_stage < 1:
                raise PlanError(f"training engine {train.name} offloads the optimizer (ZeRO-Offload), which "
                                f"DeepSpeed runs with ZeRO stages 1-3 only; task {name} is ZeRO-0")
    if train.parallelism == "zero":
        for name in ("update_actor", "update_critic", "ref", "reward", "values"):
            s = allocations[name].strategy
            if s.tp > 1 or s.pp > 1:
                raise PlanError(f"training engine {train.name} (DeepSpeed ZeRO over Hugging Face modules) runs "
                                f"data parallelism only, but task {name} is laid out {s}; choose "
                                f"engine.training=megatron or a dp-only layout")
    if gen.weights == "training_layout":
        g, a = allocations["gen"], allocations["update_actor"]
        if g.mesh != a.mesh or (g.strategy.dp, g.strategy.tp, g.strategy.pp) != (
                a.strategy.dp, a.strategy.tp, a.strategy.pp):
            raise PlanError(f"generation engine {gen.name} generates with the training engine's module in "
                            f"place, so gen must use update_actor's layout ({a.strategy} on {len(a.mesh)} "
                            f"devices), not {g.strategy} on {len(g.mesh)}")


def policy_fields(engines: Engines, zero3_actor: bool) -> dict[str, Any]:
    """The :class:`~harness.core.plan.GenerationPolicy` fields the generation engine decides."""
    gen = engines.generation
    return {"batching": gen.batching, "engine": gen.kernels,
            "eager_launches_per_layer": gen.launches_per_layer if gen.kernels == "eager" else None,
            "synced_instances": gen.synced_under_zero3 and zero3_actor,
            "pad_to_longest": gen.pad_to_longest}


@dataclass
class EngineCosts:
    """The cost model as a plan's engines see it: same interface as
    :class:`~harness.costmodel.CostModel` (everything not overridden is delegated), with

    - prefill and decode steps: ``max(GPU time x gpu_time_scale, eager host time x host_time_scale,
      ZeRO-3 gather)`` plus, per host-device sync, one launch of host time; the gather only when the
      engine generates from ZeRO-3 shards in place; a decode step's GPU time includes the KV cache's
      extra passes (``kv_cache_passes - 1``) at the streaming rate; without a reused KV cache
      (``kv_cache: false``) a decode step's GPU time is a prefill of the whole context;
    - forward and backward: ``(our kernels + eager attention-score traffic) x compute_time_scale``,
      the traffic ``attention_score_bytes_* x heads/tp x tokens x seq_len x layers`` at the streaming
      rate (the forward's bytes again in a backward that recomputes the attention);
    - optimizer step with offload: the CPU Adam step over the node's share of the optimizer states
      plus the fp16 gradients down and parameters up over PCIe, instead of the GPU's."""

    cm: Any
    engines: Engines
    gen_gather_s: float = 0.0  # all-gather of the actor's weights per generation step (0: none)

    def __post_init__(self) -> None:
        unresolved = [f"{kind}.{key}" for kind, engine in (("generation", self.engines.generation),
                                                           ("training", self.engines.training))
                      for key in FITTED_PRIORS[kind] if getattr(engine, key) is None]
        if unresolved:
            raise PlanError(f"engines with unresolved fitted constants {unresolved}: build them with "
                            f"harness.core.engines.select_engines or resolve()")
        # read once: the generation simulator calls the step methods ~1e5 times per iteration
        from harness.costmodel.calibrated import (EAGER_HOST_S_PER_LAUNCH, GPT_FAST_LAUNCHES_PER_LAYER,
                                                  SHORT_SPAN_STEPS)
        self._short_span_steps = SHORT_SPAN_STEPS  # spans timed step by step below this, elementwise above
        self._graph_overhead_s = float(getattr(self.cm.compute, "graph_step_overhead_s", 0.0))
        # the roofline has no host model (as before issue 26)
        self._host_s_per_launch = EAGER_HOST_S_PER_LAUNCH if self.cm.calibration is not None else 0.0
        self._default_launches = GPT_FAST_LAUNCHES_PER_LAYER
        compute = self.cm.compute  # the calibrated streaming rate, else the roofline's HBM rate
        self._stream_s_per_byte = float(getattr(compute, "stream_s_per_byte", 0.0)
                                        or 1.0 / compute.bytes_per_s)
        self._spans: dict[tuple, tuple[float, ...]] = {}  # decode_span_s answers
        self._span_models: dict[int, Any] = {}  # keeps the memo's keyed models alive

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cm, name)

    def _step(self, graph_s: float, model: Any, kernels: str, launches: Optional[int],
              extra_gpu_s: float = 0.0) -> float:
        """A step from the cost model's CUDA-graph time of it (GPU time + the graph replay overhead)
        and the engine's own GPU work beyond our kernels (``extra_gpu_s``: KV-cache copies)."""
        gen = self.engines.generation
        gpu_s = (max(0.0, graph_s - self._graph_overhead_s) + extra_gpu_s) * gen.gpu_time_scale
        if kernels == "graph":
            return max(gpu_s + self._graph_overhead_s, self.gen_gather_s)
        host_s_per_launch = self._host_s_per_launch * gen.host_time_scale
        host_s = model.num_layers * (launches or self._default_launches) * host_s_per_launch
        sync_s = model.num_layers * gen.host_syncs_per_layer * host_s_per_launch
        return max(gpu_s, host_s, self.gen_gather_s) + sync_s

    def _step_each(self, graph_s: np.ndarray, model: Any, kernels: str, launches: Optional[int],
                   extra_gpu_s: Any) -> np.ndarray:
        """:meth:`_step` of every step of a span at once: the same operations, elementwise."""
        gen = self.engines.generation
        gpu_s = (np.maximum(0.0, graph_s - self._graph_overhead_s) + extra_gpu_s) * gen.gpu_time_scale
        if kernels == "graph":
            return np.maximum(gpu_s + self._graph_overhead_s, self.gen_gather_s)
        host_s_per_launch = self._host_s_per_launch * gen.host_time_scale
        host_s = model.num_layers * (launches or self._default_launches) * host_s_per_launch
        sync_s = model.num_layers * gen.host_syncs_per_layer * host_s_per_launch
        return np.maximum(np.maximum(gpu_s, host_s), self.gen_gather_s) + sync_s

    def _kv_extra_s(self, model: Any, batch_size: int, context_tokens_total: Any, tp: int, pp: int) -> Any:
        """GPU time of a decode step's KV-cache passes beyond the one our kernel profiles include: the
        bytes one device holds for one micro-batch's pass through every layer (the pipeline rule of
        :meth:`CalibratedCompute._pipelined_s`), at the streaming rate."""
        extra_passes = self.engines.generation.kv_cache_passes - 1.0
        if extra_passes <= 0.0:
            return 0.0
        from harness.costmodel.llama import ModelDims, kv_bytes_per_token
        d = ModelDims.of(model)
        per_device = kv_bytes_per_token(d) * context_tokens_total / (min(tp, d.num_kv_heads) * min(pp, batch_size))
        return extra_passes * per_device * self._stream_s_per_byte

    def decode_step_s(self, model: Any, batch_size: int, context_tokens_total: float, tp: int = 1,
                      pp: int = 1, engine: str = "graph", launches_per_layer: Optional[int] = None) -> float:
        if batch_size <= 0:
            return 0.0
        if self.engines.generation.kv_cache:
            gpu_s = self.cm.decode_step_s(model, batch_size, context_tokens_total, tp, pp, "graph")
        else:  # the model runs over every sequence's whole context to produce its next token
            tokens = context_tokens_total + batch_size
            gpu_s = self.cm.prefill_s(model, tokens, tp, pp, tokens / batch_size, "graph")
        return self._step(gpu_s, model, engine, launches_per_layer,
                          self._kv_extra_s(model, batch_size, context_tokens_total, tp, pp))

    def decode_span_s(self, model: Any, batch_size: int, context_tokens_total: int, num_steps: int,
                      tp: int = 1, pp: int = 1, engine: str = "graph",
                      launches_per_layer: Optional[int] = None) -> tuple[float, ...]:
        """:meth:`CostModel.decode_span_s` under these engines (memoised per instance)."""
        key = (id(model), batch_size, context_tokens_total, num_steps, tp, pp, engine, launches_per_layer)
        hit = self._spans.get(key)
        if hit is None:
            if self.engines.generation.kv_cache and batch_size > 0 and num_steps <= self._short_span_steps:
                hit = tuple(self._step(g, model, engine, launches_per_layer, self._kv_extra_s(
                    model, batch_size, context_tokens_total + j * batch_size, tp, pp))
                    for j, g in enumerate(self.cm.decode_span_s(
                        model, batch_size, context_tokens_total, num_steps, tp, pp, "graph")))
            elif self.engines.generation.kv_cache and batch_size > 0:  # the cost model's span, then the step rule
                graph_s = np.asarray(self.cm.decode_span_s(model, batch_size, context_tokens_total, num_steps, tp, pp,
                                                           "graph"))
                contexts = context_tokens_total + np.arange(num_steps, dtype=np.int64) * batch_size
                hit = tuple(self._step_each(graph_s, model, engine, launches_per_layer,
                                            self._kv_extra_s(model, batch_size, contexts, tp, pp)).tolist())
            else:
                hit = tuple(self.decode_step_s(model, batch_size, context_tokens_total + j * batch_size, tp, pp,
                                               engine, launches_per_layer) for j in range(num_steps))
            self._spans[key] = hit
            self._span_models[id(model)] = model
        return hit

    def prefill_s(self, model: Any, num_tokens: float, tp: int = 1, pp: int = 1,
                  seq_len: Optional[float] = None, engine: str = "graph",
                  launches_per_layer: Optional[int] = None) -> float:
        if num_tokens <= 0:
            return 0.0
        gpu_s = self.cm.prefill_s(model, num_tokens, tp, pp, seq_len, "graph")
        return self._step(gpu_s, model, engine, launches_per_layer)

    def _score_traffic_s(self, bytes_per_score: float, model: Any, num_tokens: float, seq_len: float,
                         tp: int, num_layers: Optional[float]) -> float:
        """Seconds an eager attention spends streaming the score matrices of ``num_tokens`` tokens in
        sequences of ``seq_len`` (every query against every key: an eager kernel computes the masked
        half too) through ``num_layers`` layers, ``bytes_per_score`` bytes per element."""
        if bytes_per_score <= 0.0 or num_tokens <= 0:
            return 0.0
        from harness.costmodel.llama import ModelDims
        d = ModelDims.of(model)
        layers = d.num_layers if num_layers is None else num_layers
        heads_local = d.num_heads / min(tp, d.num_heads)
        return bytes_per_score * heads_local * num_tokens * seq_len * layers * self._stream_s_per_byte

    def forward_s(self, model: Any, num_tokens: float, seq_len: float, tp: int = 1,
                  num_layers: Optional[float] = None, include_head: Optional[bool] = None) -> float:
        t = self.engines.training
        time_s = self.cm.forward_s(model, num_tokens, seq_len, tp, num_layers, include_head)
        time_s += self._score_traffic_s(t.attention_score_bytes_forward, model, num_tokens, seq_len, tp,
                                        num_layers)
        return time_s * t.compute_time_scale

    def backward_s(self, model: Any, num_tokens: float, seq_len: float, tp: int = 1,
                   num_layers: Optional[float] = None, include_head: Optional[bool] = None,
                   recompute: Optional[str] = None) -> float:
        t = self.engines.training
        time_s = self.cm.backward_s(model, num_tokens, seq_len, tp, num_layers, include_head, recompute)
        score_bytes = t.attention_score_bytes_backward
        if (recompute or self.cm.recompute) in ("full", "selective"):  # both recompute the attention
            score_bytes += t.attention_score_bytes_forward
        time_s += self._score_traffic_s(score_bytes, model, num_tokens, seq_len, tp, num_layers)
        return time_s * t.compute_time_scale

    def optimizer_step_s(self, model: Any, dp: int = 1, tp: int = 1, pp: int = 1, zero_stage: int = 0) -> float:
        t = self.engines.training
        if not t.optimizer_offload:
            return self.cm.optimizer_step_s(model, dp, tp, pp, zero_stage)
        from harness.costmodel.compute import ADAM_BYTES_PER_PARAM
        from harness.costmodel.llama import ModelDims
        from harness.costmodel.memory import max_stage_params
        params = max_stage_params(ModelDims.of(model), pp) / tp / (dp if zero_stage >= 1 else 1)
        ranks_per_node = min(dp * tp * pp, self.cm.gpus_per_node)  # ranks sharing one host's memory
        cpu_s = params * ranks_per_node * ADAM_BYTES_PER_PARAM / (t.cpu_adam_gbps * 1e9)
        # fp16 gradients to the host, fp16 parameters back (ZeRO-Offload, Ren et al. ATC'21, section 4)
        pcie_s = 2 * self.cm.host_transfer_s(2.0 * params)
        return cpu_s + pcie_s
