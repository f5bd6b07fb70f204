"""Checks of the command line and of batch sizes before any work starts.

:func:`check_command_line` composes the config ``python -m harness <argv>`` would run with -- for a
sweep (``-m``, or an experiment with ``hydra.mode: MULTIRUN``), the config of every job the basic
sweeper would launch -- before Hydra starts, and turns Hydra's multi-line composition errors into one
line naming the bad override and the closest valid spellings (:func:`difflib.get_close_matches`
over the keys at that level of the config, or over the options of the group)::

    error: unknown key system.migraton_frac (did you mean system.migration_frac?)
    error: unknown option model=13bb (did you mean model=13b or model=13b_33b?)

A value with a character Hydra's override grammar reads only inside quotes is answered with the
rewrite that parses (one line)::

    error: cannot parse override 'experiment_name=café': Hydra's override grammar reads the character
    'é' only inside quotes; quote the value: 'experiment_name="café"'

A sweep with many jobs shows the pre-check's progress on a terminal (:class:`SweepCheckProgress`).
It also refuses ``+key=value`` overrides that add a key a typed config does not declare (Hydra
accepts them and the run silently ignores them), and reads the input files each composed config
names (:func:`check_input_files`: profile table, workload file, engine files, calibration), each
distinct file once, so a bad file ends a sweep once, before any job. The entry point
(:func:`harness.cli.app.run`) prints the message on stderr and exits 2.

:func:`check_batch_sizes` refuses a system's own batch sizes (``system.*batch_size``) that are zero
or negative; the workload's are checked by :func:`harness.core.workload.validate_workload`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import shutil
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from harness.errors import ConfigError, OverrideError
from harness.core.option_effects import check_option_effects

CONFIG_NAME = "config"
# Hydra's own groups and the schemas' group: not something a user means at the top level.
_HIDDEN_GROUPS = ("hydra", "schema")
# Config lines in Hydra/OmegaConf messages that only repeat what the one-line message already says.
_NOISE = ("full_key:", "object_type=", "reference_type=", "Config search path", "provider=",
          "Set the environment variable HYDRA_FULL_ERROR", "See https://hydra.cc")


# ---- command line ---------------------------------------------------------------------------------

def check_command_line(argv: Sequence[str]) -> None:
    """Raise :class:`OverrideError` (one line) if ``argv`` names a key or a group option that does not
    exist, has a value of the wrong type or cannot be parsed; in a sweep, for any job. Returns
    without checking for Hydra's informational flags (``--help``, ``--info``, shell completion), for
    a config directory or name other than the harness's, and with ``HYDRA_FULL_ERROR=1`` (Hydra then
    reports the error itself, with its stack trace)."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(list(argv))
    if (args.help or args.hydra_help or args.info or args.shell_completion or args.config_dir
            or args.config_path or args.config_name or os.environ.get("HYDRA_FULL_ERROR") == "1"):
        return
    from hydra.types import RunMode

    overrides = list(args.overrides)
    with _hydra() as hydra, SweepCheckProgress() as progress:
        _check_duplicates(hydra, overrides)
        multirun = args.multirun or (_may_set_mode(overrides) and
                                     hydra.get_mode(config_name=CONFIG_NAME, overrides=overrides) == RunMode.MULTIRUN)
        if not multirun:
            cfg = _compose(hydra, overrides, RunMode.RUN)
            _check_added_keys(hydra, cfg, overrides, RunMode.RUN)
            check_option_effects(cfg, overrides)
            check_input_files(cfg)
            return
        master = _compose(hydra, overrides, RunMode.MULTIRUN)
        files_checked: dict[tuple[str, str], Optional[str]] = {}
        for index, job in enumerate(progress.over(sweep_jobs(hydra, master))):
            try:
                cfg = _load_job(hydra, master, job)
                _check_added_keys(hydra, cfg, job, RunMode.RUN)
                check_option_effects(cfg, job)
            except OverrideError as e:
                if index == 0:
                    raise
                raise OverrideError(f"{e} in sweep job {' '.join(job)}") from None
            check_input_files(cfg, files_checked)


def _may_set_mode(overrides: Sequence[str]) -> bool:
    """Whether ``overrides`` may make the run a sweep without ``-m``: only an experiment's config
    (``hydra.mode: MULTIRUN``) or ``hydra.mode`` itself set it; conf/config.yaml and the other groups
    do not (so the full composition that reads the mode is needed only then)."""
    return any(o.lstrip("+~").startswith(("experiment=", "hydra.mode=")) for o in overrides)


