"""Helpers to build configs, contexts and plans in tests, notebooks and scripts: thin wrappers over
the run pipeline (:mod:`harness.run.pipeline`), so they check and plan exactly as ``python -m
harness`` does.

``context(["model=7b", "cluster.num_nodes=1"])`` composes the same config ``python -m harness``
would, and returns the PlanContext a system plans with (no system needed); ``plan_for(...)`` also
plans, with every check of the pipeline (the input's, then the plan IR, tensor parallelism and
device memory) but the rule on options set without effect, which reads a command line: the
overrides here are a test's config, as a YAML file would be.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from harness.backends.base import Backend
from harness.core.config import RunConfig
from harness.core.plan import Plan
from harness.core.trace import StepTrace
from harness.run import pipeline
from harness.system import PlanContext


def run_config(overrides: list[str]) -> RunConfig:
    return OmegaConf.to_object(pipeline.compose(overrides))


def context(overrides: list[str]) -> PlanContext:
    return pipeline.build_context(run_config(overrides))


def planned_run(overrides: list[str]) -> pipeline.PlannedRun:
    """Compose, prepare and plan with the system named by ``+system=...``, as ``python -m harness``
    would with this config."""
    return pipeline.plan(pipeline.prepare(pipeline.compose(overrides)))


def plan_for(overrides: list[str]) -> tuple[Plan, PlanContext, RunConfig]:
    """The plan of :func:`planned_run`, the context it was planned in and the run config."""
    planned = planned_run(overrides)
    return planned.plan, planned.prepared.ctx, planned.prepared.run


def simulate_plan_metrics(plan: Plan, ctx: PlanContext, iteration: int = 0,
                          backend: Backend | None = None) -> tuple[StepTrace, dict[str, float]]:
    """Iteration ``iteration`` of ``plan`` on ``backend`` (set up; default: the simulator):
    (StepTrace, per-iteration metrics)."""
    return pipeline.iteration_row(ctx, plan, backend if backend is not None else pipeline.simulator(ctx), iteration)


def simulate_iterations(overrides: list[str], num_iterations: int = 1
                        ) -> tuple[Plan, list[tuple[StepTrace, dict[str, float]]]]:
    """Plan with the system named in ``overrides`` and run ``num_iterations`` simulated iterations.
    Returns (plan, [(StepTrace, metrics dict) per iteration])."""
    planned = planned_run(overrides)
    return planned.plan, pipeline.simulate(planned, num_iterations)
