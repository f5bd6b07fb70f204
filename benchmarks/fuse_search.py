"""Fused-schedule search quality and cost on the paper's Table 3 shapes.

    python benchmarks/fuse_search.py                          # 2 seeds on 2 worker processes
    python benchmarks/fuse_search.py --workers 1 --seeds 1    # one seed in this process
    python benchmarks/fuse_search.py --max-steps 20000        # the same step budget on every row
    python benchmarks/fuse_search.py --time-limit 60          # wall-clock budget per seed instead
    python benchmarks/fuse_search.py --microbatches 8 16 --pairs 33b/13b
    python benchmarks/fuse_search.py --exact-effort 0         # annealing only (no CP-SAT refinement)
    python benchmarks/fuse_search.py --action-steps 2e9 --exact-max-microbatches 0   # refine every row
    python benchmarks/fuse_search.py --costs flexfusion       # FlexFusion's integer instances

For every actor/critic pair and pipeline shape of Table 3 (33B/13B at pp 8/4 and 8/8, 65B/33B at
pp 16/8 and 16/16; tp 8; per-stage costs from the H100-class cost model at the workload's median
sequence length) and 8 to 64 micro-batches per actor pipeline, prints the fused schedule's
makespan over the lower bound, its peak activation memory over the paper's serial baseline's
(actor 1F1B, barrier, critic 1F1B), the peak the makespan phase ended at (where the memory phase
started), the speedup over the serial baseline, the search's wall time and CPU time (all
processes: about twice the wall time when 2 workers have the 2 cores to themselves, less when the
machine is shared) and its steps (trial moves per seed), with no memory cap, and whether the row meets the memory target
(peak <= 1.0x serial with 8-16 micro-batches, <= 1.3x with 32-64) at the lower bound.

Budget: a trial move costs a fixed part plus a part proportional to the schedule (the schedule
is re-timed from the first changed action on). With both phases in one compiled loop
the fixed part is about 1.4 microseconds here and the proportional part about 5.8 ns per action
(fitted to the default run's rows of 384 and 4 096 actions, 2026-11-27), so by default every row
gets the same budget of *work units*, ``--action-steps`` per seed, a step costing
``actions + STEP_OVERHEAD_ACTIONS`` units: ``action_steps / (actions + 250)`` steps, printed per
row. The default, 1e10, is sized so that with 2 seeds on 2 workers each row takes about 60 s of
the idle 2-core machine, the greedy starting points (computed once in the parent) included: the
issue's "60 s on 2 cores" (7e9 units at ``actions + 600`` took 25-41 s a row once the makespan
phase was compiled). ``--max-steps`` gives every row the same step count instead. With a
step budget every number but the wall time is deterministic (and the same with or without numba,
only slower without). After annealing, the exact (CP-SAT) refinement runs with ``--exact-effort``
(default 10) on the rows whose every pipe has at most ``--exact-max-microbatches`` (default 8) and
fills the columns it proves (``proven``: the makespan's proven bound over the lower bound, ``opt``
when the makespan is proven optimal; ``peak >=`` also rises where CP-SAT proves more). ``peak >=``
is printed on every row: no schedule that short holds less, by the closed-form bound
(``bounds.peak_lower_bound``) or the refinement's proof, whichever is higher; a missed target
above which that bound lies is printed as ``unreachable``: no schedule that short meets it.
``gap`` is the restated target: ``least`` where the peak is proven the least at its
makespan (the refinement proved it optimal, to its integer rounding, or the peak meets the
bound), else the peak over the best bound. Why only the 8-micro-batch rows: on each of them CP-SAT
proved the least peak (and 8/4's makespan) with effort 1.3-5.2, in 1-8 s; on the larger rows, in
every run but one row's, it spent its whole effort without a proof, up to 144 s a row
(docs/FUSED_SEARCH.md, "The proof by default"). ``--costs flexfusion`` runs the same shapes with
the paper authors' own integer stage costs (``systems.rlhfuse.experiments.FLEXFUSION_COSTS``),
the problems their public solver was run on, so that the two searches can be compared on the
same instances (docs/FUSED_SEARCH.md, "Against FlexFusion"). Not a test: numbers for docs/FUSED_SEARCH.md.
"""
from __future__ import annotations