def check_input_files(cfg: DictConfig, checked: Optional[dict[tuple[str, str], Optional[str]]] = None) -> None:
    """Read the input files the composed ``cfg`` names, as the run would: ``backend.profile_table``
    (parsed), ``workload.path`` (a regular file), ``engine.generation`` / ``engine.training`` (a
    YAML path or an engine name: parsed; an engine composed from its group: its values checked) and,
    with ``cluster.cost_model=calibrated``,
    ``cluster.calibration`` (parsed). Raises :class:`ConfigError` (one line naming the file and the
    line) for the first bad one. ``checked`` holds the outcome per file across the jobs of a sweep,
    so each distinct file is read once."""
    from harness.costmodel.calibrated import Calibration
    from harness.costmodel.profile import load_profile_table
    from harness.core.engines import KINDS, load_engine
    from harness.core.workload import resolve_workload_path

    checked = {} if checked is None else checked

    def value(key: str) -> Optional[str]:
        try:
            found = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        except OmegaConfBaseException:  # an interpolation that fails: the run reports it
            return None
        return str(found) if found not in (None, "") else None

    def calibration(name: str) -> None:
        try:
            Calibration.load(name)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    checks = [("backend.profile_table", value("backend.profile_table"), load_profile_table),
              ("workload.path", value("workload.path"), resolve_workload_path)]
    for kind in KINDS:
        if isinstance(OmegaConf.select(cfg, f"engine.{kind}", default=None), DictConfig):
            OmegaConf.to_object(cfg.engine[kind])  # composed from engine/<kind>: the engine checks its values
        else:
            checks.append((f"engine.{kind}", value(f"engine.{kind}"), lambda name, kind=kind: load_engine(kind, name)))
    if value("cluster.cost_model") == "calibrated":
        checks.append(("cluster.calibration", value("cluster.calibration"), calibration))
    for key, name, check in checks:
        if name is None:
            continue
        if (key, name) not in checked:
            try:
                check(name)
                checked[key, name] = None
            except ConfigError as e:
                checked[key, name] = str(e)
        if checked[key, name] is not None:
            raise ConfigError(checked[key, name])


def sweep_jobs(hydra: Any, master: DictConfig) -> list[list[str]]:
    """Override lists of jobs of the sweep of ``master`` (the multirun config) that between them
    use every value of every sweep: the first job (first value of each sweep), then for each sweep
    each further value with the other sweeps at their first values (1 + sum(len - 1) jobs, not the
    product; Hydra's basic sweeper composes every job itself before launching any, with its own
    multi-line message for a combination of two later values that fails)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = master.hydra.sweeper.get("params", None) or {}
    lines = [f"{k}={v}" for k, v in params.items()] + list(master.hydra.overrides.task)
    parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(lines)
    choices: dict[str, list[str]] = {}  # as BasicSweeper.split_arguments: a later override of a key wins
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            choices[key] = [f"{key}={o.get_value_element_as_str()}"]
        elif o.is_discrete_sweep():
            choices[key] = [f"{key}={v}" for v in o.sweep_string_iterator()] or [f"{key}="]
        # other sweeps (ranges and intervals of non-basic sweepers): not expanded
    first = [values[0] for values in choices.values()]
    jobs = [first]
    for i, values in enumerate(choices.values()):
        jobs += [[*first[:i], value, *first[i + 1:]] for value in values[1:]]
    return jobs


# A sweep's pre-check composes each job's config (about 0.1 s a job); with more jobs than this it
# shows its progress on a terminal, updated every PROGRESS_INTERVAL_S.
PROGRESS_MIN_JOBS = 20
PROGRESS_INTERVAL_S = 0.5


class SweepCheckProgress:
    """The progress of a sweep's pre-check, on stderr: one line rewritten in place (jobs checked,
    time left) while stderr is a terminal and the sweep has more than :data:`PROGRESS_MIN_JOBS`
    jobs, erased when the check ends however it ends (passed, refused, Ctrl-C), so a refused
    command still leaves only its one ``error: ...`` line. Nothing when stderr is not a terminal (a
    log would keep every update)."""

    def __init__(self, stream: Any = None):
        self.stream = sys.stderr if stream is None else stream
        self.shown = False

    def __enter__(self) -> "SweepCheckProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")  # back to the line's start, erase to its end
            self.stream.flush()
            self.shown = False

    def over(self, jobs: Sequence[list[str]]) -> Iterator[list[str]]:
        """``jobs``, one by one, with the progress line updated between them."""
        num_jobs = len(jobs)
        try:
            visible = num_jobs > PROGRESS_MIN_JOBS and self.stream.isatty()
        except (AttributeError, ValueError):  # not a file, or closed
            visible = False
        start_s = last_s = time.monotonic()
        for num_done, job in enumerate(jobs):
            now_s = time.monotonic()
            if visible and now_s - last_s >= PROGRESS_INTERVAL_S:
                last_s = now_s
                left_s = (now_s - start_s) / max(num_done, 1) * (num_jobs - num_done)
                line = (f"[harness] checking the sweep's {num_jobs:,} jobs: {num_done:,} done, "
                        f"about {_duration(left_s)} left")
                width = shutil.get_terminal_size().columns - 1  # a wrapped line would not be erased
                self.stream.write("\r" + line[:width] + "\x1b[K")
                self.stream.flush()
                self.shown = True
            yield job


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@contextmanager
def _hydra() -> Iterator[Any]:
    """The Hydra object ``python -m harness`` builds (config module ``conf``, with the harness's and
    the systems' schemas registered), for composing."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from harness.backends import register_backend_configs
    from harness.core.config import register_configs
    from harness.system import discover_systems

    register_configs()
    register_backend_configs()
    discover_systems()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="conf", version_base="1.3", job_name="app"):
            yield GlobalHydra.instance().hydra
    finally:
        GlobalHydra.instance().clear()


