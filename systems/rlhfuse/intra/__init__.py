"""RLHFuse intra-stage fusion (NSDI'25, arXiv 2409.13221, section 5): fused actor+critic pipeline
schedules, the two models' pipes in opposite directions filling each other's bubbles, searched by
two-phase simulated annealing (makespan, then peak memory) and reported against lower bounds.

- :mod:`.pipes` -- the fused layout, per-stage costs, the serial 1F1B baseline;
- :mod:`.greedy` -- the greedy list scheduler (the search's starting point);
- :mod:`.bounds` -- the makespan lower bound and its terms;
- :mod:`.incremental` -- re-timing of swaps and moves from where they change (agrees with ``simulate``);
- :mod:`.loop` -- the annealing loop of both objectives (a compiled kernel);
- :mod:`.memory` -- the memory phase (lower the peak with the makespan fixed);
- :mod:`.anneal` -- the two-phase simulated annealing, one or several seeds;
- :mod:`.grow` -- a long schedule's start grown from the search for fewer micro-batches;
- :mod:`.exact` -- the optional exact refinement by constraint programming (CP-SAT) and its proofs;
- :mod:`.config` -- :class:`FusedSearchConfig`, the search's options (``system.fused_search``);
- :mod:`.search` -- :func:`search_fused_schedule`, everything above end to end.
"""
import importlib

# name -> submodule, imported on first use (PEP 562): the system's config imports FusedSearchConfig
# without loading the search and its compiled kernels
_EXPORTS = {
    "fused_pipes": "pipes", "fused_costs": "pipes", "serial_schedule": "pipes", "pipe_names": "pipes",
    "model_index": "pipes", "model_labels": "pipes", "greedy_schedule": "greedy", "model_priority": "greedy",
    "LowerBound": "bounds", "lower_bound": "bounds", "lower_bound_terms": "bounds", "OrderState": "incremental",
    "MemorySearch": "memory", "MemoryParams": "memory", "MemoryOutcome": "memory", "AnnealParams": "anneal",
    "AnnealOutcome": "anneal", "anneal_orders": "anneal", "anneal_seeds": "anneal", "FusedSearchConfig": "config",
    "FusedResult": "search", "search_fused_schedule": "search",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
