"""RLHF stage-fusion benchmarking harness: configs, plan IR, cost model, backends, measurement.

Systems (``systems/``, ``baselines/``) decide and return a :class:`harness.core.plan.Plan`; backends
execute it and return a :class:`harness.core.trace.StepTrace`; the harness measures. See DESIGN.md.
"""
__version__ = "0.1.0"
