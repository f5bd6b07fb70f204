"""Timed list scheduling of pipeline schedules (docs/DESIGN.md sections 3 and 4).

This module owns the one timing model that the planner, the simulated backend and the RLHFuse
schedule search (NSDI'25, arXiv 2409.13221, section 5: simulated annealing over fused actor/critic
schedules) all score with. Rules:

- each rank runs its compute actions strictly in list order; send/recv actions of a lowered
  schedule are skipped, their cost is ``PipeCosts.p2p`` added to every dependency edge whose two
  ends sit on different ranks;
- an action starts at ``max(end of the rank's previous action, end of each dependency (+ p2p if
  cross-rank))`` with ``F(s, m) <- F(s-1, m)`` and ``B(s, m) <- F(s, m), B(s+1, m)``; it lasts
  ``fwd[stage]`` or ``bwd[stage]``;
- memory: ``F`` adds ``activation[stage]`` when it starts, the matching ``B`` frees it when it
  ends; forward-only pipes hold theirs to the end. Because a rank's actions never overlap, the
  running sum in list order gives the peak exactly.

Speed: the search calls this tens of thousands of times a minute, so the schedule is encoded once
into flat integer arrays (actions numbered per pipe / kind / stage / micro-batch, per-action
dependency, duration and latency arrays cached per (pipes, costs)), and the run is a worklist over
ranks: a blocked rank registers on the one action it waits for and is woken when that action
finishes, so the whole pass is O(number of actions); it is compiled with numba
(:mod:`harness.schedule.kernel`). ``SimModel`` exposes the encoded form for callers (the
annealer) that want to skip re-encoding.
"""
from __future__ import annotations

import copy
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain

import numpy as np

from harness.schedule.ir import Action, PipeCosts, PipeSpec, Schedule
from harness.schedule.lower import strip_comm
from harness.schedule.checks import ScheduleError, deadlock_report, find_deadlock, format_error


@dataclass
class SimResult:
    makespan: float
    busy: dict[int, float]
    idle: dict[int, float]
    peak_memory: dict[int, float]
    start: dict[Action, float] = field(default_factory=dict)
    end: dict[Action, float] = field(default_factory=dict)

    @property
    def bubble_frac(self) -> float:
        """Share of rank-time spent idle: ``1 - sum(busy) / (num_ranks * makespan)``."""
        if not self.busy or self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)

    @property
    def max_peak_memory(self) -> float:
        return max(self.peak_memory.values(), default=0.0)


# SimModel.run's tiering (as a JIT tiers up): schedules are timed by the Python pass until this
# process has timed this many actions with it, then by the compiled kernel. The kernel's first
# call costs about 0.3 s (numba's start-up and its on-disk cache), what the Python pass spends on
# roughly this many actions, so no process pays more than about twice the cheaper of the two
# (the ski-rental bound): a planner that times a few small schedules never starts numba, the
# 4,096-GPU planners switch early, and a process that has run another kernel (RLHFuse's fused
# search) switches at once.
COMPILE_AFTER_ACTIONS = 300_000
_python_actions_timed = 0


def compiled_kernels_warm() -> bool:
    """Has this process run a compiled kernel already? (``harness.compiled`` imports numba, so it
    is only asked if something imported it.) The tiering of every interpreted-then-compiled pass
    reads it (this module's, ``harness.planning.taskmodels.generation.step_schedule``)."""
    compiled = sys.modules.get("harness.compiled")
    return compiled is not None and compiled.warm()


class _EncodeError(Exception):
    """Internal: an action the encoder cannot place (unknown pipe, out of range, W, misplaced)."""


