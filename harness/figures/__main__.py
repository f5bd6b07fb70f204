"""``python -m harness.figures <name>|all [--results DIR] [--run]``: draw paper figures from results/.

With ``--run`` the experiment behind each figure is run first (``python -m harness
+experiment=<name>``; finished runs are skipped, so re-running is cheap).
"""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time

from harness.figures import EXTRA_FIGURES, FIGURES


def run_experiment(name: str, results_dir: str) -> None:
    cmd = [sys.executable, "-m", "harness", f"+experiment={name}", f"results_dir={results_dir}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", help=f"figures to draw, or 'all' (the paper's): {', '.join(FIGURES)}; "
                                                 f"also {', '.join(EXTRA_FIGURES)}")
    parser.add_argument("--results", default="results")
    parser.add_argument("--run", action="store_true", help="run each figure's experiment first")
    args = parser.parse_args()
    names = list(FIGURES) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in FIGURES + EXTRA_FIGURES]
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; choose from {', '.join(FIGURES + EXTRA_FIGURES)} or all")
    for name in names:
        start = time.perf_counter()
        if args.run and name != "fig8_breakdown":  # fig8 reads fig7's runs
            run_experiment("fig7_throughput" if name == "fig8_breakdown" else name, args.results)
        module = importlib.import_module(f"harness.figures.{name}")
        for path in module.draw(args.results):
            print(f"[figures] {name}: {path}")
        print(f"[figures] {name} done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
