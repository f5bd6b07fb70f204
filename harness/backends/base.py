"""The Backend interface (DESIGN section 2): a backend executes a Plan and reports a StepTrace.

Backends never choose parallel layouts, schedules or policies: everything they do is read from the
Plan, so two backends given the same plan do the same work. Iteration inputs (prompt and target
output lengths) come from :mod:`harness.workload`, identical across systems for a seed.
"""
from __future__ import annotations

import abc

from harness.config import BackendConfig
from harness.plan import Plan
from harness.system import PlanContext
from harness.trace import StepTrace
from harness.workload import Batch


class Backend(abc.ABC):
    def __init__(self, cfg: BackendConfig, ctx: PlanContext):
        self.cfg = cfg
        self.ctx = ctx

    def setup(self, plan: Plan) -> None:
        """Prepare to run ``plan`` (start workers, place weights). Default: nothing."""

    @abc.abstractmethod
    def run_iteration(self, plan: Plan, iteration: int, batch: Batch) -> StepTrace:
        """Execute one PPO iteration of ``plan`` on ``batch``."""

    def close(self) -> None:
        """Release resources; must be safe to call after a failure."""
