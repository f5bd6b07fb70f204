"""One run, measured and recorded: compose -> plan -> check -> simulate or execute -> record.

:mod:`.runner` runs a composed config on a backend; :mod:`.metrics` turns StepTraces into the
numbers a run reports; :mod:`.results` owns the results tree and its loader; :mod:`.loggers` (W&B),
:mod:`.provenance` (what produced the numbers) and :mod:`.progress` (planning phases on stderr).

May import every package below it (core, costmodel, system, planning, backends, checks); only the
command-line tools (:mod:`harness.cli`), the figures and :mod:`harness.testing` import it.
"""
