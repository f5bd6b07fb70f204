"""One run, measured and recorded: compose -> plan -> check -> simulate or execute -> record.

:mod:`.pipeline` is the one way from overrides to numbers (compose, prepare, plan, iterate,
execute), used by every tool; :mod:`.runner` writes a run's folder and prints its summary;
:mod:`.results` owns the results tree and its loader; :mod:`.loggers` (W&B), :mod:`.provenance`
(what produced the numbers) and :mod:`.progress` (planning phases on stderr).

May import every package below it (core, costmodel, system, planning, backends, checks); only the
command-line tools (:mod:`harness.cli`), the figures, :mod:`harness.testing` and scripts import it.
"""