class _Structure:
    """The cost-free part of a :class:`SimModel`: action numbering, placement and dependencies of
    a tuple of pipes. Cached per pipes (:func:`_structure`), so that re-costing the same schedule
    (a planner scoring one layout under many sequence lengths) only rebuilds the cost arrays."""

    def __init__(self, pipes: Sequence[PipeSpec]):
        self.pipes = tuple(pipes)
        self.pipe_slots: dict[str, tuple[int, int, int, int, tuple[int, ...]]] = {}
        self._actions: list[Action] | None = None
        home, dep_a, dep_b = [], [], []  # dep_a: F: previous stage's F; B: own F. dep_b: B: next stage's B
        num_ids = 0
        for pipe in pipes:
            S, M, ranks = pipe.num_stages, pipe.num_mbs, pipe.stage_to_rank
            f_base, b_base = num_ids, num_ids + S * M
            self.pipe_slots[pipe.name] = (f_base, b_base, S, M, ranks)
            num_ids += 2 * S * M
            stage_home = np.repeat(np.asarray(ranks[:S], dtype=np.int64), M)
            fwd_ids = np.arange(f_base, b_base, dtype=np.int64)
            none = np.full(S * M, -1, dtype=np.int64)
            # F(s, m) <- F(s - 1, m); B(s, m) <- F(s, m), B(s + 1, m)
            f_dep = np.concatenate([none[:M], fwd_ids[:-M] if S > 1 else none[:0]])
            b_dep = np.concatenate([fwd_ids[M:] + S * M if S > 1 else none[:0], none[:M]])
            home += [stage_home, stage_home]
            dep_a += [f_dep, fwd_ids]
            dep_b += [none, b_dep]
        home_np, dep_a_np, dep_b_np = (np.concatenate(x) if x else np.zeros(0, dtype=np.int64)
                                       for x in (home, dep_a, dep_b))
        self.home: list[int] = home_np.tolist()
        self.dep_a: list[int] = dep_a_np.tolist()
        self.dep_b: list[int] = dep_b_np.tolist()
        # per action: does each dependency cross ranks (and so pay the pipe's p2p latency)?
        self.cross_a = (dep_a_np >= 0) & (home_np[np.maximum(dep_a_np, 0)] != home_np)
        self.cross_b = (dep_b_np >= 0) & (home_np[np.maximum(dep_b_np, 0)] != home_np)
        self._dep_arrays = (dep_a_np, dep_b_np)

    @property
    def dep_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``dep_a`` and ``dep_b`` as int64 arrays, shared by every model of these pipes."""
        return self._dep_arrays

    @property
    def actions(self) -> list[Action]:
        """The action of every id; made on first use (timing alone never needs them)."""
        if self._actions is None:
            self._actions = [a for pipe in self.pipes for a in _pipe_actions(pipe.name, pipe.num_stages, pipe.num_mbs)]
        return self._actions


@lru_cache(maxsize=1024)
def _pipe_actions(name: str, num_stages: int, num_mbs: int) -> tuple[Action, ...]:
    """One pipe's actions in id order (forwards, then backwards; stage-major), shared by every
    structure with that pipe: planners rebuild structures for the same pipes on new placements."""
    return tuple(Action(name, s, kind, mb) for kind in ("F", "B") for s in range(num_stages) for mb in range(num_mbs))


@lru_cache(maxsize=64)
def _structure(pipes: tuple[PipeSpec, ...]) -> _Structure:
    return _Structure(pipes)


class SimModel:
    """Flat-array form of (pipes, costs). Action ids: pipe ``p`` owns ``2 * S * M`` consecutive ids,
    forwards first (``f_base + stage * M + mb``), then backwards (``b_base + stage * M + mb``).
    The structure lists (``actions``, ``home``, ``dep_a``, ``dep_b``, ``pipe_slots``) are shared
    between models of the same pipes: callers must not modify them."""

    def __init__(self, pipes: Sequence[PipeSpec], costs: Sequence[PipeCosts]):
        pipes = tuple(pipes)
        self.pipes = {p.name: p for p in pipes}
        st = self._structure = _structure(pipes)
        self.pipe_slots, self.home = st.pipe_slots, st.home
        self.dep_a, self.dep_b = st.dep_a, st.dep_b
        # per action id, built as arrays (the compiled pass reads them); the list forms are made
        # on first read (:attr:`dur`, ...) for the interpreted pass and the searches
        dur, mem_delta, lat_a, lat_b = [], [], [], []
        for pipe, cost in zip(pipes, costs):
            S, M = pipe.num_stages, pipe.num_mbs
            if min(len(cost.fwd), len(cost.bwd), len(cost.activation)) < S:
                raise ValueError(f"pipe {pipe.name}: costs cover fewer than its {S} stages")
            if min(*cost.fwd[:S], *cost.bwd[:S], cost.p2p) < 0:
                raise ValueError(f"pipe {pipe.name}: times must be >= 0")
            fwd = np.array([float(cost.fwd[s]) for s in range(S)], dtype=np.float64)
            bwd = np.array([float(cost.bwd[s]) for s in range(S)], dtype=np.float64)
            act = np.array([float(cost.activation[s]) for s in range(S)], dtype=np.float64)
            dur += [np.repeat(fwd, M), np.repeat(bwd, M)]
            mem_delta += [np.repeat(act, M), np.repeat(-act, M)]
            f_base = st.pipe_slots[pipe.name][0]
            ids = slice(f_base, f_base + 2 * S * M)
            p2p = float(cost.p2p)
            lat_a.append(np.where(st.cross_a[ids], p2p, 0.0))
            lat_b.append(np.where(st.cross_b[ids], p2p, 0.0))
        self.num_actions = len(self.home)
        self._np: tuple[np.ndarray, ...] = (*st.dep_arrays, *(_joined(x) for x in (lat_a, lat_b, dur, mem_delta)))
        self._lists: dict[str, list[float]] = {}

    def _list(self, k: int, name: str) -> list[float]:
        out = self._lists.get(name)
        if out is None:
            out = self._lists[name] = self._np[k].tolist()
        return out

    # The per-action lists (read-only; shared with the arrays' values): durations, memory deltas
    # (F adds its stage's activation, B frees it) and each dependency's latency.
    lat_a = property(lambda self: self._list(2, "lat_a"))
    lat_b = property(lambda self: self._list(3, "lat_b"))
    dur = property(lambda self: self._list(4, "dur"))
    mem_delta = property(lambda self: self._list(5, "mem_delta"))

    @property
    def actions(self) -> list[Action]:
        return self._structure.actions

    def encode(self, actions: Sequence[Action], rank: int) -> list[int]:
        """Action ids of one rank's list, send/recv actions dropped. Raises _EncodeError."""
        slots = self.pipe_slots
        out: list[int] = []
        append = out.append
        pipe_name = None
        for a in actions:
            if a.pipe != pipe_name:  # consecutive actions mostly share a pipe
                pipe_name = a.pipe
                if pipe_name not in slots:
                    raise _EncodeError(f"{a.token()} on rank {rank}: unknown pipe {a.pipe!r}")
                f_base, b_base, S, M, ranks = slots[pipe_name]
            s, mb, kind = a.stage, a.mb, a.kind
            if not (0 <= s < S and 0 <= mb < M):
                raise _EncodeError(f"{a.token()} on rank {rank}: stage or micro-batch out of range")
            if kind == "F":
                append(f_base + s * M + mb)
            elif kind == "B":
                append(b_base + s * M + mb)
            elif kind == "W":
                raise _EncodeError(f"{a.token()} on rank {rank}: split backward is not supported")
            else:
                continue
            if ranks[s] != rank:
                raise _EncodeError(f"{a.token()} is on rank {rank} but its stage lives on rank {ranks[s]}")
        return out

    def with_times(self, dur: Sequence[float], lat_a: Sequence[float], lat_b: Sequence[float]) -> SimModel:
        """The same actions and dependencies with other durations and latencies (per action id),
        e.g. the exact refinement's integer ones; the structure lists stay shared."""
        out = copy.copy(self)
        dep_a, dep_b, _, _, _, mem_delta = self._np
        out._np = (dep_a, dep_b, *(np.asarray(x, dtype=np.float64) for x in (lat_a, lat_b, dur)), mem_delta)
        out._lists = {"mem_delta": self.mem_delta, "dur": list(dur), "lat_a": list(lat_a), "lat_b": list(lat_b)}
        return out

    def _arrays(self) -> tuple[np.ndarray, ...]:
        """The per-action arrays for :func:`~harness.schedule.kernel.list_schedule`: dependencies,
        latencies, durations, memory deltas."""
        return self._np

    def run(self, seqs: Sequence[Sequence[int]], want_start: bool = False):
        """List-schedule encoded rank sequences. Returns (end, start or None, clock, peak, pos):
        per-action end times (-1 = never ran), per-rank finish time, peak memory, and how far each
        rank got (``pos[r] < len(seqs[r])`` means deadlock). Raises _EncodeError on duplicates.

        The pass runs in Python until the process has timed :data:`COMPILE_AFTER_ACTIONS`
        actions or has run another compiled kernel, then compiled (:mod:`harness.schedule.kernel`);
        both give the same numbers, bit for bit (tested), so this only decides where the time
        goes."""
        if _interpret_next(self.num_actions):
            return self._run_interpreted(seqs, want_start)
        end, start, clock, peak, pos = self._run_compiled(_flatten(seqs))
        return (end.tolist(), start.tolist() if want_start else None, clock.tolist(), peak.tolist(),
                pos.tolist())

    def _run_compiled(self, flat_seqs: tuple[np.ndarray, np.ndarray]):
        """The compiled pass over flattened rank lists (:func:`_flatten`); arrays out."""
        flat, offsets = flat_seqs
        num_ranks = len(offsets) - 1
        end, start = np.empty(self.num_actions), np.empty(self.num_actions)
        clock, peak = np.empty(num_ranks), np.empty(num_ranks)
        pos = np.empty(num_ranks, dtype=np.int64)
        from harness.schedule import kernel

        status = kernel.list_schedule(flat, offsets, *self._arrays(), end, start, clock, peak, pos)
        if status != kernel.OK:
            raise _EncodeError(f"{self.actions[status].token()} appears more than once")
        return end, start, clock, peak, pos

    def _run_interpreted(self, seqs: Sequence[Sequence[int]], want_start: bool):
        """:meth:`run` in Python over the lists (the same pass as the kernel, same numbers)."""
        dep_a, dep_b, lat_a, lat_b = self.dep_a, self.dep_b, self.lat_a, self.lat_b
        dur, mem_delta = self.dur, self.mem_delta
        end = [-1.0] * self.num_actions
        start = [0.0] * self.num_actions if want_start else None
        num_ranks = len(seqs)
        pos, clock = [0] * num_ranks, [0.0] * num_ranks
        mem, peak = [0.0] * num_ranks, [0.0] * num_ranks
        waiter = [-1] * self.num_actions  # the rank blocked on each action (usually one)
        extra_waiters: dict[int, list[int]] = {}  # further ranks blocked on the same action
        ready = list(range(num_ranks - 1, -1, -1))
        while ready:
            r = ready.pop()
            seq, i, t, m, pk = seqs[r], pos[r], clock[r], mem[r], peak[r]
            n = len(seq)
            while i < n:
                a = seq[i]
                st = t
                d = dep_a[a]
                if d >= 0:
                    e = end[d]
                    if e < 0.0:
                        if waiter[d] < 0:
                            waiter[d] = r
                        else:
                            extra_waiters.setdefault(d, []).append(r)
                        break
                    e += lat_a[a]
                    if e > st:
                        st = e
                d = dep_b[a]
                if d >= 0:
                    e = end[d]
                    if e < 0.0:
                        if waiter[d] < 0:
                            waiter[d] = r
                        else:
                            extra_waiters.setdefault(d, []).append(r)
                        break
                    e += lat_b[a]
                    if e > st:
                        st = e
                if end[a] >= 0.0:
                    raise _EncodeError(f"{self.actions[a].token()} appears more than once")
                t = st + dur[a]
                end[a] = t
                if start is not None:
                    start[a] = st
                m += mem_delta[a]
                if m > pk:
                    pk = m
                i += 1
                if waiter[a] >= 0:
                    ready.append(waiter[a])
                    if extra_waiters and a in extra_waiters:
                        ready.extend(extra_waiters.pop(a))
            pos[r], clock[r], mem[r], peak[r] = i, t, m, pk
        return end, start, clock, peak, pos


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)


