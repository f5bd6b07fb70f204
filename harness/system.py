"""The System interface (docs/DESIGN.md section 2): a system decides, and only decides.

``System.plan(ctx)`` is pure: it reads the resolved configs and may query the cost model (and
search with it), but touches no files, clock, logger or device. Systems live in ``systems/`` and
``baselines/``; each defines a typed config (a :class:`harness.core.config.SystemConfig` subclass)
whose ``impl`` names the class, and registers it with :func:`register_system_config`.

:func:`discover_systems` finds them without the harness naming any: every module of the in-tree
packages ``systems`` and ``baselines`` is imported (adding a system is one module plus one
``conf/system/<name>.yaml``, docs/ARCHITECTURE.md "Adding a system"), and so is every entry point of
the ``rlhf_harness.systems`` group (systems in other installed packages). A module that fails to
import is reported on stderr and skipped; the others still load.
"""
from __future__ import annotations

import abc
import importlib
import pkgutil
import sys
from importlib.metadata import entry_points
from dataclasses import dataclass, field
from typing import Any, Callable

from hydra.core.config_store import ConfigStore

from harness.core.algorithm import AlgorithmConfig
from harness.core.config import ClusterConfig, ModelsConfig, SystemConfig, WorkloadConfig
from harness.costmodel import CostModel
from harness.core.engines import Engines
from harness.core.plan import Plan


@dataclass(frozen=True)
class PlanContext:
    """Everything a system may look at while planning. ``workload`` counts samples: the run's
    workload with its batch sizes times the algorithm's responses per prompt
    (:func:`harness.core.algorithm.sample_workload`)."""

    models: ModelsConfig
    cluster: ClusterConfig
    workload: WorkloadConfig
    cost_model: CostModel
    seed: int = 0
    # The RL algorithm (conf/algo/): which tasks an iteration runs (critic, reference, reward model)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    planning_budget_s: float | None = None  # caps any search a system runs (RunConfig.planning_budget_s)
    # The execution engines the plan will run on (harness/core/engines.py): the system's defaults unless
    # engine.* overrides them; None (contexts built by hand in tests) = the plan carries no engines and
    # the simulator times ops on the cost model as is.
    engines: Engines | None = None
    # Where planning reports its phases (harness.run.progress; None: nowhere). Reports are for people
    # only: nothing a system decides may depend on them.
    progress: Callable[[str], None] | None = None

    def report(self, message: str) -> None:
        """Say what planning is doing now (a phase, the best estimate so far), if anyone listens."""
        if self.progress is not None:
            self.progress(message)

    def wall_clock_budget_s(self, own_s: float | None) -> float | None:
        """A search's wall-clock budget, or None when it is budgeted in steps (the default): the
        system's own time limit if set, capped by the run's ``planning_budget_s`` if set."""
        limits = [t for t in (own_s, self.planning_budget_s) if t is not None]
        return min(limits) if limits else None

    @property
    def num_devices(self) -> int:
        return self.cluster.num_nodes * self.cluster.gpus_per_node

    def model(self, role: str) -> Any:
        return getattr(self.models, role)

    @property
    def roles(self) -> tuple[str, ...]:
        """The models this run's algorithm runs (``actor`` always; critic, ref, reward if used)."""
        return self.algorithm.roles


class System(abc.ABC):
    def __init__(self, cfg: SystemConfig):
        self.cfg = cfg

    @property
    def name(self) -> str:
        return self.cfg.name

    def check_config(self) -> None:
        """Refuse this system's options that are out of range (a :class:`~harness.errors.ConfigError`
        naming the key), before any planning. The harness checks every system's counts and amounts
        by their names first (:func:`harness.checks.consistency.check_option_ranges`), and options set
        without effect by the conditions declared beside each field
        (:mod:`harness.core.option_effects`); this is for the rest. Default: nothing."""

    @abc.abstractmethod
    def plan(self, ctx: PlanContext) -> Plan:
        """Return the plan for one PPO iteration on ``ctx.cluster``; raise PlanError if impossible."""


def register_system_config(name: str, node: type) -> None:
    """Register a system's schema as ``schema/<name>``; ``conf/system/<name>.yaml`` extends it with
    ``defaults: [{/schema@_here_: <name>}, _self_]``."""
    ConfigStore.instance().store(group="schema", name=name, node=node)

ENTRY_POINT_GROUP = "rlhf_harness.systems"
IN_TREE_PACKAGES = ("systems", "baselines")


def _in_tree_modules() -> list[str]:
    names = []
    for package_name in IN_TREE_PACKAGES:
        try:
            package = importlib.import_module(package_name)
        except ImportError:
            continue
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}."):
            if not info.name.rsplit(".", 1)[-1].startswith("_"):
                names.append(info.name)
    return sorted(names)


def discover_systems() -> list[str]:
    """Import every system module; returns the names of the registered systems' schemas."""
    from hydra.core.config_store import ConfigStore

    for module in _in_tree_modules():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a broken module must not take the others down
            print(f"[harness] warning: module {module} failed to import: {e}", file=sys.stderr)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001
            print(f"[harness] warning: system {ep.name!r} ({ep.value}) failed to import: {e}", file=sys.stderr)
    schemas = ConfigStore.instance().repo.get("schema", {})
    from harness.core.config import CORE_SCHEMAS

    return sorted(name.removesuffix(".yaml") for name in schemas if name.removesuffix(".yaml") not in CORE_SCHEMAS)
