"""Execution engines as data: what each framework's engines are, and which ones a run uses.

A system decides *where* and *in what layout* each PPO task runs (its :class:`~harness.core.plan.Plan`);
an execution engine is *how* the framework it reimplements runs that work on the GPUs: padding,
host overhead per step, how weights reach generation, optimizer offload, and how far its kernels
fall short of our per-op profiles. Two systems with the same plan differ by up to 10x in published
measurements for these reasons alone (../shared/published/README.md), so engines are data, shared by
every system. This module owns the facts; the rules that turn them into op times are the cost
model's (:mod:`harness.costmodel.engines`).

- a **generation engine** (:class:`GenerationEngine`, Hydra group ``engine/generation``, one file per
  engine under ``conf/engine/generation/``): static or continuous batching, CUDA graphs or an eager
  host loop (``launches_per_layer`` kernels issued from Python per layer per step), whether it
  generates from weights gathered once into its own layout or from the training engine's module in
  place (``weights``: under ZeRO-3 every step then all-gathers every layer), synced rounds under
  ZeRO-3, padding, how many times a step moves the KV cache (``kv_cache_passes``) and how often the
  host waits for the GPU (``host_syncs_per_layer``);
- a **training engine** (:class:`TrainingEngine`, group ``engine/training``, ``conf/engine/training/``):
  which parallelism it runs, CPU optimizer offload (ZeRO-Offload), whether its attention writes the
  score matrices to HBM (``attention_score_bytes_*``), the speed of its kernels.

Which engines run (:class:`EngineSelection`, the run config's ``engine``): each system names the
engines of the implementation it reimplements (``system.generation_engine`` /
``system.training_engine``); ``engine.generation=<name>`` (Hydra's spelling ``engine/generation=<name>``:
the option is composed into ``engine.generation``, whose fields can then be set one by one, e.g.
``engine.generation.launches_per_layer=40``) or ``engine.generation=<file.yaml>`` runs a system on
any compatible engine, likewise ``engine.training``. The chosen engines, with their fitted constants
resolved (:func:`select_engines`), are plan data (``Plan.engines``).

Fitted constants. Every mechanism constant is cited in its YAML file. The few no measurement gives
(:data:`FITTED_PRIORS`: a GPU-time factor per generation engine and its host time, in seconds per step
for a CUDA-graph engine and as a factor on its launches for an eager one; a reloading engine's refit,
fixed seconds and seconds per GB; a compute factor per training engine; the CPU optimizer's streaming
rate) are fitted by ``python -m harness.replay FILE --fit`` on the published measurements of
``data/published/replay.jsonl`` and stored, with their provenance, in ``data/engines/fitted.json``;
they are shared by every run of an engine, never per point. ``engine.constants`` puts another table
in force (the fit itself passes its trial constants this way); ``engine.fitted=false`` runs with every
fitted constant at its prior (factors 1, CPU Adam at its placeholder rate): the mechanisms alone.
With DeepSpeed-Chat's generation engine of ``benchmarks/engines_before/ds_hybrid_unpadded_prompts.yaml`` that is
the simulator without engines (``benchmarks/fig7_engines.py``). See docs/VALIDATION.md.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union, get_type_hints

from omegaconf import OmegaConf

from harness.errors import ConfigError, PlanError
from harness.core.files import file_kind
from harness.core.option_effects import effective_when

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = ROOT / "conf" / "engine"
FITTED_PATH = ROOT / "data" / "engines" / "fitted.json"
KINDS = ("generation", "training")
# ConfigStore schema of each kind (group ``schema``); an engine file extends it with
# ``defaults: [{/schema@_here_: <kind>_engine}, _self_]``.
SCHEMA_NAMES = {"generation": "generation_engine", "training": "training_engine"}

# The fitted constants of each kind of engine and their priors (the value when unfitted).
# The prior of the CPU optimizer's rate: a two-socket DGX A100 host (2 x AMD EPYC 7742, 8 channels of
# DDR4-3200 each: 409.6 GB/s peak, AMD datasheet) streaming Adam's states at about an eighth of peak,
# since eight ranks' optimizer processes share it. A placeholder until fitted (data/engines/fitted.json).
# The prior of a CUDA-graph engine's host time per step: vLLM's RFC on multi-step scheduling
# (vllm-project/vllm#6854, Jul 2024) traces "about 4ms of GPU bubble" per decode step, the GPU idle
# while the host sends the sampled tokens back, runs the scheduler and prepares the next step's inputs
# ("5-13ms of GPU bubble" across its runs); host work, so the same seconds on every GPU generation.
# The priors of a reloading engine's refit (``refit: reload``), placeholders until fitted on the published
# refit stage times (data/engines/fitted.json): ``reload_s`` the seconds of waking the engine's weights
# and KV cache and putting the training states in host memory, each wake of vLLM's sleep mode ~0.1-0.4 s
# (vLLM blog, "Zero-Reload Model Switching with vLLM Sleep Mode", 2025-10); ``reload_s_per_gb`` the
# model's bf16 bytes streamed once through the gather, conversion and loader at 25 GB/s (a PCIe 4.0
# x16 link's rate).
FITTED_PRIORS = {
    "generation": {"gpu_time_scale": 1.0, "host_time_scale": 1.0, "host_s_per_step": 0.004,
                   "reload_s": 1.0, "reload_s_per_gb": 0.04},
    "training": {"compute_time_scale": 1.0, "cpu_adam_gbps": 50.0},
}
# ``kind/fit_key -> {constant: value}``: the fit file's table, or one given as ``engine.constants``.
FittedTable = dict[str, dict[str, float]]


@dataclass(frozen=True)
class GenerationEngine:
    """How the actor's generation runs (see the module docstring); the schema of ``engine/generation``."""

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
    # continuous batching's KV memory: reserve (prompt + max_gen_len per sample at admission, never
    # preempted) | on_demand (paged: held as tokens arrive; the latest admitted preempted and
    # recomputed when the cache is full, vLLM's default; harness.planning.taskmodels.generation)
    kv_allocation: str = "reserve"
    # times a decode step moves the KV cache's bytes (reads plus writes). Our kernel profiles read it
    # once (gpt-fast's static cache, as a paged or preallocated cache is); every pass beyond the
    # first costs its bytes at the measured streaming rate (copies made by the framework's Python)
    kv_cache_passes: float = 1.0
    # host-device synchronisations per layer per step (a ``.item()`` or ``nonzero`` in the model
    # code): the host cannot run ahead of the GPU across one, and the GPU idles until the host
    # issues the next kernel, so each costs one launch of host time on top of the step
    host_syncs_per_layer: int = 0
    # how the new weights reach the engine on the GPUs it shares with training (the actor's weight
    # movement into the generation layout, colocated): transfer (the bytes move between the two
    # layouts and nothing more: ReaLHF's reallocation, DeepSpeed's hybrid engine) or reload (the
    # framework's refit: training states out to host memory, the engine's weights woken, every
    # parameter gathered into full tensors, converted to the engine's names and handed to its weight
    # loader, the KV cache woken; a fixed reload_s plus reload_s_per_gb per GB of the model's bf16
    # weights, done even where both layouts are the same). Weights broadcast to generation GPUs of
    # their own (param_sync) are timed as their transfer either way.
    refit: str = "transfer"
    # fitted (None: the table in force, else the prior)
    gpu_time_scale: Optional[float] = None  # GPU time of a step relative to our kernel profiles
    # eager engines: host time per kernel launch relative to gpt-fast's eager loop (the calibrated
    # EAGER_HOST_S_PER_LAUNCH); a framework's Python per layer (module hooks, generate()'s logits
    # processing) costs more than gpt-fast's. No effect on CUDA-graph engines.
    host_time_scale: Optional[float] = None
    # graph engines: seconds of host work per step (prefill or decode) that the GPU waits for: sampled
    # tokens copied back, the scheduler, the next step's inputs. It runs on the CPU, so it does not
    # shrink on a faster GPU, as gpu_time_scale's share does. No effect on eager engines, whose host
    # time is their launches.
    host_s_per_step: Optional[float] = None
    # refit: reload only: the refit's fixed seconds and its seconds per GB of the model's bf16 weights
    reload_s: Optional[float] = None
    reload_s_per_gb: Optional[float] = None
    fit_key: Optional[str] = None  # engines sharing fitted constants (None: its own name)
    source: str = ""  # where the mechanism facts come from

    def __post_init__(self) -> None:
        _check_choice(self.name, "batching", self.batching, ("continuous", "static"))
        _check_choice(self.name, "kernels", self.kernels, ("graph", "eager"))
        _check_choice(self.name, "weights", self.weights, ("inference_layout", "training_layout"))
        _check_choice(self.name, "kv_allocation", self.kv_allocation, ("reserve", "on_demand"))
        _check_choice(self.name, "refit", self.refit, ("transfer", "reload"))
        if self.kv_allocation != "reserve" and self.batching != "continuous":
            raise ConfigError(f"generation engine {self.name}: kv_allocation={self.kv_allocation} needs "
                              f"batching=continuous (static rounds hold their padded batch's cache)")
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
    """How forward/backward passes and optimizer steps run (training and ref/reward/critic
    inference); the schema of ``engine/training``."""

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
    # fitted (None: the table in force, else the prior)
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


