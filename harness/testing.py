"""Helpers to build configs, contexts and plans in tests, notebooks and scripts.

``context(["model=7b", "cluster.num_nodes=1"])`` composes the same config ``python -m harness``
would, and returns the PlanContext a system plans with; ``plan_for(...)`` also plans.
"""
from __future__ import annotations

from hydra.utils import get_class
from omegaconf import OmegaConf

from harness.cli.app import compose
from harness.core.config import RunConfig
from harness.core.plan import Plan
from harness.planning.collector import full_collections_deferred
from harness.run.runner import build_context
from harness.system import PlanContext


def run_config(overrides: list[str]) -> RunConfig:
    return OmegaConf.to_object(compose(overrides))


def context(overrides: list[str]) -> PlanContext:
    return build_context(run_config(overrides))


def plan_for(overrides: list[str]) -> tuple[Plan, PlanContext, RunConfig]:
    """Compose, build the context and plan with the system named by ``+system=...``."""
    run = run_config(overrides)
    ctx = build_context(run)
    with full_collections_deferred():  # as the runner plans (harness.run.runner.make_plan)
        return get_class(run.system.impl)(run.system).plan(ctx), ctx, run


def simulate_plan_metrics(plan: Plan, ctx: PlanContext, iteration: int = 0, backend=None):
    """One simulated iteration of ``plan``: (StepTrace, per-iteration metrics)."""
    from harness.core import metrics as mk
    from harness.planning.estimate import simulate_plan
    from harness.core.workload import make_batch

    batch = make_batch(ctx.workload, ctx.seed, iteration)
    if backend is None:
        trace = simulate_plan(ctx, plan, batch, iteration)
    else:
        trace = backend.run_iteration(plan, iteration, batch)
    return trace, mk.iteration_metrics(trace, batch.total_num_tokens, {t.name: t.model for t in plan.tasks},
                                       ctx.cluster.gpu.peak_bf16_tflops * 1e12)


def simulate_iterations(overrides: list[str], num_iterations: int = 1):
    """Plan with the system named in ``overrides`` and run ``num_iterations`` simulated iterations.
    Returns (plan, [(StepTrace, metrics dict) per iteration])."""
    from harness.backends.sim import SimBackend

    plan, ctx, run = plan_for(overrides)
    backend = SimBackend(run.backend, ctx)
    backend.setup(plan)
    return plan, [simulate_plan_metrics(plan, ctx, it, backend) for it in range(num_iterations)]