def _interpret_next(num_actions: int) -> bool:
    """Whether the next pass, over ``num_actions`` actions, runs interpreted (the tiering of
    :data:`COMPILE_AFTER_ACTIONS`); counts the actions if so."""
    global _python_actions_timed
    if _python_actions_timed < COMPILE_AFTER_ACTIONS and not compiled_kernels_warm():
        _python_actions_timed += num_actions
        return True
    return False


def _flatten(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rank lists of action ids as one array and each rank's offsets into it."""
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(seq) for seq in seqs], out=offsets[1:])
    return np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=int(offsets[-1])), offsets


@lru_cache(maxsize=64)
def _model(pipes: tuple[PipeSpec, ...], costs: tuple[PipeCosts, ...]) -> SimModel:
    return SimModel(pipes, costs)


def sim_model(schedule: Schedule, costs: Mapping[str, PipeCosts]) -> SimModel:
    """The (cached) encoded model for a schedule's pipes and their costs."""
    names = list(schedule.pipes)
    missing = [n for n in names if n not in costs]
    if missing:
        raise KeyError(f"no PipeCosts for pipe(s) {missing}")
    return _model(tuple(schedule.pipes[n] for n in names), tuple(costs[n] for n in names))


def _result(schedule: Schedule, model: SimModel, ranks: list[int], seqs: list[list[int]],
            run_out, record_times: bool) -> SimResult:
    end, start, clock, peak, _ = run_out
    dur = model.dur
    makespan = max(clock, default=0.0)
    busy = {r: float(sum(map(dur.__getitem__, seq))) for r, seq in zip(ranks, seqs)}
    result = SimResult(makespan=makespan, busy=busy,
                       idle={r: makespan - b for r, b in busy.items()},
                       peak_memory=dict(zip(ranks, peak)))
    if record_times:
        acts = model.actions
        for seq in seqs:
            for a in seq:
                result.start[acts[a]] = start[a]
                result.end[acts[a]] = end[a]
    return result