Engine = Union[GenerationEngine, TrainingEngine]
ENGINE_TYPES: dict[str, type] = {"generation": GenerationEngine, "training": TrainingEngine}


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


@dataclass
class EngineSelection:
    """``engine.*`` of the run config: which engines run the plan. Each of ``generation`` and
    ``training`` is null (the system's default), an engine name or a YAML path, or the engine
    composed from its group (``engine/generation=<name>``)."""

    generation: Any = None
    # a training engine that cannot run the ZeRO stages the system's config asks for is refused
    # (training_engine_applies)
    training: Any = field(default=None, metadata=effective_when(
        check=lambda value, cfg: training_engine_applies(value, cfg)))
    fitted: bool = True  # false: every fitted constant at its prior (the mechanism model alone)
    # the table of fitted constants in force (kind/fit_key -> {constant: value}, checked by
    # table_in_force) instead of data/engines/fitted.json's; constants it does not name are at their
    # priors. Untyped for Hydra: an override merges a mapping into it, which a typed null refuses.
    constants: Any = field(default=None, metadata=effective_when(
        ("engine.fitted", "==", True), why="with engine.fitted=false every fitted constant is at its prior"))


def _check_choice(name: str, key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"engine {name}: {key}={value!r}, expected one of {allowed}")


def schema_node(kind: str) -> Any:
    """The typed config of ``kind``'s engine for Hydra's ConfigStore: its dataclass, writable while
    Hydra merges an engine file into it (a frozen dataclass is read-only to OmegaConf)."""
    node = OmegaConf.structured(ENGINE_TYPES[kind])
    OmegaConf.set_readonly(node, False)
    return node


