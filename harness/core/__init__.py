"""The core IR: what a run is made of, as data.

Typed configs (:mod:`.config`, with the rule for options without effect in :mod:`.option_effects`),
the engines a plan runs on (:mod:`.engines`), the plan a system returns (:mod:`.plan`), the
execution units a backend runs it as (:mod:`.units`), the StepTrace a backend reports
(:mod:`.trace`), iteration inputs (:mod:`.workload`) and what a path on disk is (:mod:`.files`).

May import: :mod:`harness.errors`, :mod:`harness.compiled` and :mod:`harness.schedule` (the
pipeline-schedule IR a plan embeds). Nothing here plans, simulates or runs.
"""
