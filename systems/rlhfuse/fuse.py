"""Command line for RLHFuse intra-stage fusion (NSDI'25, arXiv 2409.13221, section 5): search a
fused schedule of two models' training pipelines running in opposite directions, and compare it
with the serial 1F1B baseline and the lower bound.

    python -m systems.rlhfuse.fuse --stages 16 8 --microbatches 16 32 --fwd 2 1 --mem 2 1 \\
        --max-steps 60000 --workers 2 --json --out fused.csv

Model 1 is the ``N1``-stage one. ``--fwd`` is the per-stage forward time of one micro-batch,
``--bwd`` the backward time (default twice the forward), ``--mem`` the activation memory one
in-flight micro-batch holds on a stage, ``--microbatches`` counts per pipeline. The search has two
phases (makespan, then peak memory at that makespan); its budget is ``--max-steps`` trial moves per
seed (default ``DEFAULT_MAX_STEPS``: the same seed and steps give the same schedule), or
``--time-limit`` seconds per seed if given (whichever runs out first when both are). ``--workers N``
anneals ``--seeds`` (default N) seeds in N processes. ``--exact-effort E`` then refines the best
by constraint programming (``systems/rlhfuse/intra/exact.py``, CP-SAT, deterministic budget E) and
reports what it proves: a lower bound on the makespan and on the peak at that makespan.
``--makespan-slack FRAC`` trades time for memory: the memory phase (and the refinement's) may
return a schedule up to ``(1 + FRAC)`` x the makespan phase's best. With ``--json`` it prints one JSON object
(makespan, lower bound, their ratio, peak memory and its ratio to the serial baseline's, the
makespan phase's peak, ...); otherwise a short table and the rank x step grid. ``--out`` writes
the schedule CSV (``harness.schedule.to_csv``). Bad input (a count below 1, a time or an amount
that is not a finite positive number, ...) ends with one line ``error: ...`` naming the option and
exit status 2; Ctrl-C with one line and exit status 130.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from math import lcm

from harness.schedule import ascii_grid, simulate, to_csv
from systems.rlhfuse.intra import fused_costs, fused_pipes, search_fused_schedule
from systems.rlhfuse.intra.config import DEFAULT_MAX_STEPS, FusedSearchConfig

DEFAULTS = FusedSearchConfig()  # the options' defaults, as config.py writes them (the command line's too)


class _OneLineParser(argparse.ArgumentParser):
    """Bad input ends with one line ``error: ...`` and exit code 2 (argparse's own errors too, without
    the usage block)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {message} ({self.prog} --help lists the options)\n")


