"""Schedule experiments of the RLHFuse paper (section 7): Table 3 and Figure 10.

Both are searches over the pipeline schedule IR with per-stage costs from the cost model, not
benchmark runs, so they are experiment *runners*: ``conf/experiment/{table3_schedules,
fig10_schedule}.yaml`` name them (``experiment_runner``) and ``python -m harness
+experiment=<name>`` calls them with the config and the harness's :class:`ExperimentTools` (the
planning context of a command line, and the experiment's results folder to write CSV tables to,
which the figure modules read).

- Table 3: for 33B/13B at (actor pp, critic pp) = (8, 4) and (8, 8) and 65B/33B at (16, 8) and
  (16, 16), each with 8-64 micro-batches per actor pipeline: serial 1F1B (actor then critic),
  the greedy fused schedule, the searched fused schedule, "1F1B+" (each model with half the pipeline
  stages and twice the data parallelism, run serially), and the lower bound; peak activation memory
  relative to serial 1F1B.
- Figure 10: the fused schedule of one 16-stage 65B actor pipeline with two 8-stage 33B critic
  pipelines in reverse, with every action's start and end, and the per-rank activation memory over
  time next to serial 1F1B's.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol, Sequence

from omegaconf import DictConfig

from harness.planning.taskmodels.passes import training_pipe_costs
from harness.schedule import PipeCosts, Schedule, simulate
from harness.system import PlanContext
from systems.rlhfuse.intra import fused_pipes, greedy_schedule, search_fused_schedule, serial_schedule
from systems.rlhfuse.intra.config import FusedSearchConfig
from systems.rlhfuse.intra.search import paper_serial


class ExperimentTools(Protocol):
    """What these runners need from the harness (it hands them :class:`harness.run.pipeline.ExperimentTools`)."""

    @property
    def folder(self) -> Path:
        """The experiment's results folder, ``<results_dir>/<experiment_name>``."""

    def context(self, overrides: Sequence[str]) -> PlanContext:
        """The planning context ``python -m harness <overrides>`` would plan with."""

    def write_table(self, name: str, rows: list[dict[str, Any]]) -> Path:
        """Write ``rows`` as the CSV file ``name`` of :attr:`folder`; its path."""