import argparse
import os
import resource
import time
from dataclasses import replace

from omegaconf import OmegaConf

from harness.run.pipeline import build_context, compose
from systems.rlhfuse.experiments import flexfusion_layout_costs, fused_layout_costs
from systems.rlhfuse.intra import FusedSearchConfig, search_fused_schedule
from systems.rlhfuse.intra.config import (DEFAULT_GROW_MAKESPAN_WEIGHTS, DEFAULT_MEMORY_CAP_STEPS,
                                          DEFAULT_MEMORY_MAKESPAN_WEIGHTS)

CASES = (("33b", "13b", 8, 4), ("33b", "13b", 8, 8), ("65b", "33b", 16, 8), ("65b", "33b", 16, 16))
DEFAULT_ACTION_STEPS = 1e10
DEFAULT_EXACT_EFFORT = 10.0  # CP-SAT deterministic time of the exact refinement (see the docstring)
DEFAULT_EXACT_MAX_MICROBATCHES = 8  # ... on rows with no pipe above this many micro-batches (0: every row)
STEP_OVERHEAD_ACTIONS = 250  # the fixed cost of a step, in actions re-timed (see the docstring)
SEARCH_DEFAULTS = FusedSearchConfig()  # the search's defaults (config.py) for the options this benchmark keeps


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the worker processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def work_budget(pipes, action_steps: float) -> tuple[int, int]:
    """(actions of the fused schedule, steps per seed that ``action_steps`` work units buy)."""
    actions = sum(2 * pipe.num_stages * pipe.num_mbs for pipe in pipes.values())
    return actions, round(action_steps / (actions + STEP_OVERHEAD_ACTIONS))


