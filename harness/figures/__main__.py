"""Draw the paper's figures from results/ (``<results>/figures/<name>.png`` and ``.pdf``).

    python -m harness.figures NAME... | all [--results DIR] [--run] [-o [EXPERIMENT:]KEY=VALUE]... [-- OVERRIDE...]

``all`` is the paper's figures; the harness's own figures (``learning_curves``) are drawn by name.

``--run`` first runs each figure's experiment, ``python -m harness +experiment=<experiment>
results_dir=DIR [overrides]`` (finished runs are skipped, so re-running is cheap); each run prints
one line when it ends. Figure 8 reads
Figure 7's RLHFuse-Base and RLHFuse runs: its experiment, ``fig8_breakdown``, runs only those two
systems into ``DIR/fig7_throughput``.

``-o/--override KEY=VALUE`` (repeatable), or everything after ``--``, are Hydra overrides forwarded
to every experiment that ``--run`` launches; ``-o EXPERIMENT:KEY=VALUE`` forwards one to that
experiment only, in place of a general one for the same key. Overrides of a swept key replace the
experiment's sweep (``model=tiny`` runs only ``tiny`` instead of the four pairs;
``system.migration_frac=0,0.2`` sweeps two points). Runs made with overrides have their own folders
(the overrides are in the variant), so draw a tiny sweep from its own ``--results`` folder. A tiny
version of every paper figure, in about a minute on 2 cores::

    python -m harness.figures all --run --results /tmp/tiny -o logger=none \\
        -o model=tiny -o workload=tiny -o workload.global_batch_size=16 -o workload.max_gen_len=16 \\
        -o cluster=h100_8x -o cluster.num_nodes=1 \\
        -o fig2_lengths:workload.max_gen_len=8,16 -o fig9_migration:system.migration_frac=0,0.2 \\
        -o 'table3_schedules:experiment_params.microbatches=[4]' \\
        -o 'table3_schedules:experiment_params.cases=[{actor:33b,critic:13b,pp_actor:4,pp_critic:2}]' \\
        -o table3_schedules:experiment_params.search_action_steps=1e4 \\
        -o fig10_schedule:experiment_params.microbatches=4 -o fig10_schedule:experiment_params.search_action_steps=1e4

(``model``/``workload``/``cluster`` overrides are ignored by the schedule experiments, Table 3 and
Figure 10, which build their own models; ``learning_curves`` passes only ``logger`` on to its runs,
so shrink it through ``experiment_params``, e.g. ``-o 'experiment_params.seeds=[0]' -o
experiment_params.iterations=2``.)

Exit status: 0 when every figure was drawn; 2 when a figure's results are missing or cannot be
drawn, or an experiment refused its command line (one line ``error: <figure>: ...`` each, naming
the experiment to run); 1 when an experiment had failed jobs (listed in
``DIR/<experiment>/failures.jsonl``) but its figure was drawn from the runs that finished.
"""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time

from harness.figures import EXTRA_FIGURES, FIGURES

ALL_NAMES = FIGURES + EXTRA_FIGURES


def experiment_of(name: str) -> str:
    """The ``conf/experiment/`` config that makes a figure's results."""
    return importlib.import_module(f"harness.figures.{name}").EXPERIMENT


def run_experiment(experiment: str, results_dir: str, overrides: list[str] = ()) -> int:
    """``python -m harness +experiment=<experiment> results_dir=<results_dir> <overrides>``, each run
    printing one line when it ends (``logger.summary=line``: its folder, samples/s and step time,
    not its summary table); its exit code."""
    cmd = [sys.executable, "-m", "harness", f"+experiment={experiment}", f"results_dir={results_dir}",
           "logger.summary=line", *overrides]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def split_overrides(items: list[str], experiments: set[str]) -> dict[str | None, list[str]]:
    """``[EXPERIMENT:]KEY=VALUE`` items -> {None: for every experiment, experiment: for that one}.
    Raises ValueError on an item without ``=`` or naming an unknown experiment."""
    out: dict[str | None, list[str]] = {None: []}
    for item in items:
        key, eq, _ = item.partition("=")
        if not eq and not key.startswith("~"):
            raise ValueError(f"override {item!r} is not KEY=VALUE")
        scope = None
        if ":" in key:
            scope, item = item.split(":", 1)
            if scope not in experiments:
                raise ValueError(f"override {scope}:{item}: no experiment {scope!r} "
                                 f"(one of {', '.join(sorted(experiments))})")
        out.setdefault(scope, []).append(item)
    return out


