"""The System interface (docs/DESIGN.md section 2): a system decides, and only decides.

``System.plan(ctx)`` is pure: it reads the resolved configs and may query the cost model (and
search with it), but touches no files, clock, logger or device. Systems live in ``systems/`` and
``baselines/``; each defines a typed config (a :class:`harness.config.SystemConfig` subclass)
whose ``impl`` names the class, and registers it with :func:`register_system_config`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable

from hydra.core.config_store import ConfigStore

from harness.config import ClusterConfig, ModelsConfig, SystemConfig, WorkloadConfig
from harness.costmodel import CostModel
from harness.engines import Engines
from harness.plan import Plan


@dataclass(frozen=True)
class PlanContext:
    """Everything a system may look at while planning."""

    models: ModelsConfig
    cluster: ClusterConfig
    workload: WorkloadConfig
    cost_model: CostModel
    seed: int = 0
    planning_budget_s: float | None = None  # caps any search a system runs (RunConfig.planning_budget_s)
    # The execution engines the plan will run on (harness/engines.py): the system's defaults unless
    # engine.* overrides them; None (contexts built by hand in tests) = the plan carries no engines and
    # the simulator times ops on the cost model as is.
    engines: Engines | None = None
    # Where planning reports its phases (harness.progress; None: nowhere). Reports are for people
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


class System(abc.ABC):
    def __init__(self, cfg: SystemConfig):
        self.cfg = cfg

    @property
    def name(self) -> str:
        return self.cfg.name

    def check_config(self) -> None:
        """Refuse this system's options that are out of range (a :class:`~harness.errors.ConfigError`
        naming the key), before any planning. The harness checks every system's counts and amounts
        by their names first (:func:`harness.consistency.check_option_ranges`), and options set
        without effect by the conditions declared beside each field
        (:mod:`harness.option_effects`); this is for the rest. Default: nothing."""

    @abc.abstractmethod
    def plan(self, ctx: PlanContext) -> Plan:
        """Return the plan for one PPO iteration on ``ctx.cluster``; raise PlanError if impossible."""


def register_system_config(name: str, node: type) -> None:
    """Register a system's schema as ``schema/<name>``; ``conf/system/<name>.yaml`` extends it with
    ``defaults: [{/schema@_here_: <name>}, _self_]``."""
    ConfigStore.instance().store(group="schema", name=name, node=node)