def _compose(hydra: Any, overrides: list[str], run_mode: Any) -> DictConfig:
    try:
        return hydra.compose_config(config_name=CONFIG_NAME, overrides=list(overrides), run_mode=run_mode)
    except Exception as e:  # noqa: BLE001 - Hydra and OmegaConf errors, described in one line
        raise OverrideError(_swept_group_value(e, hydra, overrides)
                            or describe_error(e, hydra, overrides, run_mode)) from None


def _swept_group_value(error: BaseException, hydra: Any, overrides: list[str]) -> Optional[str]:
    """``-m +system=a,b system.zero_stage=1``: Hydra composes the sweep's own config (before any
    job) without the swept groups, so it cannot set a key inside one; a one-value sweep is applied
    per job instead."""
    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    full_key = getattr(cause, "full_key", None)
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or not full_key:
        return None
    parsed = _parse(hydra, overrides)
    group = str(full_key).split(".")[0]
    if not any(o.key_or_group == group and o.package is None and o.is_sweep_override() for o in parsed):
        return None
    line = _override_for_key(hydra, overrides, str(full_key))
    if line is None or line.is_sweep_override():
        return None
    value = line.get_value_element_as_str()
    return (f"{line.input_line} cannot be set while {group} is swept (Hydra composes the sweep before it "
            f"chooses a {group}); write it as a one-value sweep: {line.get_key_element()}=choice({value})")


def _load_job(hydra: Any, master: DictConfig, job: list[str]) -> DictConfig:
    from hydra.types import RunMode

    try:
        return hydra.config_loader.load_sweep_config(master, list(job))
    except Exception as e:  # noqa: BLE001
        raise OverrideError(describe_error(e, hydra, job, RunMode.RUN)) from None


# ---- one-line descriptions ------------------------------------------------------------------------

