"""One shared layout for every task: ``+system=colocated`` (no resharding, no fusion).

The worked example of docs/ARCHITECTURE.md ("Adding a system"): a system is this module plus
``conf/system/colocated.yaml``; it decides and the planning library does the rest. Every PPO task
runs on all devices in one (dp, tp, pp) layout, so weights stay where training left them (ZeRO-1
keeps full weights on every rank: the plan assembler emits no weight movement) and the stages run
one after another. The layout is the one whose whole iteration simulates fastest among those that
fit in memory, or ``system.layout`` when pinned. It is the no-fusion, no-reallocation point of the
design space: what RLHFuse-Base (section 7 of the RLHFuse paper) gains by giving each task its own
layout, and what ReaLHF gains by moving weights between them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.core.config import SystemConfig
from harness.core.plan import Allocation, GenerationPolicy, ParallelStrategy, Plan
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.estimate import simulated_makespan_s
from harness.planning.strategies import candidate_strategies, parse_layout, search
from harness.planning.workflow import PPO_TASKS, check_layout_fits, full_mesh
from harness.system import PlanContext, System, register_system_config


@dataclass
class ColocatedConfig(SystemConfig):
    name: str = "colocated"
    impl: str = "baselines.colocated.Colocated"
    layout: Optional[str] = None  # pin the shared layout, e.g. dp32tp8pp1; None = search
    zero_stage: int = 1  # ZeRO-1/2 keep full weights on every rank (ZeRO-3 would need gathers)
    max_gen_batch_size: int = 256  # continuous-batching slots per generation instance


class Colocated(System):
    cfg: ColocatedConfig

    def plan(self, ctx: PlanContext) -> Plan:
        cfg, n = self.cfg, ctx.num_devices
        num_layers = min(ctx.model(role).num_layers for role in ctx.roles)  # the models the algorithm runs
        if cfg.layout:
            candidates = [parse_layout(cfg.layout, cfg.zero_stage, "layout")]
            check_layout_fits(candidates[0], n, ctx.cluster.gpus_per_node, num_layers, "colocated (system.layout)",
                              [ctx.model(role) for role in ctx.roles])
        else:
            models = [ctx.model(role) for role in ctx.roles]
            candidates = list(candidate_strategies(n, ctx.cluster.gpus_per_node, num_layers, cfg.zero_stage,
                                                   models=models))
        policy = GenerationPolicy("continuous", cfg.max_gen_batch_size)
        plans: dict[ParallelStrategy, Plan] = {}

        def score(strategy: ParallelStrategy) -> float:  # PlanError (memory, batch split) = infeasible
            shared = Allocation.in_engine_order(full_mesh(n), strategy)
            plans[strategy] = assemble_ppo_plan(ctx, cfg.name, {task: shared for task in PPO_TASKS}, policy,
                                                layout_keys={task: "system.layout" for task in PPO_TASKS})
            return simulated_makespan_s(ctx, plans[strategy])

        best = search(candidates, score, "the shared layout", system=cfg.name)
        plans[best.strategy].notes["layout"] = f"{best.strategy} ({best.num_candidates} candidates, " \
                                               f"est. {best.time_s:.2f} s)"
        return plans[best.strategy]


register_system_config("colocated", ColocatedConfig)