def available(kind: str) -> list[str]:
    """Engine names under ``conf/engine/<kind>/`` (the options of the group ``engine/<kind>``)."""
    return sorted(p.stem for p in (ENGINE_DIR / kind).glob("*.yaml"))


# ---- the command line's spelling of a choice --------------------------------------------------------

def engine_group_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with each ``engine.<kind>=<name>`` that names engines of the group (one, or a
    sweep of them) written as Hydra's group choice ``engine/<kind>=<name>``, so that Hydra composes
    the engine; a YAML path, an unknown name or anything else is left as it is (a value the harness
    reads: :func:`load_engine`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = []
    for line in overrides:
        key, sep, value_text = line.partition("=")
        kind = key.removeprefix("engine.")
        if not sep or key != f"engine.{kind}" or kind not in KINDS:
            out.append(line)
            continue
        try:
            override = parser.parse_override(line)
        except Exception:  # noqa: BLE001 - unreadable: Hydra says why
            out.append(line)
            continue
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator()) if override.is_discrete_sweep() else []
        else:
            values = [override.value()]
        names = set(available(kind))
        if values and all(isinstance(v, str) and v in names for v in values):
            out.append(f"engine/{kind}={value_text}")
        else:
            out.append(line)
    return out


def engine_key_overrides(overrides: Sequence[str]) -> list[str]:
    """The inverse of :func:`engine_group_overrides` on the overrides Hydra reports (``engine/<kind>=x``
    back to ``engine.<kind>=x``): the spelling results folders, refusals and records use."""
    out = []
    for line in overrides:
        for kind in KINDS:
            if line.startswith(f"engine/{kind}="):
                line = f"engine.{kind}=" + line[len(f"engine/{kind}="):]
        out.append(line)
    return out


# ---- engine files -----------------------------------------------------------------------------------

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