def list_order_peak_memory(schedule: Schedule, costs: Mapping[str, PipeCosts]) -> dict[int, float]:
    """Each rank's peak memory as :func:`simulate` counts it, without timing anything: a rank's
    actions never overlap, so the running sum in its list order (``F`` adds its stage's activation,
    the matching ``B`` frees it, send/recv count nothing) is the peak. The same numbers as
    ``simulate(schedule, costs).peak_memory`` for a schedule that runs; unlike it, no check that
    the schedule does (memory checks of plans use this; the timing pass checks)."""
    activation = {name: [float(a) for a in costs[name].activation] for name in schedule.pipes}
    activation_key = tuple((name, tuple(values)) for name, values in activation.items())
    # memoised on the schedule by identity first (kept alive beside the answer; schedules are not
    # changed once built): planners share their stages' schedules across candidates
    # (:func:`harness.planning.workflow.single_pipe_stage`) and check each candidate's memory
    schedule_key = (id(schedule), activation_key)
    known = _SCHEDULE_PEAKS.get(schedule_key)
    if known is not None:
        return dict(known[1])
    peaks: dict[int, float] = {}
    for rank in schedule.ranks:
        seq = schedule.order.get(rank, ())
        # memoised on the list's actions by identity (kept alive beside the answer, so an id is never
        # reused while cached): planners check the same 1F1B stages, built from shared actions, again
        # and again, and reading ids is ~50x cheaper than the running sum
        key = (np.fromiter(map(id, seq), dtype=np.uint64, count=len(seq)).tobytes(), activation_key)
        hit = _RANK_PEAKS.get(key)
        if hit is None:
            held = peak = 0.0
            for a in seq:
                if a.kind == "F":
                    held += activation[a.pipe][a.stage]
                elif a.kind == "B":
                    held += -activation[a.pipe][a.stage]
                elif a.kind == "W":
                    raise ValueError(f"{a.token()} on rank {rank}: split backward is not supported")
                else:
                    continue
                if held > peak:
                    peak = held
            if len(_RANK_PEAKS) >= RANK_PEAKS_MAX_ENTRIES:
                _RANK_PEAKS.clear()
            hit = _RANK_PEAKS[key] = (tuple(seq), peak)
        peaks[rank] = hit[1]
    if len(_SCHEDULE_PEAKS) >= RANK_PEAKS_MAX_ENTRIES:
        _SCHEDULE_PEAKS.clear()
    _SCHEDULE_PEAKS[schedule_key] = (schedule, dict(peaks))
    return peaks