def memory_target(num_microbatches: int) -> float:
    """The memory target: no more than serial's peak with 8-16 micro-batches, at most 1.3x with 32-64."""
    return 1.0 if num_microbatches <= 16 else 1.3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--pairs", nargs="+", help="e.g. 33b/13b (default: both Table 3 pairs)")
    p.add_argument("--action-steps", type=float, default=DEFAULT_ACTION_STEPS,
                   help=f"work units per seed, a step costing actions + {STEP_OVERHEAD_ACTIONS} "
                        f"(default {DEFAULT_ACTION_STEPS:g}; deterministic)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="the same number of steps per seed on every row instead")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds per seed instead of steps (not deterministic)")
    p.add_argument("--exact-effort", type=float, default=DEFAULT_EXACT_EFFORT,
                   help=f"then the exact (CP-SAT) refinement with this deterministic-time budget "
                        f"(default {DEFAULT_EXACT_EFFORT:g}; 0: annealing only)")
    p.add_argument("--exact-max-microbatches", type=int, default=DEFAULT_EXACT_MAX_MICROBATCHES,
                   help="refine only rows whose every pipe has at most this many micro-batches "
                        f"(default {DEFAULT_EXACT_MAX_MICROBATCHES}; 0: every row)")
    p.add_argument("--exact-workers", type=int, default=SEARCH_DEFAULTS.exact_workers,
                   help=f"threads of the CP-SAT portfolio (default {SEARCH_DEFAULTS.exact_workers})")
    p.add_argument("--makespan-slack", type=float, default=SEARCH_DEFAULTS.makespan_slack_frac,
                   help="let the memory phase lengthen the schedule up to (1 + this) x the makespan phase's best "
                        f"(default {SEARCH_DEFAULTS.makespan_slack_frac:g}; the time-for-memory trade in "
                        "docs/FUSED_SEARCH.md)")
    p.add_argument("--memory-move-reach", type=int, default=SEARCH_DEFAULTS.memory_move_reach,
                   help="longest shift of the memory phase's moves along a rank's list "
                        f"(default {SEARCH_DEFAULTS.memory_move_reach}; docs/FUSED_SEARCH.md, \"Against "
                        "FlexFusion\", measures 64)")
    p.add_argument("--memory-cap-steps", type=float, nargs="+", default=list(DEFAULT_MEMORY_CAP_STEPS),
                   help="the memory phase's cap, in smallest activations below its best peak; seed k "
                        f"runs the (k mod n)-th (default {' '.join(f'{s:g}' for s in DEFAULT_MEMORY_CAP_STEPS)}; "
                        "docs/FUSED_SEARCH.md, \"The cap step\")")
    p.add_argument("--memory-makespan-weights", type=float, nargs="+", default=list(DEFAULT_MEMORY_MAKESPAN_WEIGHTS),
                   help="the memory phase's energy per mean action time above the target makespan; seed k "
                        f"runs the (k mod n)-th (default {' '.join(f'{w:g}' for w in DEFAULT_MEMORY_MAKESPAN_WEIGHTS)}; "
                        "docs/FUSED_SEARCH.md, \"The makespan's weight\")")
    p.add_argument("--grow-min-microbatches", type=int, default=FusedSearchConfig.grow_min_microbatches,
                   help="rows whose every pipe has at least this many micro-batches also start seed 0 from the search "
                        f"of half as many, grown (default {FusedSearchConfig.grow_min_microbatches}; 0: never; "
                        "docs/FUSED_SEARCH.md, \"Grown from half\")")
    p.add_argument("--grow-makespan-weights", type=float, nargs="+", default=list(DEFAULT_GROW_MAKESPAN_WEIGHTS),
                   help="the memory makespan weights of the search of half whose order is grown (default "
                        f"{' '.join(f'{w:g}' for w in DEFAULT_GROW_MAKESPAN_WEIGHTS)}; docs/FUSED_SEARCH.md, "
                        "\"Grown from half\")")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per configuration (default: --workers)")
    p.add_argument("--seed", type=int, default=SEARCH_DEFAULTS.seed)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--costs", choices=("model", "flexfusion"), default="model",
                   help="stage costs: our calibrated cost model (default) or FlexFusion's integer "
                        "instances of the same shapes (the paper authors' solver's own problems)")
    args = p.parse_args()
    base = FusedSearchConfig(seed=args.seed, max_steps=args.max_steps, time_limit_s=args.time_limit,
                             num_workers=args.workers, num_seeds=args.seeds, exact_effort=args.exact_effort,
                             exact_workers=args.exact_workers, exact_max_microbatches=args.exact_max_microbatches,
                             makespan_slack_frac=args.makespan_slack, memory_move_reach=args.memory_move_reach,
                             memory_cap_steps=args.memory_cap_steps,
                             memory_makespan_weights=args.memory_makespan_weights,
                             grow_min_microbatches=args.grow_min_microbatches,
                             grow_makespan_weights=args.grow_makespan_weights)
    try:  # every option out of range, before any row (the search's own check)
        base.check()
    except ValueError as e:
        p.error(str(e))
    budget = (f"{args.time_limit:g} s" if args.time_limit else f"{args.max_steps} steps" if args.max_steps
              else f"{args.action_steps:g} work units (steps x (actions + {STEP_OVERHEAD_ACTIONS}))") + " per seed"
    print(f"# {budget}, {args.seeds or args.workers} seed(s) on {args.workers} worker(s), "
          f"exact refinement effort {args.exact_effort:g} on {args.exact_workers} threads"
          f"{f' up to {args.exact_max_microbatches} micro-batches' if args.exact_max_microbatches else ''}, "
          f"makespan slack {args.makespan_slack:g}, memory move reach {args.memory_move_reach}, "
          f"memory cap steps {' '.join(f'{s:g}' for s in args.memory_cap_steps)}, "
          f"memory makespan weights {' '.join(f'{w:g}' for w in args.memory_makespan_weights)}, "
          f"grown from half at {args.grow_min_microbatches or 'never'} "
          f"(its makespan weights {' '.join(f'{w:g}' for w in args.grow_makespan_weights)}), "
          f"{args.costs} costs, "
          f"{os.cpu_count()} cores", flush=True)
    print(f"{'pair':<9}{'pp':>7}{'M':>4}{'makespan/LB':>13}{'proven':>8}{'peak/serial':>13}{'annealed':>10}"
          f"{'peak >=':>9}{'gap':>7}{'phase-1 peak':>14}"
          f"{'vs serial':>11}{'wall s':>8}{'cpu s':>7}{'actions':>9}{'steps':>9}  target")
    met = rows = traded = least = 0
    for actor, critic, pp_a, pp_c in CASES:
        if args.pairs and f"{actor}/{critic}" not in args.pairs:
            continue
        if args.costs == "model":
            run = OmegaConf.to_object(compose(["+system=rlhfuse", f"llama@model.actor={actor}",
                                               f"llama@model.ref={actor}", f"llama@model.critic={critic}",
                                               f"llama@model.reward={critic}"]))
            ctx = build_context(run)
        for m in args.microbatches:
            if args.costs == "model":
                pipes, costs, _ = fused_layout_costs(ctx, actor, critic, pp_a, pp_c, m, args.tp)
            else:
                pipes, costs, _ = flexfusion_layout_costs(pp_a, pp_c, m)
            actions, row_budget = work_budget(pipes, args.action_steps)
            steps = None if args.time_limit else (args.max_steps or row_budget)
            t0, cpu0 = time.perf_counter(), _cpu_s()
            config = replace(base, max_steps=steps)
            res = search_fused_schedule(pipes, costs, None, config)
            wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
            target = memory_target(m)
            # at the lower bound, or at a makespan the exact refinement proved optimal
            at_bound = res.makespan_optimal
            ok = at_bound and res.peak_memory_vs_serial <= target + 1e-9
            impossible = res.peak_lower_bound / res.serial_peak_memory > target + 1e-9
            met += ok
            rows += 1
            verdict = (("met" if ok else "unreachable" if impossible else "missed") + f" (<= {target:g}x"
                       + ("" if at_bound else ", makespan not proven optimal") + ")")
            if args.makespan_slack > 0 and not at_bound:  # the trade: memory at a longer makespan
                fits = res.peak_memory_vs_serial <= target + 1e-9
                traded += fits
                verdict = (f"{'within' if fits else 'above'} {target:g}x at "
                           f"+{100 * res.gap_to_lower_bound_frac:.2f}% over the bound")
            proven = "opt" if res.makespan_optimal else f"{res.makespan_bound / res.lower_bound:.4f}"
            # the target: the least peak provable at this makespan; else how far from the bound
            at_least = (res.exact.memory_status == "OPTIMAL"  # to the refinement's integer rounding
                        or res.peak_memory <= res.peak_lower_bound * (1 + 1e-9))
            least += at_least
            gap = "least" if at_least else f"{res.peak_memory / res.peak_lower_bound:.3f}"
            print(f"{actor}/{critic:<5}{pp_a:>4}/{pp_c:<2}{m:>4}{res.makespan_vs_lower_bound:>13.4f}{proven:>8}"
                  f"{res.peak_memory_vs_serial:>13.3f}{res.exact.annealed_peak_memory / res.serial_peak_memory:>10.3f}"
                  f"{res.peak_lower_bound / res.serial_peak_memory:>9.3f}{gap:>7}"
                  f"{res.phase1_peak_memory / res.serial_peak_memory:>14.3f}"
                  f"{res.serial_makespan / res.makespan:>10.3f}x{wall:>8.1f}{cpu:>7.0f}{actions:>9}{res.steps:>9}  {verdict}"
                  f"  [{res.origin}]",
                  flush=True)
    print(f"# peak proven least at its makespan on {least} of {rows} configurations; "
          f"memory target met at the optimal makespan on {met} of {rows} configurations"
          + (f"; within it at a longer makespan on {traded} more" if args.makespan_slack > 0 else ""))


if __name__ == "__main__":
    main()
