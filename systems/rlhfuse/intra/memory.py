"""Memory phase of the fused-schedule search (RLHFuse, NSDI'25, arXiv 2409.13221, section 5: "we
first minimise the latency, then, with the latency fixed, minimise the peak memory").

This module owns :class:`MemorySearch`: given a target makespan ``T`` (the makespan phase's best),
find orders whose makespan is at most ``T`` and whose largest per-rank peak of in-flight activation
memory is as low as possible. It is a simulated annealing over per-rank orders (the moves and
timing of :class:`~systems.rlhfuse.intra.incremental.OrderState`) with a **memory cap of
increasing tightness**:

- **Energy** (both terms are penalties, so energy 0 means "done at this cap"): the makespan's
  excess over ``T`` in mean action times, plus the *area above the cap*: the sum over every rank
  and list position of how far the rank's in-flight activation memory after that position exceeds
  the cap, in units of the smallest activation. The area changes only at the positions a move
  touches (O(1) for a swap), and unlike the peak itself it says how much of the profile still
  has to come down, and where. Both constraints are soft while annealing: a move may lengthen the
  schedule or raise memory for a while if it opens a way down.
- **Ladder**: whenever the energy reaches 0 the state is a schedule with makespan <= ``T`` and
  peak <= cap: it is recorded, and the cap drops to its peak minus half the smallest activation,
  so the search always works on the next level down.
- **Moves** (each keeps micro-batches first-in first-out per pipe and stage, so no move merely
  relabels micro-batches): *memory-targeted* ones pick a position where a rank is over the cap and
  lower it, by swapping the action there with a following one that holds less memory, by moving
  the nearest earlier forward to a later position, or by moving the next backward earlier;
  *critical-path* swaps (the ends of the blocks of a critical path, as in the makespan phase)
  while the makespan is above ``T``; and uniform swaps and short moves everywhere.
- **Acceptance**: Metropolis on the energy; the uniform number is drawn first, so the memory term
  (known before any timing) either rules the move out at once or leaves a makespan threshold
  that the re-timing aborts at.
- **Starting points**: :meth:`MemorySearch.run` starts from any order, feasible or not: the
  makespan phase's best (makespan ``T``, memory high: the ladder walks its peak down) or a
  low-memory order such as a memory-capped greedy schedule (memory low, makespan above ``T``: the
  annealing first pulls its makespan down under that cap). Runs share the best peak found so far,
  so a later run never works on a cap above it.

All randomness comes from the ``random.Random`` passed in, and budgets are counted in trial moves,
so a run is a pure function of its inputs.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from harness.schedule import SimModel
from systems.rlhfuse.intra.incremental import ABORTED, OrderState

_EPS = 1e-9
MAX_DRAWS = 256  # proposals drawn per step before the step is counted as an empty one


@dataclass
class MemoryParams:
    t0: float = 2.0         # start temperature (energy units: one mean action time / activation)
    t1: float = 0.02        # final temperature
    q_memory: float = 0.5   # share of memory-targeted proposals while some rank is over the cap
    q_critical: float = 0.25  # share of critical-path swaps while the makespan is above target
    q_move: float = 0.8     # share of moves (vs adjacent swaps) among memory-targeted and uniform
    max_shift: int = 8      # longest distance a move carries an action
    cap_step: float = 0.5   # next cap = best peak - cap_step * smallest activation
    rung_steps: int = 10_000  # cooling from t0 to t1 restarts at every new level (and after this)


@dataclass
class MemoryOutcome:
    seqs: list[list[int]] | None  # best order found with makespan <= target (None: none)
    peak: float                   # its peak (inf when none)
    makespan: float
    steps: int
    levels: int                   # how many times the cap was lowered


class MemorySearch:
    """The memory phase (module docstring). One instance per (model, target); :meth:`run` may be
    called several times from different starting orders, sharing the best peak found."""

    def __init__(self, model: SimModel, tails: list[float], target: float, mem_cap: float | None,
                 rng: random.Random, params: MemoryParams | None = None):
        self.model, self.tails, self.target, self.mem_cap = model, tails, target, mem_cap
        self.target_tol = target + _EPS * max(1.0, abs(target))  # timing passes differ in the last bits
        self.rng = rng
        self.p = params or MemoryParams()
        self.unit = min((d for d in model.mem_delta if d > 0), default=1.0)
        self.mean_dur = sum(model.dur) / max(len(model.dur), 1) or 1.0
        # class of an action: (pipe, kind); two actions of one class never trade places
        names = {}
        self.cls = [names.setdefault((a.pipe, a.kind), len(names)) for a in model.actions]
        self.best_peak = math.inf
        self.best_seqs: list[list[int]] | None = None
        self.best_makespan = math.inf
        self.floor = max(max(model.mem_delta, default=0.0), 0.0)
        self.levels_total = 0  # times the best peak was lowered, over all runs

    # ---- cap bookkeeping ---------------------------------------------------------------------
    def _set_cap(self, cap: float) -> None:
        self.cap = cap
        self.over: list[tuple[int, int]] = []
        self.over_at: dict[tuple[int, int], int] = {}
        area = 0.0
        for r, pm in enumerate(self.state.prefix):
            for k, val in enumerate(pm):
                if val > cap + _EPS:
                    area += val - cap
                    self.over_at[(r, k)] = len(self.over)
                    self.over.append((r, k))
        self.area = area

    def _mark(self, r: int, k: int, val: float) -> None:
        key = (r, k)
        if val > self.cap + _EPS:
            if key not in self.over_at:
                self.over_at[key] = len(self.over)
                self.over.append(key)
        elif key in self.over_at:
            j = self.over_at.pop(key)
            last = self.over.pop()
            if j < len(self.over):
                self.over[j] = last
                self.over_at[last] = j

    def _energy(self, makespan: float, area: float) -> float:
        return max(0.0, makespan - self.target) / self.mean_dur + area / self.unit

    # ---- proposals -----------------------------------------------------------------------------
    def _fifo_ok(self, seq: list[int], i: int, j: int) -> bool:
        """Does moving ``seq[i]`` to position ``j`` keep it behind / ahead of its own class?"""
        c, cls = self.cls[seq[i]], self.cls
        rng_ = range(i + 1, j + 1) if j > i else range(j, i)
        return all(cls[seq[k]] != c for k in rng_)

    def _memory_proposal(self):
        """A trial that lowers the profile at a position over the cap: ('swap', r, i) or
        ('move', r, i, j), or None."""
        rng, seqs, delta = self.rng, self.state.seqs, self.model.mem_delta
        r, k = self.over[rng.randrange(len(self.over))]
        seq = seqs[r]
        n = len(seq)
        if rng.random() >= self.p.q_move:
            if k + 1 < n and delta[seq[k + 1]] < delta[seq[k]]:
                return ("swap", r, k)
            return None
        if rng.random() < 0.5:  # the nearest forward at or before k, later
            f = k
            while f >= 0 and delta[seq[f]] <= 0:
                f -= 1
            if f < 0:
                return None
            j = min(n - 1, k + 1 + rng.randrange(self.p.max_shift))
            if j <= f or not self._fifo_ok(seq, f, j):
                return None
            return ("move", r, f, j)
        b = k + 1  # the next backward after k, earlier
        while b < n and delta[seq[b]] >= 0:
            b += 1
        if b >= n:
            return None
        j = max(0, k - rng.randrange(self.p.max_shift))
        if not self._fifo_ok(seq, b, j):
            return None
        return ("move", r, b, j)

    def _uniform_proposal(self):
        rng, seqs, cls = self.rng, self.state.seqs, self.cls
        r = self.ranks[rng.randrange(len(self.ranks))]
        seq = seqs[r]
        n = len(seq)
        if rng.random() < self.p.q_move:
            i = rng.randrange(n)
            shift = 1 + rng.randrange(self.p.max_shift)
            j = i + shift if rng.random() < 0.5 else i - shift
            if j < 0 or j >= n or not self._fifo_ok(seq, i, j):
                return None
            return ("move", r, i, j)
        i = rng.randrange(n - 1)
        if cls[seq[i]] == cls[seq[i + 1]]:
            return None
        return ("swap", r, i)

    def _critical_proposal(self):
        if self.crit is None:
            self.crit = self.state.critical_swaps(self.rng)
        if not self.crit:
            return None
        r, i = self.crit[self.rng.randrange(len(self.crit))]
        seq = self.state.seqs[r]
        if self.cls[seq[i]] == self.cls[seq[i + 1]]:
            return None
        return ("swap", r, i)

    def _propose(self):
        rng, p = self.rng, self.p
        x = rng.random()
        if self.over and x < p.q_memory:
            return self._memory_proposal()
        if self.makespan > self.target_tol and x < p.q_memory + p.q_critical:
            return self._critical_proposal()
        return self._uniform_proposal()

    def _trial(self):
        """Draw proposals until one is timed (one step); returns ``try_*``'s result or None.
        Proposals dropped before timing (shape, class, dependency, deadlock, or a memory term
        already above the acceptance limit) are cheap and do not count as steps."""
        state = self.state
        for _ in range(MAX_DRAWS):
            prop = self._propose()
            if prop is None:
                continue
            if prop[0] == "swap":
                out = state.try_swap(prop[1], prop[2], gate=self._gate)
            else:
                out = state.try_move(prop[1], prop[2], prop[3], gate=self._gate)
            if out is not None:
                return out
        return None

    # ---- the run -----------------------------------------------------------------------------
    def _gate(self, r: int, lo: int, new_vals: list[float]):
        pm, cap = self.state.prefix[r], self.cap
        area = self.area
        for k, val in enumerate(new_vals, lo):
            old = pm[k]
            area += (val - cap if val > cap else 0.0) - (old - cap if old > cap else 0.0)
        mem_e = area / self.unit
        if mem_e > self._limit + _EPS:
            return None
        self._trial_area = area
        return self.target + (self._limit - mem_e) * self.mean_dur

    def _record(self) -> None:
        peak = self.state.max_peak()
        if peak < self.best_peak - _EPS:
            if not math.isinf(self.best_peak):  # the first record is where the phase starts
                self.levels += 1
                self.levels_total += 1
            self.best_peak, self.best_seqs = peak, self.state.snapshot()
            self.best_makespan = self.makespan
        self._set_cap(self.best_peak - self.p.cap_step * self.unit)

    def at_floor(self) -> bool:
        """Is the best peak already the trivial bound (the largest single activation)?"""
        return self.best_peak <= self.floor + _EPS

    def run(self, seqs: Sequence[Sequence[int]], steps: int | None,
            seconds: float | None = None) -> MemoryOutcome:
        """Anneal from ``seqs`` for ``steps`` trial moves and/or ``seconds`` (whichever runs out
        first; at least one must be given), or until the trivial bound is reached."""
        if steps is None and seconds is None:
            raise ValueError("the memory phase needs a step or time budget")
        deadline = None if seconds is None else time.perf_counter() + seconds
        budget = math.inf if steps is None else steps
        state = self.state = OrderState(self.model, seqs, self.mem_cap, self.tails)
        self.makespan = state.makespan()
        self.crit = None
        self.ranks = [r for r, s in enumerate(state.seqs) if len(s) > 1]
        self.levels = 0
        start_peak = state.max_peak()
        # the cap is always one step below the best peak found so far (any run, any start);
        # only the first run, with nothing found yet, starts at its own peak
        cap = start_peak if math.isinf(self.best_peak) else self.best_peak - self.p.cap_step * self.unit
        self._set_cap(cap)
        if self.makespan <= self.target_tol and self.area <= _EPS:
            self._record()
        if not self.ranks:
            return self._outcome(0)
        t0, t1 = self.p.t0, self.p.t1
        energy = self._energy(self.makespan, self.area)
        rng = self.rng
        step = 0
        self.rung_start = 0
        rung = max(1, int(self.p.rung_steps))
        while step < budget and not self.at_floor():
            if deadline is not None and step % 64 == 0 and time.perf_counter() >= deadline:
                break
            since = step - self.rung_start
            if since >= rung:  # cooled down without reaching the next level: reheat
                self.rung_start, since = step, 0
            temp = t0 * (t1 / t0) ** (since / rung)
            step += 1
            self._limit = energy - temp * math.log(1.0 - rng.random())
            out = self._trial()
            if out is None:
                continue
            makespan = out[0]
            if makespan == ABORTED:
                state.revert()
                continue
            new_energy = self._energy(makespan, self._trial_area)
            if new_energy > self._limit + _EPS:
                state.revert()
                continue
            r, lo, new_vals = state.pending_prefix()
            state.commit()
            for k, val in enumerate(new_vals, lo):
                self._mark(r, k, val)
            self.area = self._trial_area if self.over else 0.0
            self.makespan = makespan
            self.crit = None
            energy = self._energy(makespan, self.area)
            if makespan <= self.target_tol and not self.over:
                self._record()
                self.rung_start = step
                energy = self._energy(makespan, self.area)
        return self._outcome(step)

    def _outcome(self, steps: int) -> MemoryOutcome:
        return MemoryOutcome(None if self.best_seqs is None else [list(s) for s in self.best_seqs],
                             self.best_peak, self.best_makespan, steps, self.levels)
