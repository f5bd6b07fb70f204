"""ReaLHF-style parameter reallocation (Mei et al., "ReaLHF: Optimized RLHF Training for Large
Language Models through Parameter Reallocation", arXiv 2406.14088; later "ReaL", MLSys'25):
``+system=realhf`` and ``+system=realhf_heuristic``.

What the original does: it treats a PPO iteration as a dataflow graph of model function calls
(actor generate; ref, reward and critic inference; actor and critic train) and gives *each call*
its own device mesh and (dp, tp, pp), moving a model's parameters between the layouts of its
consecutive calls ("parameter reallocation"). Calls on disjoint meshes run concurrently. Its
planner searches this space with MCMC over an estimator of the iteration time. The upstream
planner was disabled in its own releases, so this is a reimplementation of the design, not a port.

What we reimplement:

- **Search space per call**: meshes that are a contiguous aligned slice of one node (1, 2, 4, 8
  GPUs) or a contiguous range of whole nodes; tp within a node; pp (<= layers) and dp filling the
  mesh; training calls need the mini-batch to split into micro-batches per replica;
  memory-feasible plans only (the harness memory check).
- **Search**: simulated annealing (Metropolis with a linearly cooled temperature) that changes one
  call's choice at a time (its strategy on the same mesh, or a new mesh and strategy), then a
  refinement by coordinate descent (every strategy of each call on its mesh, in turn, keeping any
  that shortens the estimate, for up to ``system.num_refine_rounds`` rounds), scored by
  the makespan of an iteration under the planning library's scheduler
  (:mod:`harness.planning.scheduler`): calls start when their inputs are ready and their devices
  free, so disjoint meshes overlap and overlapping ones serialise; reallocation costs come from
  :func:`harness.planning.realloc.reallocation_transfers`. Task durations are the simulator's own task
  models (:mod:`harness.planning.estimate`), cached per (call, mesh, strategy). Deterministic for a seed
  with ``system.max_steps`` (the default budget); ``system.search_time_s`` or the run's
  ``planning_budget_s`` bound it in wall-clock time instead. The best plan
  found is kept, and the start is returned if nothing beats it under the full simulator.
- **Offloading**: ref and reward weights may live in host memory and be copied in before each use
  (``system.offload_ref_reward``: auto = only when keeping them resident does not fit).
- ``realhf_heuristic``: every call on all GPUs with tp = GPUs per node (or the largest tp in a node
  that divides the model's heads) and pp = number of nodes
  (the baseline ReaLHF compares its search against); when a model has fewer layers than nodes, pp
  is the largest divisor of the node count within the layers and dp takes the rest.

What we model: every call's execution (generation with continuous batching, as ReaLHF's generation
uses a KV-cached engine; inference; 1F1B training) through the simulator's cost model.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Optional

from harness.core.config import SystemConfig
from harness.errors import PlanError
from harness.core.units import Unit
from harness.core.option_effects import effective_when
from harness.core.plan import Allocation, GenerationPolicy, Plan, ParallelStrategy, TaskKind
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.estimate import (GenerationEstimates, inference_s, representative_batch, simulated_makespan_s,
                                       training_s)
from harness.planning.memory import check_plan_memory
from harness.planning.scheduler import schedule_durations
from harness.planning.strategies import divisors, largest_tp, mesh_options, strategy_options
from harness.planning.taskmodels.passes import weight_movement_s
from harness.planning.workflow import PPO_TASKS, packed_stage_args, single_pipe_stage, workflow_tasks
from harness.system import PlanContext, System, register_system_config

# Options of the search: set with system.search=false they are refused (harness/core/option_effects.py).
SEARCH_ONLY = effective_when(("system.search", "==", True), why="an option of the layout search")


@dataclass
class RealHFConfig(SystemConfig):
    name: str = "realhf"
    impl: str = "baselines.realhf.RealHF"
    search: bool = True
    # Annealing budget: steps by default (same config and seed => same plan); a wall-clock budget
    # (here or the run's planning_budget_s) replaces the step budget when set.
    max_steps: Optional[int] = field(default=300, metadata=SEARCH_ONLY)
    # Coordinate-descent rounds after annealing (0 = none): an annealing run's last accepted moves
    # leave strategies on their meshes that one change would improve (at 4,096 GPUs the
    # 300 steps stopped 1.8% short of an earlier commit's plan; the refinement passes it).
    num_refine_rounds: int = field(default=3, metadata=SEARCH_ONLY)
    search_time_s: Optional[float] = field(default=None, metadata=SEARCH_ONLY)
    seed: int = field(default=0, metadata=SEARCH_ONLY)
    initial_temperature_frac: float = field(default=0.05, metadata=SEARCH_ONLY)  # T0 as a fraction of the starting makespan
    zero_stage: int = 1  # distributed optimizer in training calls
    max_gen_batch_size: int = 256
    offload_ref_reward: str = "auto"  # auto | true | false


@dataclass
class RealHFHeuristicConfig(RealHFConfig):
    name: str = "realhf_heuristic"
    impl: str = "baselines.realhf.RealHFHeuristic"
    search: bool = False


class RealHF(System):
    cfg: RealHFConfig

    # ---- plan construction ----------------------------------------------------------------
    def build_plan(self, ctx: PlanContext, choice: dict[str, Allocation], offload: bool) -> Plan:
        return assemble_ppo_plan(ctx, self.cfg.name, choice, GenerationPolicy("continuous", self.cfg.max_gen_batch_size),
                                 offloaded=("ref", "reward") if offload else ())

    def heuristic_choice(self, ctx: PlanContext) -> dict[str, Allocation]:
        n, per_node, nodes = ctx.num_devices, ctx.cluster.gpus_per_node, ctx.cluster.num_nodes
        mesh = tuple(range(n))
        choice = {}
        for call in workflow_tasks(ctx.algorithm):  # gen, ref, reward, values, update_actor, update_critic (PPO)
            layers = ctx.model(PPO_TASKS[call][1]).num_layers
            pp = max(d for d in divisors(nodes) if d <= layers)
            train = PPO_TASKS[call][0] == "train"
            tp = largest_tp(per_node, [ctx.model(PPO_TASKS[call][1])])  # a node's GPUs where the heads allow
            dp = (per_node // tp) * (nodes // pp)
            strategy = ParallelStrategy(dp, tp, pp, self.cfg.zero_stage if train else 0)
            choice[call] = Allocation.in_engine_order(mesh, strategy)
        return choice

    # ---- evaluation -------------------------------------------------------------------------
    def _evaluator(self, ctx: PlanContext):
        batch = representative_batch(ctx)
        generation_s = GenerationEstimates(ctx, batch)  # memoised across the candidates' meshes
        cache: dict = {}
        w = ctx.workload

        per_node = ctx.cluster.gpus_per_node

        def duration(unit: Unit, plan: Plan, memory) -> float:
            (task,) = unit.tasks
            allocation = task.allocation
            if task.kind in (TaskKind.TRAIN, TaskKind.INFERENCE):
                # their times depend on which devices share a node, not on which node: a mesh moved
                # by whole nodes takes as long (the cost model's links are chosen by node membership)
                allocation = node_relative(allocation, per_node)
            key = (task.name, allocation, task.model in plan.offloaded,
                   round(memory.kv_capacity_gb.get(task.name, 0.0), 3))
            if key in cache:
                return cache[key]
            if task.kind == TaskKind.GENERATE:
                t = generation_s(task, plan.generation, memory.kv_capacity_gb[task.name])
            elif task.kind == TaskKind.INFERENCE:
                t = inference_s(ctx, task, batch)
                if task.model in plan.offloaded:
                    s = task.allocation.strategy
                    weights_gb = ctx.cost_model.weights_gb(ctx.model(task.model), s.tp, s.pp, ep=s.ep, etp=s.etp)
                    t += ctx.cost_model.host_transfer_s(weights_gb * 1e9)
            elif task.kind == TaskKind.TRAIN:
                stage = single_pipe_stage(task.name, task.model, task.allocation.strategy, w.mini_batch_size,
                                          w.micro_batch_size, w.global_batch_size, **packed_stage_args(ctx))
                t = training_s(ctx, task, stage, w.mini_batch_size, batch)
            else:
                move = plan.movement_of(task.name)
                key = (task.name, move.source, move.target)
                if key in cache:
                    return cache[key]
                t = weight_movement_s(ctx.cost_model, move, ctx.model(task.model))[0]
            cache[key] = t
            return t

        def makespan(plan: Plan) -> float:
            """The plan's units timed by the scheduler (as the simulator does) with cached task durations."""
            memory = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
            return schedule_durations(plan, ctx.num_devices, lambda unit: duration(unit, plan, memory)).makespan_s

        return makespan

    def _plan_and_score(self, ctx, evaluate, choice) -> tuple[float, Plan]:
        """Resident ref/reward if it fits (or offload is forced), else offloaded."""
        modes = {"true": (True,), "false": (False,), "auto": (False, True)}.get(str(self.cfg.offload_ref_reward).lower())
        if modes is None:
            raise PlanError(f"system.offload_ref_reward={self.cfg.offload_ref_reward!r}; use auto, true or false")
        last_error: PlanError | None = None
        for offload in modes:
            plan = self.build_plan(ctx, choice, offload)
            try:
                return evaluate(plan), plan
            except PlanError as e:
                last_error = e
        raise last_error

    # ---- search ------------------------------------------------------------------------------
    def plan(self, ctx: PlanContext) -> Plan:
        evaluate = self._evaluator(ctx)
        start_choice = self.heuristic_choice(ctx)
        start_s, start_plan = self._plan_and_score(ctx, evaluate, start_choice)
        if not self.cfg.search:
            start_plan.notes.update({"search/estimated_step_s": round(start_s, 4)})
            return start_plan
        options = self._options(ctx)
        budget_s = ctx.wall_clock_budget_s(self.cfg.search_time_s)  # one for annealing and refinement
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        best_s, best_choice, best_plan, steps, accepted = self._anneal(ctx, evaluate, options, budget_s, deadline,
                                                                       start_choice, start_s, start_plan)
        best_s, best_plan, refined = self._refine(ctx, evaluate, options, deadline, best_choice, best_s, best_plan)
        verified = self._verify(ctx, start_plan, best_plan)
        best_plan.notes.update({"search/start_estimate_s": round(start_s, 4), "search/best_estimate_s": round(best_s, 4),
                                "search/steps": steps, "search/accepted": accepted, "search/seed": self.cfg.seed,
                                "search/verified_step_s": round(verified[1], 4),
                                "search/start_verified_step_s": round(verified[0], 4)})
        if self.cfg.num_refine_rounds:
            best_plan.notes.update({"search/refine_evaluations": refined[0], "search/refine_improvements": refined[1]})
        if verified[1] > verified[0]:  # never return worse than the start, by the full simulator
            start_plan.notes.update(best_plan.notes, **{"search/kept_start": True})
            return start_plan
        return best_plan

    def _options(self, ctx: PlanContext):
        w, per_node = ctx.workload, ctx.cluster.gpus_per_node
        meshes = mesh_options(ctx.cluster.num_nodes, per_node)
        cache: dict = {}

        def strategies(call: str, mesh: tuple[int, ...]) -> list[ParallelStrategy]:
            key = (call, len(mesh))
            if key not in cache:
                kind, role = PPO_TASKS[call][0], PPO_TASKS[call][1]
                cache[key] = strategy_options(len(mesh), per_node, ctx.model(role).num_layers, kind == "train",
                                              w.mini_batch_size, w.micro_batch_size, self.cfg.zero_stage,
                                              models=[ctx.model(role)])
            return cache[key]
        return meshes, strategies

    def _anneal(self, ctx, evaluate, options, budget_s, deadline, choice, current_s, current_plan):
        rng = random.Random(self.cfg.seed)
        meshes, strategies = options
        best = (current_s, choice, current_plan)
        t0 = self.cfg.initial_temperature_frac * current_s
        budget = self.cfg.max_steps if budget_s is None else None
        if budget is None and budget_s is None:
            raise PlanError("realhf: give system.max_steps or system.search_time_s (a search budget)")
        steps = accepted = 0
        every = max(1, (budget or 0) // 10)
        while (steps < budget) if budget is not None else (time.perf_counter() < deadline):
            steps += 1
            if budget is not None and steps % every == 0:
                ctx.report(f"realhf: annealing step {steps}/{budget}, best estimate {best[0]:.4g} s")
            progress = steps / budget if budget else 1 - (deadline - time.perf_counter()) / max(budget_s, 1e-9)
            temperature = max(t0 * (1.0 - progress), 1e-12)
            call = rng.choice(workflow_tasks(ctx.algorithm))
            mesh = tuple(sorted(choice[call].mesh)) if rng.random() < 0.5 else rng.choice(meshes)
            options = strategies(call, mesh)
            if not options:
                continue
            proposal = dict(choice)
            proposal[call] = Allocation.in_engine_order(mesh, rng.choice(options))
            try:
                score, plan = self._plan_and_score(ctx, evaluate, proposal)
            except PlanError:
                continue
            if score <= current_s or rng.random() < math.exp(-(score - current_s) / temperature):
                choice, current_s = proposal, score
                accepted += 1
                if score < best[0]:
                    best = (score, proposal, plan)
        return (*best, steps, accepted)

    def _refine(self, ctx, evaluate, options, deadline, choice, best_s, best_plan):
        """Coordinate descent from the annealing's best: for each call in turn, every strategy on its
        mesh, keeping each one that lowers the estimate; rounds until one improves nothing (at most
        ``num_refine_rounds``). Deterministic; stops at the search's wall-clock deadline when one is
        set (the annealing's, so a wall-clock budget bounds both). Returns the best estimate and
        plan, and (evaluations, improvements)."""
        _, strategies = options
        evaluations = improvements = 0
        for round_index in range(self.cfg.num_refine_rounds):
            ctx.report(f"realhf: refining, round {round_index + 1}/{self.cfg.num_refine_rounds}, "
                       f"best estimate {best_s:.4g} s")
            improved = False
            for call in workflow_tasks(ctx.algorithm):
                mesh = tuple(sorted(choice[call].mesh))  # the devices, in whatever order the layout had
                for strategy in strategies(call, mesh):
                    if strategy == choice[call].strategy:
                        continue
                    if deadline is not None and time.perf_counter() > deadline:
                        return best_s, best_plan, (evaluations, improvements)
                    proposal = dict(choice)
                    proposal[call] = Allocation.in_engine_order(mesh, strategy)
                    evaluations += 1
                    try:
                        score, plan = self._plan_and_score(ctx, evaluate, proposal)
                    except PlanError:
                        continue
                    if score < best_s:
                        best_s, best_plan, choice, improved = score, plan, proposal, True
                        improvements += 1
            if not improved:
                break
        return best_s, best_plan, (evaluations, improvements)

    def _verify(self, ctx: PlanContext, start: Plan, best: Plan) -> tuple[float, float]:
        """Step time of both plans under the full simulator on the representative batch."""
        batch = representative_batch(ctx)
        return simulated_makespan_s(ctx, start, batch), simulated_makespan_s(ctx, best, batch)


class RealHFHeuristic(RealHF):
    cfg: RealHFHeuristicConfig


register_system_config("realhf", RealHFConfig)
register_system_config("realhf_heuristic", RealHFHeuristicConfig)


def node_relative(allocation: Allocation, gpus_per_node: int) -> Allocation:
    """``allocation`` with its mesh moved by whole nodes so that its first node is node 0."""
    base = min(allocation.mesh) // gpus_per_node * gpus_per_node
    if base == 0:
        return allocation
    return Allocation(tuple(d - base for d in allocation.mesh), allocation.strategy)
