"""Paper-figure reproduction (RLHFuse, NSDI'25, section 7): one module per figure or table.

Each module has ``EXPERIMENT`` (the ``conf/experiment/`` config whose runs it reads) and
``draw(results_root) -> list[Path]``; it reads results only through :mod:`harness.run.results` and
writes ``results/figures/<name>.png`` and ``.pdf`` with the shared style of :mod:`.style` (one
seaborn theme, fixed system order and colours, units on every axis). Where the paper states a range
it is drawn as a shaded band labelled "paper", a point as a dashed line, a bound as a note. Missing
results raise :class:`.style.MissingResults` naming the experiment to run.
``python -m harness.figures <name>...|all [--results DIR] [--run [-o [EXPERIMENT:]KEY=VALUE]...]``
draws (and with ``--run`` first runs the experiments, with the ``-o`` Hydra overrides; see
:mod:`.__main__`); ``all`` is the paper's figures, ``EXTRA_FIGURES`` are drawn by name.
"""
FIGURES = ("fig2_lengths", "fig7_throughput", "fig8_breakdown", "fig9_migration", "table3_schedules",
           "fig10_schedule")
# Figures of the harness itself, not of the paper (not part of ``all``): real PPO learning curves
# (docs/LEARNING.md; needs Ray); throughput against staleness and GPU utilisation through a step on the
# long reasoning workload (docs/ASYNC.md; one experiment makes both).
EXTRA_FIGURES = ("learning_curves", "async_tradeoff", "async_utilisation")