def load_engine(kind: str, name_or_path: str) -> Engine:
    """The engine ``name_or_path`` of ``kind`` as written in its YAML file (fitted constants
    unresolved), read as Hydra reads a group option: a ``defaults`` list naming the kind's schema is
    allowed, integers given for numbers are numbers. A file that is not YAML, not a mapping, has
    unknown keys or values of the wrong type is refused (ConfigError naming the file and the line)."""
    if kind not in KINDS:
        raise ValueError(f"engine kind must be one of {KINDS}, not {kind!r}")
    cls = ENGINE_TYPES[kind]
    path = _engine_file(kind, name_or_path)
    data, lines = _read_engine_yaml(path, kind)
    if data.get("defaults") == [{"/schema@_here_": SCHEMA_NAMES[kind]}, "_self_"]:
        del data["defaults"]
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
        if _base_type(hints[key]) is float and value is not None:
            data[key] = float(value)
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


def _base_type(hint: Any) -> Any:
    """``X`` of a field typed ``X`` or ``Optional[X]``."""
    args = getattr(hint, "__args__", ())
    others = [a for a in args if a is not type(None)]
    return others[0] if type(None) in args and len(others) == 1 else hint


def _type_problem(value: Any, hint: Any) -> Optional[str]:
    """What ``value`` must be for an engine field of type ``hint`` ('a string', 'an integer', 'a
    number', 'true or false', with ' or null' for an optional field) when it is not that; None when
    it is, or when the field's type is not one that is checked."""
    optional = type(None) in getattr(hint, "__args__", ())
    base = _base_type(hint)
    if base not in _CHECKED_TYPES:
        return None
    name, types = _CHECKED_TYPES[base]
    if value is None:
        ok = optional
    else:  # a bool is an int to Python, never a number here
        ok = isinstance(value, types) and (base is bool or not isinstance(value, bool))
    return None if ok else name + (" or null" if optional else "")


def engine_of(kind: str, choice: Any) -> Engine:
    """The engine a value of ``engine.<kind>`` stands for: an engine itself (composed from its
    group), the mapping of one, or a name or YAML path (:func:`load_engine`)."""
    if OmegaConf.is_config(choice):
        choice = OmegaConf.to_object(choice)
    if isinstance(choice, ENGINE_TYPES[kind]):
        return choice
    if isinstance(choice, dict):
        return ENGINE_TYPES[kind](**choice)
    return load_engine(kind, str(choice))


# ---- fitted constants -------------------------------------------------------------------------------

def fitted_table(path: Path = FITTED_PATH) -> FittedTable:
    """``kind/fit_key -> {constant: value}`` from the fit file (empty when there is none)."""
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("constants", {})


def fit_key(kind: str, engine: Engine) -> str:
    return f"{kind}/{engine.fit_key or engine.name}"


def resolve(kind: str, engine: Engine, table: Optional[FittedTable]) -> Engine:
    """``engine`` with every fitted constant set: the value its YAML pins, else ``table``'s (None:
    every constant at its prior), else the prior."""
    fitted = (table or {}).get(fit_key(kind, engine), {})
    values = {}
    for key, prior in FITTED_PRIORS[kind].items():
        pinned = getattr(engine, key)
        values[key] = float(pinned if pinned is not None else fitted.get(key, prior))
    return replace(engine, **values)


def table_in_force(selection: Any) -> Optional[FittedTable]:
    """The fitted constants a selection runs with: None with ``fitted=false`` (the priors), else
    ``constants`` when given (ConfigError unless it maps ``kind/fit_key`` to ``{constant: number}``
    for constants of :data:`FITTED_PRIORS`), else the fit file's."""
    if not bool(getattr(selection, "fitted", True)):
        return None
    given = getattr(selection, "constants", None)
    if given is None:
        return fitted_table()
    table = OmegaConf.to_container(given) if OmegaConf.is_config(given) else given
    expected = ("engine.constants maps kind/fit_key (generation/vllm) to {constant: number}, the "
                f"constants of {FITTED_PRIORS}")
    if not isinstance(table, dict):
        raise ConfigError(f"engine.constants={table!r}: {expected}")
    for key, values in table.items():
        kind = str(key).partition("/")[0]
        if kind not in KINDS or not isinstance(values, dict) or not all(
                name in FITTED_PRIORS[kind] and isinstance(v, (int, float)) and not isinstance(v, bool)
                for name, v in values.items()):
            raise ConfigError(f"engine.constants: {key}={values!r}: {expected}")
    return {str(key): {str(name): float(v) for name, v in values.items()} for key, values in table.items()}


