"""Options without effect, refused by one rule; and the paths options name, which must exist.

Owns the rule "an option set on the command line that has no effect in the chosen configuration is
refused, not warned about" (a run whose printed config says something it did not do is not a
result), and the declarations it reads. Each option that applies only in some configurations says
so beside its schema, as data in its dataclass field's metadata::

    migration_frac: Optional[float] = field(default=None, metadata=effective_when(
        ("system.inter_stage", "==", True), why="long-tail migration is part of inter-stage fusion"))

A condition is ``(key, op, value)`` over the composed run config (``op``: ``==``, ``!=``, ``in``,
``not in``), or a :class:`Condition` with how it reads (``says``) and which key shows the actual
state (``shown``: a group option's ``name`` reads as the group, ``workload=hh_rlhf``). An option's
conditions all hold for it to apply; a declaration on a field covers every key below it
(``system.fused_search`` covers ``system.fused_search.max_steps``). Where whether an option applies
depends on what its value names (a training engine and the ZeRO stages it runs), the declaration
names a function of the value and the config instead (``effective_when(check=...)``), which returns
why it does not apply.

:func:`check_option_effects` takes the composed config and the command-line overrides the run
received (``harness.run.pipeline.execute``; for a sweep, each job's, ``harness.checks.command_line.check_command_line``)
and refuses the first override that sets an option whose conditions do not hold, naming the option
and the condition::

    system.migration_transfer=tokens has no effect with system.inter_stage=false (it applies only
    when system.inter_stage=true: ...); drop it or set system.inter_stage=true

Only overrides count: a value a YAML file or an interpolation sets is not the user's, and choosing a
whole group (``workload=jsonl``) sets none of its fields; a key set on the command line to its
default value is set. A condition naming a key the config does not have is a bug in the
declaration (:class:`DeclarationError`, not an input error), so a renamed key cannot silently
disable a condition (tests/harness/test_option_effects.py checks every declaration).

Fields declared with :func:`existing_path` name a file or directory that must exist wherever the
value comes from, on any backend (``model.<role>.checkpoint``); values with one of the declared
schemes (``pkg:<package>``) are not paths.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from harness.errors import ConfigError, OverrideError

EFFECT = "effective_when"  # field metadata key: an Effect
EXISTING_PATH = "existing_path"  # field metadata key: the schemes (prefixes) whose values are not paths
OPS = ("==", "!=", "in", "not in")
_ABSENT = object()


class DeclarationError(RuntimeError):
    """A declaration names a key the config does not have (a bug, not bad input)."""


def show(value: Any) -> str:
    """``value`` as it is written on the command line (``true``, ``null``, ``0.3``, ``[1, 2]``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value).removesuffix(".0")
    if isinstance(value, dict) and "name" in value:  # a group's option (engine.training=megatron), by its name
        return show(value["name"])
    return str(value)


@dataclass(frozen=True)
class Condition:
    key: str  # dotted key of the run config
    op: str  # one of OPS
    value: Any
    says: str = ""  # the condition as written when it holds (default: key=value)
    shown: str = ""  # the key whose value shows the actual state (default: key)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise DeclarationError(f"condition on {self.key}: op {self.op!r} is not one of {OPS}")

    def holds(self, actual: Any) -> bool:
        if self.op == "==":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        inside = actual in tuple(self.value)
        return inside if self.op == "in" else not inside

    def text(self) -> str:
        if self.says:
            return self.says
        if self.op in ("==", "!="):
            return f"{self.key}{'=' if self.op == '==' else '!='}{show(self.value)}"
        return f"{self.key} {self.op} {show(list(self.value))}"

    def actual_text(self, cfg: DictConfig) -> str:
        key = self.shown or self.key
        label = key[:-len(".name")] if key.endswith(".name") else key
        return f"{label}={show(lookup(cfg, key))}"


# The backends that execute a plan for real: they load weights and compute losses (the simulator
# does neither), so options of weights and losses apply on them only.
REAL_BACKENDS = ("harness.backends.ray.driver.backend.RayBackend",)
ON_REAL_BACKEND = Condition("backend._target_", "in", REAL_BACKENDS, says="backend=ray", shown="backend.name")


ConditionLike = Union[Condition, tuple]
# check(value, cfg) -> why the option does not apply with this value, or None
Check = Callable[[Any, DictConfig], Optional[str]]


@dataclass(frozen=True)
class Effect:
    """When an option has effect: every condition of ``when`` holds (and ``check``, if given,
    finds nothing wrong with its value)."""

    when: tuple[Condition, ...] = ()
    why: str = ""  # what the option is part of, read after the conditions
    fix: str = ""  # what to do instead of "set <the failing condition>"
    message: str = ""  # a whole refusal instead of the default; fields {option} {actual} {when} {why} {fix}
    check: Optional[Check] = None

    def refusal(self, option: str, failing: list[Condition], cfg: DictConfig) -> str:
        fields = {"option": option,
                  "actual": " and ".join(c.actual_text(cfg) for c in failing),
                  "when": " and ".join(c.text() for c in self.when),
                  "why": f": {self.why}" if self.why else "",
                  "fix": self.fix or "set " + " and ".join(c.text() for c in failing)}
        template = self.message or "{option} has no effect with {actual} (it applies only when {when}{why}); drop it or {fix}"
        return template.format(**fields)