def describe_error(error: BaseException, hydra: Any, overrides: list[str], run_mode: Any) -> str:
    """One line for a Hydra/OmegaConf composition error of ``overrides`` (without ``error: ``)."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(error, OverrideParseException):
        hint = _unreadable_character_hint(error.override, error.message)
        return f"cannot parse override {error.override!r}: {hint or one_line(error.message)}"
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options is not None:
        return _unknown_option(error.missing_cfg_file, list(error.options), hydra, overrides)
    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and full_key:
        return _unknown_key(str(full_key), hydra, overrides, run_mode, getattr(cause, "object_type", None))
    if isinstance(cause, OmegaConfBaseException):
        line = _override_for_key(hydra, overrides, str(full_key)) if full_key else None
        where = line.input_line if line is not None else (full_key or "")
        return f"{where}: {one_line(str(cause))}" if where else one_line(str(cause))
    return one_line(str(error))


_LEXER_ERROR = "LexerNoViableAltException: "
# Characters that separate the elements of a list, dict or sweep in an override's value.
_VALUE_DELIMITERS = ",[]{}()"


def _unreadable_character_hint(override: str, message: str) -> Optional[str]:
    """For a value with a character Hydra's override grammar reads only inside quotes (non-ASCII
    letters, ``~``, ``&``, a newline, ...): what to write instead, checked with Hydra's parser --
    the element quoted, or, for a path starting with ``~``, the home folder written out. None when
    the parse error is of another kind, is in the key, or no rewrite parses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not message.startswith(_LEXER_ERROR + override + "\n"):
        return None
    # Hydra's message: the override, then a line with '^' under the character the lexer stopped at
    caret_line = message[len(_LEXER_ERROR + override) + 1:].partition("\n")[0]
    index = caret_line.find("^") - len(_LEXER_ERROR)
    key, sep, _ = override.partition("=")
    if not sep or not len(key) < index < len(override):
        return None
    start = max([len(key)] + [override.rfind(c, len(key) + 1, index) for c in _VALUE_DELIMITERS]) + 1
    end = min([i for i in (override.find(c, index) for c in _VALUE_DELIMITERS) if i >= 0], default=len(override))
    element, char = override[start:end].strip(), override[index]

    def parses(text: str) -> bool:
        try:
            OverridesParser.create().parse_override(text)
            return True
        except Exception:  # noqa: BLE001 - not readable either
            return False

    def rewritten(new: str) -> str:
        text = override[:start] + new + override[end:]
        return text if parses(text) else ""

    home = os.path.expanduser(element) if element.startswith("~/") else element
    if home != element:  # a path in the home folder: written out, it reads the same wherever it is used
        for new in (home, '"' + home.replace('"', '\\"') + '"'):
            if rewritten(new):
                return (f"Hydra's override grammar cannot read the character {char!r} here; write the home "
                        f"folder out: {_shell_word(rewritten(new))}")
    quoted = "'" + element + "'" if '"' in element and "'" not in element else '"' + element.replace('"', '\\"') + '"'
    if not rewritten(quoted):
        return None
    return (f"Hydra's override grammar reads the character {char!r} only inside quotes; quote the value: "
            f"{_shell_word(rewritten(quoted))}")


def _shell_word(text: str) -> str:
    """``text`` as one shell word on one line: POSIX quoting, or bash's ``$'...'`` when it holds
    a newline or another unprintable character."""
    import shlex

    if text.isprintable():
        return shlex.quote(text)
    escapes = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return "$'" + "".join(escapes.get(c, c if c.isprintable() else f"\\x{ord(c):02x}") for c in text) + "'"


def one_line(message: str) -> str:
    """The informative lines of a (multi-line) Hydra or OmegaConf message, joined with '; '."""
    lines = [s.strip() for s in str(message).splitlines()]
    return "; ".join(s for s in lines if s and not s.startswith(_NOISE)) or str(message).strip()


def close_matches(word: str, candidates: Sequence[str], n: int = 3) -> list[str]:
    return difflib.get_close_matches(word, list(dict.fromkeys(candidates)), n=n, cutoff=0.6)