def _fused_layout(pp_a: int, pp_c: int, m_a: int):
    """The fused actor/critic pipes with K1*M1 = K2*M2 (the global batch is fixed across both
    models, so each of the K2 critic pipes gets ``m_a * K1 / K2`` micro-batches), and that count."""
    num_ranks = math.lcm(pp_a, pp_c)
    k_a, k_c = num_ranks // pp_a, num_ranks // pp_c
    m_c = max(1, m_a * k_a // k_c)
    return fused_pipes(pp_a, pp_c, m_a, m_c, "actor", "critic"), m_c


def fused_layout_costs(ctx, actor_name: str, critic_name: str, pp_a: int, pp_c: int, m_a: int, tp: int):
    """Fused layout (``_fused_layout``) with per-stage costs from the cost model."""
    w = ctx.workload
    seq = float(w.prompt_len.median + w.output_len.median)
    pipes, m_c = _fused_layout(pp_a, pp_c, m_a)
    costs = {name: training_pipe_costs(ctx.cost_model, ctx.model(pipe.model), pipe.num_stages, tp, w.micro_batch_size,
                                       seq, seq, w.activation_recompute)
             for name, pipe in pipes.items()}
    return pipes, costs, m_c


# The paper authors' own instances of the Table 3 shapes (FlexFusion, github.com/FlexFusion/FlexFusion,
# parallel_driver.cc, get_config_exp0..exp11 at commit 212c257): integer forward times (backward =
# 2 x forward) and activation per micro-batch and stage, per (actor stages, critic stages), the same
# on every stage. ``benchmarks/fuse_search.py --costs flexfusion`` runs our search on them, to
# compare with their solver on its own problems (docs/FUSED_SEARCH.md, "Against FlexFusion").
FLEXFUSION_COSTS = {  # (pp_actor, pp_critic): (actor fwd, critic fwd, actor activation, critic activation)
    (8, 4): (5, 4, 1.95, 2.0),
    (8, 8): (5, 2, 1.95, 1.0),
    (16, 8): (2, 2, 1.64, 2.0),
    (16, 16): (2, 1, 1.64, 1.0),
}


def flexfusion_layout_costs(pp_a: int, pp_c: int, m_a: int):
    """FlexFusion's integer instance of a Table 3 shape: the same fused layout as
    ``fused_layout_costs`` (``_fused_layout``), uniform integer stage costs from
    ``FLEXFUSION_COSTS``."""
    if (pp_a, pp_c) not in FLEXFUSION_COSTS:
        raise ValueError(f"FlexFusion has no instance for pp {pp_a}/{pp_c}; known: "
                         + ", ".join(f"{a}/{c}" for a, c in FLEXFUSION_COSTS))
    fwd_a, fwd_c, act_a, act_c = FLEXFUSION_COSTS[(pp_a, pp_c)]
    pipes, m_c = _fused_layout(pp_a, pp_c, m_a)
    costs = {name: PipeCosts.uniform(pipe.num_stages, fwd_a if pipe.model == "actor" else fwd_c, None,
                                     act_a if pipe.model == "actor" else act_c)
             for name, pipe in pipes.items()}
    return pipes, costs, m_c


def _one_f_one_b_plus(ctx, pp_a: int, pp_c: int, m_a: int, m_c: int, tp: int) -> tuple[float, float]:
    """Each model on half the stages with twice the replicas (half the micro-batches), serially."""
    pipes, costs, _ = fused_layout_costs(ctx, "", "", max(1, pp_a // 2), max(1, pp_c // 2), max(1, m_a // 2), tp)
    # serially, as the paper's serial baseline: one model's pipeline, a barrier, the other's
    return paper_serial(pipes, costs)


def table3_schedules(cfg: DictConfig, tools: ExperimentTools) -> Path:
    params = cfg.experiment_params
    out = []
    for case in params.cases:
        ctx = _pair_context(tools, case.actor, case.critic)
        for m_a in params.microbatches:
            pipes, costs, m_c = fused_layout_costs(ctx, case.actor, case.critic, case.pp_actor, case.pp_critic, m_a,
                                                 params.tp)
            serial_s, serial_peak = paper_serial(pipes, costs)  # actor 1F1B, barrier, critic 1F1B
            no_barrier = simulate(serial_schedule(pipes), costs, record_times=False)
            cap = _memory_cap(params, serial_peak)
            greedy = simulate(greedy_schedule(pipes, costs, cap), costs, record_times=False)
            fused = search_fused_schedule(pipes, costs, cap, FusedSearchConfig(seed=params.seed,
                                                                               **search_budget(params, pipes)))
            plus_makespan, plus_peak = _one_f_one_b_plus(ctx, case.pp_actor, case.pp_critic, m_a, m_c, params.tp)
            out.append({
                "pair": f"{case.actor}/{case.critic}", "pp_actor": case.pp_actor, "pp_critic": case.pp_critic,
                "microbatches_actor": m_a, "microbatches_critic": m_c,
                "serial_s": serial_s, "serial_no_barrier_s": no_barrier.makespan, "greedy_s": greedy.makespan,
                "fused_s": fused.makespan, "one_f_one_b_plus_s": plus_makespan, "lower_bound_s": fused.lower_bound,
                "fused_speedup": serial_s / fused.makespan,
                "fused_speedup_vs_no_barrier": no_barrier.makespan / fused.makespan,
                "fused_memory_ratio": fused.peak_memory / serial_peak,
                "greedy_memory_ratio": greedy.max_peak_memory / serial_peak,
                "one_f_one_b_plus_memory_ratio": plus_peak / serial_peak,
                "gap_to_lower_bound_frac": fused.makespan / fused.lower_bound - 1.0, "search_s": fused.search_s,
            })
            print(f"[table3] {case.actor}/{case.critic} pp {case.pp_actor}/{case.pp_critic} M={m_a}: "
                  f"serial {serial_s:.4f} fused {fused.makespan:.4f} LB {fused.lower_bound:.4f}")
    return tools.write_table("table3.csv", out)


DEFAULT_SEARCH_ACTION_STEPS = 2e7


def search_budget(params, pipes) -> dict[str, Any]:
    """The fused search's budget: by default ``search_action_steps`` (steps x actions of the
    schedule, so every shape gets about the same CPU time, as in ``benchmarks/fuse_search.py``) in
    annealing steps, so the same config and seed give the same schedule; a wall-clock
    ``search_time_s`` only when set."""
    time_s = params.get("search_time_s")
    if time_s is not None:
        return {"time_limit_s": float(time_s)}
    actions = sum(2 * pipe.num_stages * pipe.num_mbs for pipe in pipes.values())
    action_steps = float(params.get("search_action_steps") or DEFAULT_SEARCH_ACTION_STEPS)
    return {"max_steps": max(1, round(action_steps / actions))}


def _memory_cap(params, serial_peak: float) -> float | None:
    """``memory_cap_vs_serial`` x the serial 1F1B peak (the paper keeps fused schedules at it); null = none."""
    frac = params.get("memory_cap_vs_serial")
    return None if frac is None else frac * serial_peak


def _pair_context(tools: ExperimentTools, actor: str, critic: str) -> PlanContext:
    """The planning context with actor/ref = ``actor`` and critic/reward = ``critic`` (paper pairs)."""
    return tools.context([f"model={actor}_{critic}", "+system=rlhfuse_base"])


def _timeline(schedule: Schedule, costs: dict, label: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    res = simulate(schedule, costs, record_times=True)
    actions, memory = [], []
    for rank in schedule.order:
        held, events = 0.0, []
        for action in schedule.order[rank]:
            if not action.is_compute:
                continue
            pipe = schedule.pipes[action.pipe]
            start, end = res.start[action], res.end[action]
            actions.append({"schedule": label, "rank": rank, "pipe": action.pipe, "model": pipe.model,
                            "stage": action.stage, "kind": action.kind, "mb": action.mb, "start_s": start, "end_s": end})
            act = costs[action.pipe].activation[action.stage]
            events.append((start, act) if action.kind == "F" else (end, -act))
        for t, delta in sorted(events):
            held += delta
            memory.append({"schedule": label, "rank": rank, "time_s": t, "activation_gb": held})
    return actions, memory


def fig10_schedule(cfg: DictConfig, tools: ExperimentTools) -> Path:
    params = cfg.experiment_params
    ctx = _pair_context(tools, "65b", "33b")
    pipes, costs, _ = fused_layout_costs(ctx, "65b", "33b", 16, 8, params.microbatches, params.tp)
    serial_peak = paper_serial(pipes, costs)[1]
    fused = search_fused_schedule(pipes, costs, _memory_cap(params, serial_peak),
                                  FusedSearchConfig(seed=params.seed, **search_budget(params, pipes)))
    rows, mem = [], []
    for label, sched in (("fused", fused.schedule), ("serial_1f1b", serial_schedule(pipes))):
        a, m = _timeline(sched, costs, label)
        rows += a
        mem += m
    actor_alone = {k: v for k, v in pipes.items() if v.model == "actor"}
    alone = simulate(serial_schedule(actor_alone), {k: costs[k] for k in actor_alone}, record_times=False)
    tools.write_table("actions.csv", rows)
    tools.write_table("memory.csv", mem)
    tools.write_table("summary.csv", [{
        "fused_s": fused.makespan, "serial_s": fused.serial_makespan,
        "serial_no_barrier_s": fused.serial_no_barrier_makespan, "actor_alone_1f1b_s": alone.makespan,
        "lower_bound_s": fused.lower_bound, "fused_peak_gb": fused.peak_memory,
        "serial_peak_gb": fused.serial_peak_memory, "search_s": fused.search_s}])
    print(f"[fig10] fused {fused.makespan:.4f} s, 65B actor alone {alone.makespan:.4f} s, serial {fused.serial_makespan:.4f} s")
    return tools.folder