# list_order_peak_memory's answers per rank: (action ids as bytes, activations) -> (the actions, peak)
RANK_PEAKS_MAX_ENTRIES = 256  # ~16 bytes an action: at most a few tens of MB
_RANK_PEAKS: dict[tuple, tuple[tuple, float]] = {}
# and per schedule: (schedule id, activations) -> (the schedule, its ranks' peaks)
_SCHEDULE_PEAKS: dict[tuple, tuple[Schedule, dict[int, float]]] = {}


def simulate_each(schedule: Schedule, costs_each: Sequence[Mapping[str, PipeCosts]],
                  record_times: bool = True) -> list[SimResult]:
    """``[simulate(schedule, costs) for costs in costs_each]``, with the rank lists encoded once
    (the numbering depends on the pipes, not the costs): a training stage's mini-batches differ
    only in their costs."""
    if not costs_each:
        return []
    models = [sim_model(schedule, costs) for costs in costs_each]
    seqs = _encoded(schedule, models[0])
    try:
        run_outs = [model.run(seqs, want_start=record_times) for model in models]
    except _EncodeError as err:
        raise ScheduleError(format_error("cannot simulate schedule", [str(err)], schedule)) from None
    for run_out in run_outs:
        _check_ran(schedule, seqs, run_out[4])
    return [_result(schedule, model, schedule.ranks, seqs, run_out, record_times)
            for model, run_out in zip(models, run_outs)]