def parser() -> argparse.ArgumentParser:
    """The command line (one line ``error: ...`` and exit status 2 on bad input)."""
    p = _OneLineParser(prog="python -m systems.rlhfuse.fuse",
                                description="Search a fused two-model pipeline schedule "
                                            "(RLHFuse section 5).")
    p.add_argument("--stages", nargs=2, type=int, required=True, metavar=("N1", "N2"))
    p.add_argument("--microbatches", nargs=2, type=int, required=True, metavar=("M1", "M2"),
                   help="micro-batches per pipeline of each model")
    p.add_argument("--fwd", nargs=2, type=float, required=True, metavar=("F1", "F2"),
                   help="per-stage forward time of one micro-batch")
    p.add_argument("--bwd", nargs=2, type=float, metavar=("B1", "B2"),
                   help="per-stage backward time (default: 2 x forward)")
    p.add_argument("--mem", nargs=2, type=float, required=True, metavar=("A1", "A2"),
                   help="activation memory of one in-flight micro-batch on a stage")
    p.add_argument("--mem-cap", type=float, help="cap on a rank's in-flight activation memory")
    p.add_argument("--p2p", type=float, default=0.0, help="time to move activations between ranks")
    p.add_argument("--models", nargs=2, default=("actor", "critic"), metavar=("NAME1", "NAME2"))
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    p.add_argument("--max-steps", type=int, metavar="STEPS",
                   help=f"trial moves per seed (deterministic budget; default {DEFAULT_MAX_STEPS} "
                        "unless --time-limit is given)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="wall-clock limit per seed (not deterministic)")
    p.add_argument("--workers", type=int, default=DEFAULTS.num_workers, help="seeds annealed in parallel processes")
    p.add_argument("--seeds", type=int, help="number of seeds (default: --workers)")
    p.add_argument("--exact-effort", type=float, default=DEFAULTS.exact_effort, metavar="UNITS",
                   help="then refine the annealed best by constraint programming (CP-SAT) with this "
                        f"deterministic-time budget on --workers threads (default {DEFAULTS.exact_effort:g}; "
                        "0: off); proves bounds on the makespan and the peak")
    p.add_argument("--exact-workers", type=int, default=DEFAULTS.exact_workers,
                   help=f"threads of the constraint solver's portfolio (default {DEFAULTS.exact_workers}; part "
                        "of the result's inputs: the same number gives the same schedule on any machine)")
    p.add_argument("--makespan-slack", type=float, default=DEFAULTS.makespan_slack_frac, metavar="FRAC",
                   help="trade time for memory: the memory phase may lengthen the schedule up to (1 + FRAC) x "
                        f"the makespan phase's best (default {DEFAULTS.makespan_slack_frac:g}; 0: never)")
    p.add_argument("--out", help="write the schedule as CSV here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = {"--stages": args.stages, "--microbatches": args.microbatches, "--fwd": args.fwd,
                "--mem": args.mem}
    if args.bwd is not None:
        positive["--bwd"] = args.bwd
    for flag, values in positive.items():
        if not all(math.isfinite(v) and v > 0 for v in values):
            p.error(f"{flag} values must be finite and > 0, got {' '.join(f'{v:g}' for v in values)}")
    for flag, value in (("--mem-cap", args.mem_cap), ("--p2p", args.p2p), ("--time-limit", args.time_limit),
                        ("--exact-effort", args.exact_effort), ("--makespan-slack", args.makespan_slack)):
        if value is not None and not math.isfinite(value):
            p.error(f"{flag} must be a finite number, got {value:g}")
    for flag, value, ok in (("--mem-cap", args.mem_cap, args.mem_cap is None or args.mem_cap > 0),
                            ("--p2p", args.p2p, args.p2p >= 0),
                            ("--time-limit", args.time_limit, args.time_limit is None or args.time_limit > 0),
                            ("--max-steps", args.max_steps, args.max_steps is None or args.max_steps >= 1),
                            ("--workers", args.workers, args.workers >= 1),
                            ("--seeds", args.seeds, args.seeds is None or args.seeds >= 1),
                            ("--exact-effort", args.exact_effort, args.exact_effort >= 0),
                            ("--makespan-slack", args.makespan_slack, args.makespan_slack >= 0),
                            ("--exact-workers", args.exact_workers, args.exact_workers >= 1)):
        if not ok:
            p.error(f"{flag} must be positive (>= 0 for --p2p, --exact-effort and --makespan-slack), "
                    f"got {value:g}")
    if args.models[0] == args.models[1]:
        p.error(f"--models needs two different names, got {args.models[0]!r} twice")


def _table(summary: dict) -> str:
    rows = [
        ("makespan", f"{summary['makespan']:g}"),
        ("lower bound", f"{summary['lower_bound']:g} (makespan / bound {summary['makespan_vs_lower_bound']:.4f})"),
        ("serial 1F1B", f"{summary['serial_makespan']:g} (speedup {summary['speedup_vs_serial']:.3f}x; "
                        f"actor then critic with a barrier, as in the paper)"),
        ("serial, no barrier", f"{summary['serial_no_barrier_makespan']:g} "
                               f"(speedup {summary['speedup_vs_serial_no_barrier']:.3f}x)"),
        ("greedy", f"{summary['greedy_makespan']:g}"),
        ("peak memory", f"{summary['peak_memory']:g} ({summary['peak_memory_vs_serial']:.3f}x the serial "
                        f"baseline's {summary['serial_peak_memory']:g}; makespan phase ended at "
                        f"{summary['phase1_peak_memory_vs_serial']:.3f}x, memory phase lowered it "
                        f"{summary['memory_levels']} times)"),
        ("bubble", f"{100 * summary['bubble_frac']:.1f}%"),
        ("search", f"{summary['search_s']:.1f} s, {summary['steps']} steps "
                   f"({summary['steps_memory']} in the memory phase), start {summary['best_start']}"),
        ("peak bound", f"no schedule at most this long holds less than {summary['peak_lower_bound']:g} "
                       f"({summary['peak_lower_bound_vs_serial']:.3f}x serial)"),
        ("valid", str(summary["valid"])),
    ]
    if summary["makespan_slack_frac"] > 0:
        rows.insert(-2, ("makespan slack", f"{summary['makespan_slack_frac']:g} (the memory phase may end up "
                                           f"to this fraction above the makespan phase's "
                                           f"{summary['phase1_makespan']:g})"))
    if summary["exact_effort"] > 0:
        proven = (f"makespan >= {summary['makespan_bound']:g} (optimal: {summary['makespan_optimal']}); "
                  f"peak at this makespan >= {summary['peak_bound']:g} "
                  f"({summary['peak_bound_vs_serial']:.3f}x serial)")
        rows.insert(-1, ("exact refinement", f"from makespan {summary['annealed_makespan']:g}, peak "
                                             f"{summary['annealed_peak_memory']:g}; {summary['exact_s']:.1f} s, "
                                             f"effort {summary['exact_effort_used']:.1f}; proven: {proven}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def search_config(args: argparse.Namespace) -> FusedSearchConfig:
    """The search's options as given on the command line (the others at their defaults)."""
    return FusedSearchConfig(seed=args.seed, time_limit_s=args.time_limit, max_steps=args.max_steps,
                             num_workers=args.workers, num_seeds=args.seeds, exact_effort=args.exact_effort,
                             exact_workers=args.exact_workers, makespan_slack_frac=args.makespan_slack)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    _check(p, args)
    (n1, n2), (m1, m2) = args.stages, args.microbatches
    try:
        pipes = fused_pipes(n1, n2, m1, m2, *args.models)
        bwd1, bwd2 = args.bwd if args.bwd is not None else (None, None)
        costs = fused_costs(pipes, args.fwd[0], args.fwd[1], bwd1, bwd2, args.mem[0], args.mem[1],
                            p2p=args.p2p)
        result = search_fused_schedule(pipes, costs, args.mem_cap, search_config(args))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        to_csv(result.schedule, args.out)
    summary = {"stages": [n1, n2], "microbatches": [m1, m2], "num_ranks": lcm(n1, n2),
               "pipes": {name: list(pipe.stage_to_rank) for name, pipe in pipes.items()},
               **result.summary()}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_table(summary))
        print()
        print(ascii_grid(result.schedule, simulate(result.schedule, costs, record_times=False)))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: no schedule was written", file=sys.stderr)
        sys.exit(130)