def merge_overrides(general: list[str], specific: list[str]) -> list[str]:
    """``general`` then ``specific``, a general override dropped where ``specific`` sets the same key
    (the harness refuses a key given twice)."""
    def key(item: str) -> str:
        return item.partition("=")[0].lstrip("+~")

    own = {key(item) for item in specific}
    return [item for item in general if key(item) not in own] + list(specific)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def main(argv: list[str] | None = None) -> int:
    from harness.figures import style

    argv = list(sys.argv[1:] if argv is None else argv)
    trailing = []
    if "--" in argv:
        cut = argv.index("--")
        argv, trailing = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m harness.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", help=f"figures to draw, or 'all' (the paper's): {', '.join(FIGURES)}; "
                                                 f"also {', '.join(EXTRA_FIGURES)}")
    parser.add_argument("--results", default="results", help="results folder (default: results)")
    parser.add_argument("--run", action="store_true", help="run each figure's experiment first")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="[EXPERIMENT:]KEY=VALUE",
                        help="Hydra override forwarded to the experiments --run launches (repeatable; "
                             "EXPERIMENT: limits it to one experiment); also: -- OVERRIDE...")
    args = parser.parse_args(argv)
    names = list(FIGURES) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in ALL_NAMES]
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; choose from {', '.join(ALL_NAMES)} or all")
    overrides = args.override + trailing
    if overrides and not args.run:
        parser.error("overrides are forwarded to the experiments --run launches: add --run")
    try:
        scoped = split_overrides(overrides, {experiment_of(n) for n in ALL_NAMES})
    except ValueError as e:
        parser.error(str(e))

    errors = failed = 0
    for name in names:
        start = time.perf_counter()
        experiment = experiment_of(name)
        if args.run:
            code = run_experiment(experiment, args.results, merge_overrides(scoped[None], scoped.get(experiment, [])))
            if code == 2:  # the harness refused the command line: nothing ran, its error line is above
                print(f"error: {name}: python -m harness +experiment={experiment} refused its command line "
                      f"(exit 2, see above)", file=sys.stderr)
                errors += 1
                continue
            if code != 0:
                folder = getattr(importlib.import_module(f"harness.figures.{name}"), "SOURCE", experiment)
                print(f"[figures] warning: python -m harness +experiment={experiment} exited {code} (failed jobs in "
                      f"{args.results}/{folder}/failures.jsonl); drawing {name} from the runs that finished",
                      file=sys.stderr)
                failed += 1
        try:
            paths = importlib.import_module(f"harness.figures.{name}").draw(args.results)
        except (style.FigureError, FileNotFoundError) as e:
            missing = isinstance(e, FileNotFoundError)
            hint = f": run python -m harness +experiment={experiment}" if missing and not isinstance(
                e, style.MissingResults) else ""
            where = "" if args.results == "results" else f" --results {args.results}"
            how = f", or python -m harness.figures {name} --run{where}" if missing and not args.run else ""
            print(f"error: {name}: {_one_line(e)}{hint}{how}", file=sys.stderr)
            errors += 1
            continue
        for path in paths:
            print(f"[figures] {name}: {path}")
        print(f"[figures] {name} done in {time.perf_counter() - start:.0f} s", flush=True)
    return 2 if errors else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
