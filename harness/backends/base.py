"""The Backend interface (docs/DESIGN.md section 2): a backend executes a Plan and reports a StepTrace.

Backends never choose parallel layouts, schedules or policies: everything they do is read from the
Plan, so two backends given the same plan do the same work. Iteration inputs (prompt and target
output lengths) come from :mod:`harness.core.workload`, identical across systems for a seed.
"""
from __future__ import annotations

import abc

from harness.core.config import BackendConfig
from harness.errors import PlanError
from harness.core.plan import Plan
from harness.system import PlanContext
from harness.core.trace import StepTrace
from harness.core.workload import Batch


class Backend(abc.ABC):
    # True for a backend that models devices rather than running on them (what provenance records
    # as the run's devices: the simulated cluster's GPUs, or the real ones this process sees).
    simulated: bool = False

    def __init__(self, cfg: BackendConfig, ctx: PlanContext):
        self.cfg = cfg
        self.ctx = ctx

    def check_before_planning(self) -> None:
        """Refuse what this backend cannot run whatever the plan (a ConfigError naming it: e.g. more
        worker processes than this machine starts), before any planning. Default: nothing."""

    def unsupported(self, plan: Plan) -> list[str]:
        """What in ``plan`` this backend cannot execute, one phrase each (empty: all of it).
        Default: everything is supported."""
        return []

    def check(self, plan: Plan) -> None:
        """Refuse a plan with unsupported features before any work starts (PlanError naming them)."""
        missing = self.unsupported(plan)
        if missing:
            raise PlanError(f"backend={self.cfg.name} cannot execute this {plan.system} plan: "
                            + "; ".join(missing) + ". Run it with backend=sim, or choose a plan without them")

    def setup(self, plan: Plan) -> None:
        """Prepare to run ``plan`` (start workers, place weights). Default: nothing."""

    @abc.abstractmethod
    def run_iteration(self, plan: Plan, iteration: int, batch: Batch) -> StepTrace:
        """Execute one PPO iteration of ``plan`` on ``batch``."""

    def close(self) -> None:
        """Release resources; must be safe to call after a failure."""