def effective_when(*conditions: ConditionLike, why: str = "", fix: str = "", message: str = "",
                   check: Optional[Check] = None) -> dict[str, Effect]:
    """Field metadata: the option has effect only when every condition holds (see the module docstring)."""
    when = tuple(c if isinstance(c, Condition) else Condition(*c) for c in conditions)
    return {EFFECT: Effect(when, why, fix, message, check)}


def existing_path(*schemes: str) -> dict[str, tuple[str, ...]]:
    """Field metadata: a set value names a file or directory that must exist, unless it starts with
    one of ``schemes`` (e.g. ``pkg:``)."""
    return {EXISTING_PATH: tuple(schemes)}


# ---- reading the config ----------------------------------------------------------------------------

def lookup(cfg: DictConfig, key: str) -> Any:
    """The value at ``key``; :class:`DeclarationError` when the config has no such key."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            raise DeclarationError(f"a declared condition names {key}, which is not a key of the config "
                                   f"(renamed? update its declaration)")
        if OmegaConf.is_missing(node, part):
            return None
        node = node[part]
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def _schema(node: Any) -> Optional[type]:
    if not isinstance(node, DictConfig):
        return None
    kind = OmegaConf.get_type(node)
    return kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None


def _field(node: Any, name: str) -> Optional[dataclasses.Field]:
    schema = _schema(node)
    return next((f for f in dataclasses.fields(schema) if f.name == name), None) if schema else None


def effects_along(cfg: DictConfig, key: str) -> list[Effect]:
    """The declarations of ``key`` and of every key above it, outermost first."""
    found: list[Effect] = []
    node: Any = cfg
    for part in key.split("."):
        f = _field(node, part)
        if f is not None and EFFECT in f.metadata:
            found.append(f.metadata[EFFECT])
        if not isinstance(node, DictConfig) or part not in node or OmegaConf.is_missing(node, part):
            break
        node = node[part]
    return found


def declarations(cfg: DictConfig, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """``(key, field)`` of every field of the typed config ``cfg`` that declares an effect or a path."""
    schema = _schema(cfg)
    if schema is None:
        return
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        if EFFECT in f.metadata or EXISTING_PATH in f.metadata:
            yield key, f
        if f.name in cfg and not OmegaConf.is_missing(cfg, f.name):
            child = cfg[f.name]
            if isinstance(child, DictConfig):
                yield from declarations(child, key + ".")


# ---- the overrides ---------------------------------------------------------------------------------

def set_keys(cfg: DictConfig, overrides: Sequence[str]) -> list[str]:
    """The config keys the command-line ``overrides`` set, in their order: ``key=value`` and
    ``+key=value`` of keys the config has (a mapping value sets each key below it); not group
    choices (``workload=jsonl``, ``llama@model.critic=33b``) unless a declaration covers the group's
    key (``engine.training=megatron``), deletions, sweeps or ``hydra.*``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys: list[str] = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        key = o.key_or_group.replace("/", ".")  # a nested group's choice (engine/training=x) sets engine.training
        if o.is_delete() or o.package is not None or o.is_sweep_override() or key.split(".")[0] == "hydra":
            continue
        node = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
        if node is _ABSENT:
            continue
        if isinstance(node, DictConfig):  # a group option, or a mapping of values
            value = o.value()
            if isinstance(value, dict):
                keys += _leaves(key, value)
            elif effects_along(cfg, key):  # an option chosen where a declaration says when it applies
                keys.append(key)
            continue
        keys.append(key)
    return keys


def _leaves(prefix: str, value: dict) -> list[str]:
    out: list[str] = []
    for k, v in value.items():
        out += _leaves(f"{prefix}.{k}", v) if isinstance(v, dict) else [f"{prefix}.{k}"]
    return out


# ---- the checks ------------------------------------------------------------------------------------

def refusal(cfg: DictConfig, key: str) -> Optional[str]:
    """Why the option ``key`` has no effect in ``cfg`` (one line), or None when it applies."""
    option = f"{key}={show(lookup(cfg, key))}"
    for effect in effects_along(cfg, key):
        failing = [c for c in effect.when if not c.holds(lookup(cfg, c.key))]
        if failing:
            return effect.refusal(option, failing, cfg)
        if effect.check is not None:
            why = effect.check(lookup(cfg, key), cfg)
            if why:
                return f"{option} {why}"
    return None


def check_option_effects(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Refuse the first of ``overrides`` that sets an option without effect in ``cfg``
    (:class:`OverrideError`, one line), then any declared path that does not exist
    (:class:`ConfigError`). Before planning and before anything is written."""
    if "system" in cfg and OmegaConf.is_missing(cfg, "system"):
        return  # no system chosen: the runner says so
    for key in set_keys(cfg, overrides):
        why = refusal(cfg, key)
        if why:
            raise OverrideError(why)
    check_paths(cfg)


def check_paths(cfg: DictConfig) -> None:
    """Every field declared with :func:`existing_path` that is set names something that exists."""
    for key, f in declarations(cfg):
        if EXISTING_PATH not in f.metadata:
            continue
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None or str(value).startswith(f.metadata[EXISTING_PATH]):
            continue
        path = Path(str(value)).expanduser()
        if not path.exists():
            where = "" if path.is_absolute() else f" (in {Path.cwd()})"
            raise ConfigError(f"{key}={value}: no such file or directory{where}")
