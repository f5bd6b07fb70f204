"""The fused-schedule search of this tree against another copy of ``systems/rlhfuse/``, side by side
in one process, on the same instances: the same results, and the time each takes.

    python benchmarks/fuse_kernels_speed.py --before /tmp/systems_rlhfuse_before
    python benchmarks/fuse_kernels_speed.py --before OLD --reps 9 --max-steps 40000

``--before`` is a plain copy of a ``systems/rlhfuse/`` folder (e.g. ``cp -r systems/rlhfuse DIR``
before a change). It is imported as the package ``rlhfuse_before`` (a copy with its imports of
``systems.rlhfuse`` renamed, kept under the temporary folder so that its compiled kernels stay cached
between runs), beside this tree's ``systems.rlhfuse``. Both searches are compiled by a small warm-up
search first. Then, per instance (fused layouts of the paper's Table 3 shapes), ``--reps`` searches
by each, interleaved (old, new, new, old, ...) so that a load that comes and goes on a shared machine
falls on both alike, each timed by this process's CPU clock and by the wall clock. Prints per
instance the median of each and the ratio new / old (below 1: the new search is faster), and the
median ratio over the instances. Every pair of results must be the same (the schedule, its
makespan and peak, the steps): the command exits with status 1 where one differs.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from systems.rlhfuse.intra import fused_costs, fused_pipes  # noqa: E402 (after the path)

OLD_PACKAGE = "rlhfuse_before"
# (actor stages, critic stages, micro-batches per pipe): Table 3's shapes at 16 micro-batches, one at 32
INSTANCES = ((8, 4, 16), (8, 8, 16), (16, 8, 16), (8, 4, 32))


def importable_copy(before: Path) -> Path:
    """A copy of ``before`` whose imports of ``systems.rlhfuse`` name :data:`OLD_PACKAGE`, under the
    temporary folder; a file is written only when its text changes (numba's cache keys on it)."""
    key = hashlib.sha1(str(before.resolve()).encode()).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / "fuse_kernels_speed" / key
    for src in before.rglob("*.py"):
        dst = root / OLD_PACKAGE / src.relative_to(before)
        text = src.read_text().replace("systems.rlhfuse", OLD_PACKAGE)
        if not dst.is_file() or dst.read_text() != text:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
    return root


def searches(before: Path):
    """(old search, old config class), (new search, new config class)."""
    sys.path.insert(0, str(importable_copy(before)))
    out = []
    for package in (OLD_PACKAGE, "systems.rlhfuse"):
        search = importlib.import_module(f"{package}.intra.search")
        config = importlib.import_module(f"{package}.intra.config")
        out.append((search.search_fused_schedule, config.FusedSearchConfig))
    return out


def instance(n1: int, n2: int, m: int):
    pipes = fused_pipes(n1, n2, m, m)
    return pipes, fused_costs(pipes, 1.0, 0.45, mem1=1.0, mem2=0.5, p2p=0.02)


def timed(search, config_class, pipes, costs, max_steps: int):
    cpu, wall = time.process_time(), time.perf_counter()
    result = search(pipes, costs, None, config_class(seed=0, max_steps=max_steps))
    return time.process_time() - cpu, time.perf_counter() - wall, result


def same(a, b) -> bool:
    return (a.schedule.order == b.schedule.order and (a.makespan, a.peak_memory, a.steps, a.steps_memory)
            == (b.makespan, b.peak_memory, b.steps, b.steps_memory))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a copy of another tree's systems/rlhfuse/")
    p.add_argument("--reps", type=int, default=5, help="searches by each per instance (default 5)")
    p.add_argument("--max-steps", type=int, default=20_000, help="steps per seed (default 20000: a run's)")
    args = p.parse_args()
    if not (args.before / "intra" / "search.py").is_file():
        p.error(f"--before {args.before}: no intra/search.py there (a copy of systems/rlhfuse/ expected)")
    (old, old_config), (new, new_config) = searches(args.before)
    warm_pipes, warm_costs = instance(4, 2, 4)
    for search, config_class in ((old, old_config), (new, new_config)):
        timed(search, config_class, warm_pipes, warm_costs, 500)  # compiles (or loads) the kernels
    print(f"# {args.reps} searches by each per instance, {args.max_steps} steps per seed, interleaved; medians")
    print(f"{'stages':>7}{'M':>4}{'actions':>9}{'old cpu s':>11}{'new cpu s':>11}{'new/old':>9}"
          f"{'old wall s':>12}{'new wall s':>12}{'new/old':>9}  results")
    ratios, differ = [], 0
    for n1, n2, m in INSTANCES:
        pipes, costs = instance(n1, n2, m)
        times = {"old": [], "new": []}
        results = {}
        for rep in range(args.reps):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                search, config_class = (old, old_config) if name == "old" else (new, new_config)
                cpu, wall, results[name, rep] = timed(search, config_class, pipes, costs, args.max_steps)
                times[name].append((cpu, wall))
        equal = all(same(results["old", rep], results["new", rep]) for rep in range(args.reps))
        differ += not equal
        (old_cpu, old_wall), (new_cpu, new_wall) = (
            [statistics.median(t[k] for t in times[name]) for k in (0, 1)] for name in ("old", "new"))
        ratios.append(new_cpu / old_cpu)
        actions = sum(2 * pipe.num_stages * pipe.num_mbs for pipe in pipes.values())
        print(f"{n1:>4}/{n2:<2}{m:>4}{actions:>9}{old_cpu:>11.3f}{new_cpu:>11.3f}{new_cpu / old_cpu:>9.3f}"
              f"{old_wall:>12.3f}{new_wall:>12.3f}{new_wall / old_wall:>9.3f}  {'same' if equal else 'DIFFER'}",
              flush=True)
    print(f"# new / old CPU time, median over instances: {statistics.median(ratios):.3f}; "
          f"results {'the same on every instance' if not differ else f'differ on {differ} instance(s)'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
