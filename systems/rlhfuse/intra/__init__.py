"""RLHFuse intra-stage fusion (NSDI'25, arXiv 2409.13221, section 5): fused actor+critic pipeline
schedules. Model-1 and model-2 pipes run in opposite directions over ``lcm(N1, N2)`` ranks so that
each fills the other's pipeline bubbles; a greedy list schedule (larger model first) is refined by
two-phase simulated annealing (makespan first, then, with the makespan fixed, peak activation
memory under a tightening cap), and reported against a lower bound and the serial 1F1B baseline.

- :mod:`.pipes` -- the fused layout, per-stage costs, the serial 1F1B baseline;
- :mod:`.greedy` -- the greedy list scheduler (the search's starting point);
- :mod:`.bounds` -- the makespan lower bound and its terms;
- :mod:`.incremental` -- re-timing of swaps and moves from where they change (agrees with ``simulate``);
- :mod:`.memory` -- the memory phase (lower the peak with the makespan fixed);
- :mod:`.anneal` -- the two-phase simulated annealing, one or several seeds;
- :mod:`.exact` -- the optional exact refinement by constraint programming (CP-SAT) and its proofs;
- :mod:`.search` -- :func:`search_fused_schedule`, everything above end to end.
"""
from systems.rlhfuse.intra.anneal import AnnealOutcome, AnnealParams, anneal_orders, anneal_seeds
from systems.rlhfuse.intra.bounds import LowerBound, lower_bound, lower_bound_terms
from systems.rlhfuse.intra.greedy import greedy_schedule, model_priority
from systems.rlhfuse.intra.incremental import OrderState
from systems.rlhfuse.intra.memory import MemoryOutcome, MemoryParams, MemorySearch
from systems.rlhfuse.intra.pipes import (fused_costs, fused_pipes, model_index, model_labels,
                                         pipe_names, serial_schedule)
from systems.rlhfuse.intra.search import FusedResult, search_fused_schedule

__all__ = [
    "fused_pipes", "fused_costs", "serial_schedule", "pipe_names", "model_index", "model_labels",
    "greedy_schedule", "model_priority",
    "LowerBound", "lower_bound", "lower_bound_terms",
    "OrderState", "MemorySearch", "MemoryParams", "MemoryOutcome",
    "AnnealParams", "AnnealOutcome", "anneal_orders", "anneal_seeds",
    "FusedResult", "search_fused_schedule",
]
