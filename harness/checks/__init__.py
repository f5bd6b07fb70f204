"""Checks of input before any work starts: one clear error, nothing written.

- :mod:`.command_line`: what ``python -m harness <argv>`` composes (unknown keys, values Hydra
  cannot read, batch sizes, files the options name), for a run and for every sweep job;
- :mod:`.consistency`: the physical and logical consistency of a composed run (ranges, layouts
  against the cluster, input files, output paths).

May import everything below it: :mod:`harness.core`, :mod:`harness.costmodel`,
:mod:`harness.system`, :mod:`harness.planning` and :mod:`harness.backends` (their config schemas).
"""
