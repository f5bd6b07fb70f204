"""The fused-schedule search's options as one typed config (RLHFuse section 5):
:class:`FusedSearchConfig`, what :func:`systems.rlhfuse.intra.search_fused_schedule` takes and an
RLHFuse run holds as ``system.fused_search``. :meth:`~FusedSearchConfig.check` refuses a value out
of range before any search starts.

This module is the one home of every search option's default: the class's fields and the
constants below. Everything else that offers an option reads its default here: the run's config
(``RLHFuseConfig.fused_search``, with :data:`PLANNING_MAX_STEPS`; ``conf/system/rlhfuse.yaml``
sets none of these options), the command line of ``python -m systems.rlhfuse.fuse``, the search's
internal parameters (``anneal.AnnealParams``, ``memory.MemoryParams``) and the benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

DEFAULT_MAX_STEPS = 100_000  # per seed, when neither a step nor a time budget is given
PLANNING_MAX_STEPS = 20_000  # per seed, an RLHFuse run's planner (deterministic; seconds per plan)
DEFAULT_MEMORY_MOVE_REACH = 8  # longest shift of a memory-phase move (docs/FUSED_SEARCH.md measures 64)
DEFAULT_MEMORY_CAP_STEPS = (0.005, 0.1)  # cap below the best peak in smallest activations, by seed ("The cap step")
DEFAULT_MEMORY_MAKESPAN_WEIGHTS = (8.0, 8.0)  # energy per mean action time over the target, by seed
DEFAULT_GROW_MAKESPAN_WEIGHTS = (8.0, 1.0)  # the same for the search of half, whose order is grown


@dataclass
class FusedSearchConfig:
    seed: int = 0  # seeds seed, seed + 1, ...; seed + k anneals from the k-th best start
    max_steps: Optional[int] = None  # trial moves per seed; None: DEFAULT_MAX_STEPS unless time_limit_s
    time_limit_s: Optional[float] = None  # wall clock per seed, whichever budget ends first (not deterministic)
    num_workers: int = 1  # seeds annealed at once, one process each
    num_seeds: Optional[int] = None  # None: num_workers
    memory_phase: bool = True  # after the makespan phase, lower the peak at that makespan
    memory_move_reach: int = DEFAULT_MEMORY_MOVE_REACH
    memory_cap_steps: List[float] = field(default_factory=lambda: list(DEFAULT_MEMORY_CAP_STEPS))  # seed+k: k mod n
    memory_makespan_weights: List[float] = field(default_factory=lambda: list(DEFAULT_MEMORY_MAKESPAN_WEIGHTS))  # same
    makespan_slack_frac: float = 0.0  # the memory phase may return up to this much longer (0: never)
    exact_effort: float = 0.0  # CP-SAT refinement's deterministic-time budget (0: off)
    exact_workers: int = 2  # its portfolio's threads (an input, like the seeds)
    exact_max_microbatches: int = 0  # refine only where no pipe has more micro-batches (0: any)
    grow_min_microbatches: int = 64  # every pipe has this many: seed 0 may start grown from half as many (0: never)
    grow_makespan_weights: List[float] = field(default_factory=lambda: list(DEFAULT_GROW_MAKESPAN_WEIGHTS))  # its search's

    def check(self) -> None:
        """ValueError naming the first option out of range."""
        for name in ("max_steps", "num_seeds", "grow_min_microbatches", "exact_max_microbatches"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value}")
        for name in ("time_limit_s", "exact_effort", "makespan_slack_frac"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name in ("memory_cap_steps", "memory_makespan_weights", "grow_makespan_weights"):
            if not (values := list(getattr(self, name))) or not all(0 < s < float("inf") for s in values):
                raise ValueError(f"{name} must be one or more numbers > 0, got {values}")
        for name in ("num_workers", "exact_workers", "memory_move_reach"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value}")

    @property
    def step_budget(self) -> Optional[int]:
        """Trial moves per seed: ``max_steps``, or ``DEFAULT_MAX_STEPS`` when no budget is given."""
        if self.max_steps is None and self.time_limit_s is None:
            return DEFAULT_MAX_STEPS
        return self.max_steps

    @property
    def seeds(self) -> list[int]:
        return [self.seed + k for k in range(self.num_seeds or max(1, self.num_workers))]
