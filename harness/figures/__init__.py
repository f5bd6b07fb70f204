"""Paper-figure reproduction (RLHFuse, NSDI'25, section 7): one module per figure or table.

Each module has ``EXPERIMENT`` (the ``conf/experiment/`` config whose runs it reads) and
``draw(results_root) -> list[Path]``; it reads results only through :mod:`harness.results` and
writes ``results/figures/<name>.png`` and ``.pdf`` with the shared style of :mod:`.style` (fixed
system order and colours). Where the paper states a number or range, it is drawn and labelled
"paper". ``python -m harness.figures <name>|all [--run]`` draws (and with ``--run`` first runs);
``all`` is the paper's figures, ``EXTRA_FIGURES`` are drawn by name.
"""
FIGURES = ("fig2_lengths", "fig7_throughput", "fig8_breakdown", "fig9_migration", "table3_schedules",
           "fig10_schedule")
# Figures of the harness itself, not of the paper (not part of ``all``): real PPO learning curves
# (docs/LEARNING.md; needs Ray).
EXTRA_FIGURES = ("learning_curves",)
