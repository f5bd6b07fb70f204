"""Long-tail migration's decisions (RLHFuse section 4), written once for both executions of a plan:
the simulator's generation model (:mod:`.generation`) and ``backend=ray``'s streamed generation
(``harness/backends/ray/inter_stage.py``).

When fewer than R_t samples (``threshold``, a count from ``GenerationPolicy.migration.threshold_frac``)
are unfinished, every unfinished sample leaves the instances that do not hold the most for the
``num_tail_instances`` that do (:func:`tail_instances`), spread round-robin over them
(:func:`destination`); the released instances' devices then run inference.
"""
from __future__ import annotations

import math
from typing import Mapping


def threshold(threshold_frac: float, num_samples: int) -> int:
    """R_t as a number of samples."""
    return math.ceil(threshold_frac * num_samples)


def due(num_unfinished: int, threshold_samples: int) -> bool:
    """Whether the tail migrates now: some samples are unfinished, fewer than R_t."""
    return 0 < num_unfinished < threshold_samples


def tail_instances(unfinished: Mapping[int, int], num_tail: int) -> tuple[list[int], list[int]]:
    """(tails, sources) of instances given their unfinished counts: the ``num_tail`` holding the most
    (ties to the lower index) among those with work left, at least one; every other instance, in
    the same order, gives its unfinished samples away."""
    order = sorted(unfinished, key=lambda k: (-unfinished[k], k))
    tails = [k for k in order[:num_tail] if unfinished[k] > 0] or order[:1]
    return tails, [k for k in order if k not in tails]


def destination(tails: list[int], source: int, j: int) -> int:
    """The tail instance receiving the ``j``-th unfinished sample of instance ``source``."""
    return tails[(source + j) % len(tails)]
