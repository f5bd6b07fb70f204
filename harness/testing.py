"""Helpers to build configs, contexts and plans in tests, notebooks and scripts.

``context(["model=7b", "cluster.num_nodes=1"])`` composes the same config ``python -m harness``
would, and returns the PlanContext a system plans with; ``plan_for(...)`` also plans.
"""
from __future__ import annotations

from hydra.utils import get_class
from omegaconf import OmegaConf

from harness.app import compose
from harness.config import RunConfig
from harness.plan import Plan
from harness.runner import build_context
from harness.system import PlanContext


def run_config(overrides: list[str]) -> RunConfig:
    return OmegaConf.to_object(compose(overrides))


def context(overrides: list[str]) -> PlanContext:
    return build_context(run_config(overrides))


def plan_for(overrides: list[str]) -> tuple[Plan, PlanContext, RunConfig]:
    """Compose, build the context and plan with the system named by ``+system=...``."""
    run = run_config(overrides)
    ctx = build_context(run)
    return get_class(run.system.impl)(run.system).plan(ctx), ctx, run


def simulate_iterations(overrides: list[str], num_iterations: int = 1):
    """Plan with the system named in ``overrides`` and run ``num_iterations`` simulated iterations.
    Returns (plan, [(StepTrace, metrics dict) per iteration])."""
    from harness import metrics as mk
    from harness.backends.sim import SimBackend
    from harness.workload import make_batch

    plan, ctx, run = plan_for(overrides)
    backend = SimBackend(run.backend, ctx)
    backend.setup(plan)
    task_models = {t.name: t.model for t in plan.tasks}
    peak_flops = run.cluster.gpu.peak_bf16_tflops * 1e12
    out = []
    for it in range(num_iterations):
        batch = make_batch(run.workload, run.seed, it)
        trace = backend.run_iteration(plan, it, batch)
        out.append((trace, mk.iteration_metrics(trace, batch.total_num_tokens, task_models, peak_flops)))
    return plan, out