# ---- the run's engines ------------------------------------------------------------------------------

def chosen_engines(selection: Any, system_cfg: Any) -> dict[str, Engine]:
    """``kind -> engine`` (fitted constants unresolved): ``engine.*`` where set, else the system's
    defaults (``system.generation_engine`` / ``system.training_engine``)."""
    chosen = {}
    for kind in KINDS:
        choice = getattr(selection, kind, None) or getattr(system_cfg, f"{kind}_engine", None)
        if not choice:
            raise ConfigError(f"system {getattr(system_cfg, 'name', '?')} names no default {kind} engine "
                              f"(system.{kind}_engine); set engine.{kind}=<{'|'.join(available(kind))}>")
        chosen[kind] = engine_of(kind, choice)
    return chosen


def select_engines(selection: Any, system_cfg: Any) -> Engines:
    """The run's engines (:func:`chosen_engines`), fitted constants resolved with the table in force
    (:func:`table_in_force`)."""
    table = table_in_force(selection)
    chosen = {kind: resolve(kind, engine, table) for kind, engine in chosen_engines(selection, system_cfg).items()}
    return Engines(chosen["generation"], chosen["training"])


# ZeRO stages each training parallelism runs: DeepSpeed ZeRO all of them; Megatron-LM's distributed
# optimizer shards the optimizer states over the data-parallel ranks (ZeRO-1), never the gradients or
# the weights.
ZERO_STAGES = {"zero": (0, 1, 2, 3), "megatron": (0, 1)}
PARALLELISM = {"zero": "DeepSpeed ZeRO data parallelism",
               "megatron": "Megatron-LM 3D parallelism, whose distributed optimizer is ZeRO-1"}


def training_engine_applies(choice: Any, cfg: Any) -> Optional[str]:
    """Why the training engine ``choice`` (``engine.training``: a name, a path or a composed engine)
    does not apply to the plans of the run's system (``cfg.system``), or None: every ZeRO stage the
    system's config sets (``system.zero_stage`` and each ``system.*_zero_stage`` that is not null)
    must be one the engine runs (:data:`ZERO_STAGES`). The reason names the training engines that do."""
    system = cfg.get("system") if choice is not None else None
    if system is None or not hasattr(system, "keys"):
        return None
    stages = {}
    for key in system.keys():
        if key == "zero_stage" or str(key).endswith("_zero_stage"):
            value = system[key]
            if isinstance(value, int) and not isinstance(value, bool):
                stages[f"system.{key}"] = value
    engine = engine_of("training", choice)
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
    """Refuse a plan its engines cannot run (PlanError naming the engine); ``allocations``: the
    layouts of the tasks the plan has."""
    gen, train = engines.generation, engines.training
    if migration and gen.batching != "continuous":
        raise PlanError(f"generation engine {gen.name} batches statically; long-tail migration needs a "
                        f"continuous-batching engine (engine.generation=vllm)")
    if train.optimizer_offload:
        for name in ("update_actor", "update_critic"):
            if name in allocations and allocations[name].strategy.zero_stage < 1:
                raise PlanError(f"training engine {train.name} offloads the optimizer (ZeRO-Offload), which "
                                f"DeepSpeed runs with ZeRO stages 1-3 only; task {name} is ZeRO-0")
    if train.parallelism == "zero":
        for name in ("update_actor", "update_critic", "logprobs", "ref", "reward", "values"):
            if name not in allocations:  # a task the run's algorithm does not have
                continue
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
    """The :class:`~harness.core.plan.GenerationPolicy` fields the generation engine decides for a
    plan: its batching, whether its rounds are synced (under ZeRO-3 actor weights only) and padded,
    how its KV memory is allocated. Its kernels are not among them: the cost model reads them from the plan's engines."""
    gen = engines.generation
    return {"batching": gen.batching, "synced_instances": gen.synced_under_zero3 and zero3_actor,
            "pad_to_longest": gen.pad_to_longest, "kv_allocation": gen.kv_allocation}