def _alternatives(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _unknown_option(missing: str, options: list[str], hydra: Any, overrides: list[str]) -> str:
    group, _, option = missing.rpartition("/")
    line = next((o for o in _parse(hydra, overrides) if o.key_or_group == group
                 and not o.is_sweep_override() and o.get_value_element_as_str() == option), None)
    key = line.input_line.rsplit("=", 1)[0] if line is not None else group
    matches = close_matches(option, options)
    if matches:
        return f"unknown option {key}={option} (did you mean {_alternatives([f'{key}={m}' for m in matches])}?)"
    return f"unknown option {key}={option} (options of {group}: {', '.join(sorted(options))})"


def _unknown_key(full_key: str, hydra: Any, overrides: list[str], run_mode: Any, object_type: Any = None) -> str:
    """``full_key`` is the first missing level (``sytem`` for ``sytem.migration_frac=1``)."""
    parts = full_key.split(".")
    parent, bad = parts[:-1], parts[-1]
    line = _override_for_key(hydra, overrides, full_key)
    shown = line.key_or_group if line is not None else full_key
    rest = shown.split(".")
    valid = _keys_at(hydra, ".".join(parent), [o for o in overrides if line is None or o != line.input_line],
                     run_mode, object_type)
    matches = close_matches(bad, valid)
    if matches:
        others = [o for o in overrides if line is None or o != line.input_line]
        tail = rest[len(parts):]
        # a match that holds a value, not keys, cannot take the rest of the path (results.root -> results_dir)
        suggestions = [".".join([*parent, m] if tail and _is_value(hydra, ".".join([*parent, m]), others, run_mode)
                                else [*parent, m, *tail]) for m in matches]
        return f"unknown key {shown} (did you mean {_alternatives(suggestions)}?)"
    where = ".".join(parent) or "the top level"
    if valid:
        return f"unknown key {shown} (keys of {where}: {', '.join(valid)})"
    return f"unknown key {shown}"


def _is_value(hydra: Any, path: str, overrides: list[str], run_mode: Any) -> bool:
    """Whether ``path`` of the config composed with ``overrides`` holds a value rather than keys
    (False when that cannot be told)."""
    try:
        cfg = hydra.compose_config(config_name=CONFIG_NAME, overrides=list(overrides), run_mode=run_mode)
        node = OmegaConf.select(cfg, path)
    except Exception:  # noqa: BLE001 - another bad override: keep the suggestion as it is
        return False
    return node is not None and not isinstance(node, DictConfig)


def _keys_at(hydra: Any, path: str, overrides: list[str], run_mode: Any, object_type: Any) -> list[str]:
    """The keys at ``path`` ('' = the top level) of the config composed without the bad override,
    plus the config groups at the top level; the schema's fields if that composition fails too."""
    keys: list[str] = []
    try:
        cfg = hydra.compose_config(config_name=CONFIG_NAME, overrides=list(overrides), run_mode=run_mode)
        node = OmegaConf.select(cfg, path) if path else cfg
        if isinstance(node, DictConfig):
            keys = [str(k) for k in node.keys()]
    except Exception:  # noqa: BLE001 - another bad override: fall back on the schema
        pass
    if not keys and isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        keys = [f.name for f in dataclasses.fields(object_type)]
    if not path:
        keys += [g for g in hydra.config_loader.list_groups("") if g not in _HIDDEN_GROUPS]
    return [k for k in dict.fromkeys(keys) if k not in _HIDDEN_GROUPS]


def _check_duplicates(hydra: Any, overrides: list[str]) -> None:
    """A key (or group) given twice on the command line is refused: Hydra keeps the last silently,
    so ``seed=1 seed=2`` would run with seed 2 while the command line reads seed 1."""
    seen: dict[tuple[str, Optional[str]], str] = {}
    for text, o in zip(overrides, _parse(hydra, overrides)):
        key = (o.key_or_group, o.package)
        if key in seen:
            name = o.key_or_group + (f"@{o.package}" if o.package else "")
            raise OverrideError(f"{name} is given twice on the command line ({seen[key]} and {text}); give it once")
        seen[key] = text


def _parse(hydra: Any, overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001
        return []


def _override_for_key(hydra: Any, overrides: list[str], key: str) -> Optional[Any]:
    """The value override that sets ``key`` or a key below it."""
    for o in _parse(hydra, overrides):
        if o.package is None and (o.key_or_group == key or o.key_or_group.startswith(key + ".")):
            return o
    return None


def _check_added_keys(hydra: Any, cfg: DictConfig, overrides: list[str], run_mode: Any) -> None:
    """``+key=value`` into a typed (dataclass) node that does not declare ``key``: Hydra adds it,
    the run would ignore it. Config groups (``+system=...``) and ``hydra.*`` are not checked."""
    repo = hydra.config_loader.repository
    for o in _parse(hydra, overrides):
        key = o.key_or_group
        if not (o.is_add() or o.is_force_add()) or o.package is not None or key.startswith("hydra.") \
                or key == "hydra" or repo.group_exists(key):
            continue
        parts = key.split(".")
        for depth in range(len(parts)):
            parent = ".".join(parts[:depth])
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if not isinstance(node, DictConfig):
                break
            schema = OmegaConf.get_type(node)
            if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
                break
            if parts[depth] not in {f.name for f in dataclasses.fields(schema)}:
                raise OverrideError(_unknown_key(".".join(parts[:depth + 1]), hydra, overrides, run_mode, schema))


# ---- batch sizes ----------------------------------------------------------------------------------

def check_batch_sizes(cfg: DictConfig) -> None:
    """Refuse a system's batch sizes (any ``system.*batch_size`` key set to a number) below 1."""
    system = cfg.get("system") if "system" in cfg and not OmegaConf.is_missing(cfg, "system") else None
    if not isinstance(system, DictConfig):
        return
    for key, value in system.items():
        if str(key).endswith("batch_size") and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"system.{key}={value} must be a positive number of samples")
