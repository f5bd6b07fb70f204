"""A start for a long fused schedule grown from the search's order for fewer micro-batches (RLHFuse,
NSDI'25, arXiv 2409.13221, section 5; why and how well: docs/FUSED_SEARCH.md, "Grown from half").
Micro-batches run first-in first-out per class (pipe, kind, stage), so a rank's order is its
sequence of classes; :func:`grow_order` repeats on every rank a segment holding the same share of
each class's growth. A balanced segment frees what it holds: the grown order has the short order's peak.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from harness.schedule import SimModel


def _splits(labels: list[tuple], num_mbs: dict, copies: int) -> list[tuple[int, int]]:
    """One rank's segments ``(i, j)`` holding ``1 / copies`` of each class's growth (classes ``labels``)."""
    kinds, held = sorted(set(labels)), Counter()
    counts = [tuple(0 for _ in kinds)]
    for label in labels:
        held[label] += 1
        counts.append(tuple(held[k] for k in kinds))
    seg = [(num_mbs[k[0]] - held[k]) // copies for k in kinds]
    at = {c: j for j, c in reversed(list(enumerate(counts)))}  # first position with these counts
    return [(i, at[goal]) for i in range(len(labels)) if (goal := tuple(x + y for x, y in zip(counts[i], seg))) in at]


def grow_order(small: SimModel, seqs: Sequence[Sequence[int]], large: SimModel) -> list[list[int]] | None:
    """``seqs`` (an order of ``small``) grown to ``large`` (the same pipes, more micro-batches): over the
    numbers of copies dividing every pipe's growth and the segments nearest 5%, ..., 95% of the
    makespan, the shortest order (first found on ties); None if none works or every one deadlocks."""
    num_mbs = {name: slot[3] for name, slot in large.pipe_slots.items()}
    growth = math.gcd(*(num_mbs[name] - slot[3] for name, slot in small.pipe_slots.items()))
    labels = [[(x.pipe, x.kind, x.stage) for x in map(small.actions.__getitem__, seq)] for seq in seqs]
    index = {(x.pipe, x.kind, x.stage, x.mb): a for a, x in enumerate(large.actions)}
    end, starts, *_ = small.run(seqs, want_start=True)
    best, best_makespan = None, math.inf
    for copies in (c for c in range(1, growth + 1) if growth % c == 0):
        splits = [_splits(row, num_mbs, copies) for row in labels]  # the same for every cut
        if not all(splits):
            continue
        for t_cut in (pct / 100 * max(end) for pct in range(5, 100, 5)):
            cuts = [min((abs(starts[seq[i]] - t_cut), i, j) for i, j in pairs) for seq, pairs in zip(seqs, splits)]
            rows = [row[:i] + row[i:j] * (1 + copies) + row[j:] for row, (_, i, j) in zip(labels, cuts)]
            grown = [[index[(*label, mb)] for label, mb in _numbered(row)] for row in rows]
            _, _, clock, _, done = large.run(grown)
            if all(d == len(s) for d, s in zip(done, grown)) and max(clock) < best_makespan:
                best, best_makespan = grown, max(clock)
    return best


def _numbered(labels: list[tuple]):  # each class with its micro-batch: the k-th of a class runs micro-batch k
    seen = Counter()
    for label in labels:
        yield label, seen[label]
        seen[label] += 1