def simulate_makespans(schedule: Schedule, costs_each: Sequence[Mapping[str, PipeCosts]]) -> list[float]:
    """``[simulate(schedule, costs, record_times=False).makespan for costs in costs_each]``, the
    same numbers with less made: the rank lists encoded and flattened once, no per-rank sums
    (planners' estimates need the makespans alone)."""
    if not costs_each:
        return []
    models = [sim_model(schedule, costs) for costs in costs_each]
    seqs = _encoded(schedule, models[0])
    flat_seqs = None
    out = []
    try:
        for model in models:
            if _interpret_next(model.num_actions):
                _, _, clock, _, pos = model._run_interpreted(seqs, False)
            else:
                flat_seqs = flat_seqs or _flatten(seqs)
                _, _, clock, _, pos = model._run_compiled(flat_seqs)
            _check_ran(schedule, seqs, pos)
            out.append(float(max(clock, default=0.0)))
    except _EncodeError as err:
        raise ScheduleError(format_error("cannot simulate schedule", [str(err)], schedule)) from None
    return out


def _encoded(schedule: Schedule, model: SimModel) -> list[list[int]]:
    empty: list[Action] = []
    try:
        return [model.encode(schedule.order.get(r, empty), r) for r in schedule.ranks]
    except _EncodeError as err:
        raise ScheduleError(format_error("cannot simulate schedule", [str(err)], schedule)) from None


def _check_ran(schedule: Schedule, seqs: list[list[int]], pos) -> None:
    """Raise ScheduleError with the deadlock's report if a rank stopped before its list's end."""
    if any(p < len(seq) for p, seq in zip(pos, seqs)):
        compute_only = strip_comm(schedule)
        stuck = find_deadlock(compute_only) or {}
        raise ScheduleError(deadlock_report(compute_only, stuck))


def simulate(schedule: Schedule, costs: Mapping[str, PipeCosts],
             record_times: bool = True) -> SimResult:
    """Time ``schedule`` under ``costs`` (pipe name -> PipeCosts). Raises ScheduleError (with the
    rank x step grid) on deadlock, duplicated, misplaced or unknown actions. Missing actions that
    nothing waits for are not an error here; ``validate`` checks completeness."""
    return simulate_each(schedule, [costs], record_times)[0]
