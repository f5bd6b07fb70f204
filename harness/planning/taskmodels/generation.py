"""Simulated actor generation, token step by token step (docs/DESIGN.md section 4; RLHFuse section 4).

Each data-parallel replica of the ``gen`` task's allocation is one generation instance (tp x pp
devices). Samples are dealt to instances round-robin, or by predicted length
(``GenerationPolicy.dispatch``: StreamRL's skewness-aware dispatch, :func:`dispatch_samples`).
Batching policies, from ``Plan.generation``:

- ``continuous`` (Orca / vLLM): an instance admits waiting samples whenever a slot and KV memory
  are free, runs one prefill for the newly admitted prompts, then decode steps over all running
  samples; a sample leaves the batch the step it reaches its target length. How KV memory is
  allocated is the engine's (``GenerationPolicy.kv_allocation``):

  - ``reserve``: prompt + ``max_gen_len`` tokens per sample at admission, never preempted
    (conservative: what an engine without paging must do);
  - ``on_demand``: vLLM's paged allocation (Kwon et al., SOSP'23, section 4.2: blocks are
    allocated as tokens arrive; section 4.5: when none is free the latest-arrived sequences are
    preempted and their KV freed, to be recomputed). A sample holds KV for its context (prompt +
    tokens generated so far; counted in tokens, not 16-token blocks). The running samples go first:
    before a decode step, while their contexts plus one token each do not fit, the latest admitted
    is preempted (its KV freed; it returns to the front of the queue with its tokens and is
    prefilled again, prompt and generated tokens, when readmitted). A waiting sample is admitted
    while its context and one more token for every running sample, itself included, fit, so each
    admission is followed by a decode step (vLLM's prefill emits the first token itself) and no
    sample is admitted before a step that preempts (as vLLM's scheduler admits none in one).
    Preemption by swapping to host memory is not modelled (recompute is vLLM's default).
- ``static`` (DeepSpeed-Chat's hybrid engine): an instance takes its samples in rounds of
  ``max_batch_size``; each round prefills, then decodes until its *longest* sample ends, with the
  batch size fixed and contexts padded (finished rows keep computing).

**Long-tail migration** (RLHFuse section 4, ``GenerationPolicy.migration``): when fewer than
``threshold_frac`` of the batch's samples are unfinished, every unfinished sample moves to the
``num_tail_instances`` instances that hold the most unfinished samples; the other instances are
released (their devices go to inference). The moved state is either the KV cache (bytes over the
links between the instances) or only the tokens (tiny transfer; the receiver re-prefills the
context). Instances are independent until the migration, so the migration time is found from an
unmigrated run and the instances are then replayed up to it, which is exact.

Each decode step costs ``CostModel.decode_step_s(batch, context tokens, tp, pp)``: as the plan's
generation engine runs it when the cost model carries the plan's engines
(:meth:`~harness.costmodel.CostModel.with_engines`: an eager host loop, CUDA graphs, ...), else a
CUDA-graph engine's step. Steps between two batch changes form one span, timed by one
``decode_span_s`` call (memoised: replays and candidate layouts ask for the same spans).

With expert parallelism (``ParallelStrategy.ep > 1``, a mixture-of-experts actor), each instance
holds ``1 / ep`` of the routed experts and its steps include the all-to-alls with the other
instances of its ep group, whose batches are taken to be the same size as its own (they are not
simulated in lockstep; the searched generation layouts keep ``ep = 1``,
:class:`harness.planning.layout_search.LayoutSearch`).

Planners' estimates (:class:`harness.planning.estimate.GenerationEstimates`) time an instance from
its :class:`StepSchedule`: continuous batching's admissions and spans counted in steps, which do not
depend on step times, worked out once and shared by every layout and model that holds the same
samples, then priced in one elementwise pass (:func:`timed_end_s`, the instance's clock bit for bit).

Static rounds may be **synced** across instances (``GenerationPolicy.synced_instances``:
``generate(synced_gpus=True)`` under ZeRO-3 keeps every rank stepping until all ranks' rounds
end): round ``r`` of every instance then pads its prompts to, and decodes until, the longest
prompt / response of round ``r`` on any instance. :func:`padded_lengths` gives the sequence length
each sample has in later passes when the policy pads to the longest of its round.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import operator
import zlib
from dataclasses import dataclass, field, replace

import numpy as np

from harness.costmodel import CostModel
from harness.costmodel.llama import kv_bytes_per_token
from harness.core.plan import GenerationPolicy, Task
from harness.planning.taskmodels.migration import destination, due, tail_instances, threshold
from harness.schedule.simulate import compiled_kernels_warm
from harness.core.trace import SampleRecord, Span
from harness.errors import PlanError


@dataclass
class _Sample:
    sample_id: int
    prompt_len: int
    output_len: int
    generated: int = 0
    has_kv: bool = False  # context already in this instance's KV cache (no prefill needed)

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated

    @property
    def left(self) -> int:
        return self.output_len - self.generated


@dataclass
class InstanceResult:
    devices: tuple[int, ...]
    end_s: float
    spans: list[Span] = field(default_factory=list)
    peak_kv_tokens: int = 0


class ContinuousInstance:
    """One generation instance with continuous batching; can stop at a time and take or give samples.

    Bookkeeping is per span, not per running sample (at 256 samples a batch the per-sample
    sums were most of the planner's time): the instance counts its decode steps, each running
    sample is due at step ``admitted step + tokens left`` (a heap gives the next span's length), and
    the running context and target totals are kept incrementally. A sample's ``generated`` is
    brought up to date only when it leaves (finishes or migrates)."""

    def __init__(self, cm: CostModel, model, devices: tuple[int, ...], tp: int, pp: int, start_s: float,
                 max_batch: int, kv_capacity_tokens: int, max_gen_len: int, finishes: list[SampleRecord],
                 task_name: str, ep: int = 1, kv_on_demand: bool = False):
        self.cm, self.model, self.devices, self.tp, self.pp, self.ep = cm, model, devices, tp, pp, ep
        self.kv_on_demand = kv_on_demand  # paged KV allocated as tokens arrive, with preemption (module docstring)
        self.num_preempted = 0  # preemptions so far (a sample preempted twice counts twice)
        self.task_name = task_name
        self.now = start_s
        self.max_batch, self.kv_capacity_tokens, self.max_gen_len = max_batch, kv_capacity_tokens, max_gen_len
        self.waiting: list[_Sample] = []
        self.running: dict[int, _Sample] = {}  # by admission number: iterates in admission order
        self._due: list[tuple[int, int]] = []  # heap of (step the sample finishes at, admission number)
        self._admitted = 0
        self.steps = 0  # decode steps run so far
        self._context_total = 0  # sum of the running samples' contexts
        self._target_total = 0  # sum of their prompt + output lengths (the KV they will hold)
        self.reserved = 0
        self.finishes = finishes
        self.result = InstanceResult(devices, start_s)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _span(self, start: float, end: float, kind: str) -> None:
        self.result.spans.append(Span(self.devices, self.task_name, kind, start, end))

    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.max_batch:  # nothing to admit (most steps of a run)
            return
        waiting, running, max_gen_len, capacity = self.waiting, self.running, self.max_gen_len, self.kv_capacity_tokens
        room = self.max_batch - len(running)
        reserved, num_admitted, to_prefill = self.reserved, 0, 0
        on_demand, held = self.kv_on_demand, self._context_total
        while num_admitted < len(waiting) and num_admitted < room:
            sample = waiting[num_admitted]
            if on_demand:  # its context, and a token for each running sample and itself
                context = sample.prompt_len + sample.generated
                if held + context + len(running) + num_admitted + 1 > capacity and (running or num_admitted):
                    break
                held += context
            else:
                need = sample.prompt_len + max_gen_len
                if reserved + need > capacity and (running or num_admitted):
                    break
                reserved += need
            num_admitted += 1
            if not sample.has_kv:
                to_prefill += sample.prompt_len + sample.generated
        admitted = waiting[:num_admitted]
        del waiting[:num_admitted]
        self.reserved = reserved
        if to_prefill:
            dt = self.cm.prefill_s(self.model, to_prefill, self.tp, self.pp, ep=self.ep)
            self._span(self.now, self.now + dt, "prefill")
            self.now += dt
        due, steps, number = self._due, self.steps, self._admitted
        context_total, target_total = self._context_total, self._target_total
        for s in admitted:
            s.has_kv = True
            running[number] = s
            context = s.prompt_len + s.generated
            heapq.heappush(due, (steps + s.output_len - s.generated, number))
            number += 1
            context_total += context
            target_total += s.prompt_len + s.output_len
        self._admitted, self._context_total, self._target_total = number, context_total, target_total

    def run(self, until_s: float = math.inf) -> None:
        """Generate until every sample finished, or until the first step that ends at/after ``until_s``."""
        cm, model, tp, pp, ep = self.cm, self.model, self.tp, self.pp, self.ep
        running, due, finishes, result = self.running, self._due, self.finishes, self.result
        spans, devices, task_name = result.spans, self.devices, self.task_name
        until = until_s != math.inf
        on_demand, capacity = self.kv_on_demand, self.kv_capacity_tokens
        while (self.waiting or running) and self.now < until_s:
            self._admit()
            batch = len(running)
            num_steps, start = due[0][0] - self.steps, self.now
            if on_demand:
                if self._context_total + batch > capacity:  # (then nothing was admitted: _admit)
                    self._preempt()
                    due, batch = self._due, len(running)
                    num_steps = due[0][0] - self.steps
                num_steps = min(num_steps, (capacity - self._context_total) // batch)
                held = self._context_total + num_steps * batch
                if held > result.peak_kv_tokens:
                    result.peak_kv_tokens = held
            elif self._target_total > result.peak_kv_tokens:
                result.peak_kv_tokens = self._target_total
            span = cm.decode_span_s(model, batch, self._context_total, num_steps, tp, pp, ep)
            if until:
                # the clock after each step, added in order; a step starts only while the clock is before
                # until_s (step times are non-negative, so the clocks are sorted and bisect finds the stop)
                clocks = list(itertools.accumulate(span, initial=start))
                done_steps = bisect.bisect_left(clocks, until_s, 0, num_steps)
                now = clocks[done_steps]
            else:  # the same additions, in the same order
                done_steps, now = num_steps, functools.reduce(operator.add, span, start)
            self.now = now
            spans.append(Span(devices, task_name, "decode", start, now))
            steps = self.steps = self.steps + done_steps
            context_total = self._context_total + done_steps * batch
            while due and due[0][0] <= steps:  # in admission order among equals
                _, number = heapq.heappop(due)
                s = running.pop(number)
                s.generated = s.output_len
                finishes.append(SampleRecord(s.sample_id, s.prompt_len, s.output_len, now))
                if not on_demand:
                    self.reserved -= s.prompt_len + self.max_gen_len
                context_total -= s.prompt_len + s.output_len
                self._target_total -= s.prompt_len + s.output_len
            self._context_total = context_total
        result.end_s = self.now

    def _preempt(self) -> None:
        """Free the KV of the latest-admitted running samples until the others' next decode step
        fits; they return to the front of the queue (earliest admitted first) with their tokens."""
        running, capacity = self.running, self.kv_capacity_tokens
        finish_step = {number: step for step, number in self._due}
        preempted: list[_Sample] = []
        while running and self._context_total + len(running) > capacity:
            if len(running) == 1:
                s = next(iter(running.values()))
                raise PlanError(f"generation: the KV cache holds {capacity} tokens, fewer than one sample's "
                                f"context ({s.prompt_len} prompt + {s.output_len} generated tokens)")
            number = next(reversed(running))
            s = running.pop(number)
            s.generated = s.output_len - (finish_step.pop(number) - self.steps)
            s.has_kv = False
            self._context_total -= s.prompt_len + s.generated
            self._target_total -= s.prompt_len + s.output_len
            preempted.append(s)
        self.num_preempted += len(preempted)
        self._due = [(step, number) for number, step in finish_step.items()]
        heapq.heapify(self._due)
        self.waiting[:0] = preempted[::-1]

    def take_unfinished(self) -> list[_Sample]:
        due = {number: step for step, number in self._due}
        out = list(self.running.values())
        for number, s in self.running.items():
            s.generated = s.output_len - (due[number] - self.steps)
        out += self.waiting
        self.running, self.waiting, self._due, self.reserved = {}, [], [], 0
        self._context_total = self._target_total = 0
        return out


@dataclass(frozen=True)
class StepSchedule:
    """One instance's continuous batching counted in decode steps: :class:`ContinuousInstance`'s
    admissions and spans from start to end, without their times (no migration, no stop). What
    happens depends only on the samples' lengths, the batch limit and the KV capacity, never on how
    long a step takes, so one schedule serves every layout and model whose instance holds these
    samples with these limits; :func:`timed_end_s` prices it. Per span, in order:"""

    prefill_tokens: np.ndarray  # tokens prefilled just before it (0: none)
    batch_sizes: np.ndarray  # samples running in it
    context_totals: np.ndarray  # their context tokens at its first step
    num_steps: np.ndarray  # its decode steps


# step_schedule's tiering (as the schedule simulator's, harness.schedule.simulate): interpreted until
# this process has scheduled this many samples, then compiled; numba's start-up (about 0.3 s) is
# then small beside what the interpreted heap would spend on the rest.
COMPILE_AFTER_SAMPLES = 200_000
_samples_scheduled = 0


def step_schedule(prompt_lens: np.ndarray, output_lens: np.ndarray, max_batch: int, kv_capacity_tokens: int,
                  max_gen_len: int, kv_on_demand: bool = False) -> StepSchedule:
    """The :class:`StepSchedule` of :class:`ContinuousInstance` run to the end on these samples (in
    this order) from an empty cache: the same admission rule (slots, then KV reserved for prompt +
    ``max_gen_len`` tokens, or with ``kv_on_demand`` allocated as tokens arrive, with preemption),
    the same spans between batch changes, the same finishes.

    Reserving, compiled (:mod:`.kernel`) once this process has scheduled :data:`COMPILE_AFTER_SAMPLES`
    samples here or has run another compiled kernel; the same spans either way (tested)."""
    if kv_on_demand:
        return _step_schedule_on_demand(prompt_lens.tolist(), output_lens.tolist(), max_batch, kv_capacity_tokens)
    global _samples_scheduled
    if _samples_scheduled >= COMPILE_AFTER_SAMPLES or compiled_kernels_warm():
        from harness.compiled import AVAILABLE
        if AVAILABLE:
            from harness.planning.taskmodels.kernel import step_schedule_spans

            spans = np.empty((len(prompt_lens) + 1, 4), dtype=np.int64)
            num_spans = step_schedule_spans(np.ascontiguousarray(prompt_lens, dtype=np.int64),
                                            np.ascontiguousarray(output_lens, dtype=np.int64),
                                            int(max_batch), int(kv_capacity_tokens), int(max_gen_len), spans)
            return StepSchedule(*np.ascontiguousarray(spans[:num_spans].T))
    _samples_scheduled += len(prompt_lens)
    prompts, outputs = prompt_lens.tolist(), output_lens.tolist()
    num_samples, next_sample, number = len(prompts), 0, 0
    due: list[tuple[int, int, int, int]] = []  # heap of (finish step, admission number, prompt, output)
    steps = reserved = context_total = 0
    spans: list[tuple[int, int, int, int]] = []
    while next_sample < num_samples or due:
        to_prefill, room = 0, max_batch - len(due)
        while next_sample < num_samples and room > 0:
            prompt, output = prompts[next_sample], outputs[next_sample]
            need = prompt + max_gen_len
            if reserved + need > kv_capacity_tokens and due:
                break
            reserved += need
            to_prefill += prompt
            context_total += prompt
            heapq.heappush(due, (steps + output, number, prompt, output))
            number += 1
            next_sample += 1
            room -= 1
        batch, num_steps = len(due), due[0][0] - steps
        spans.append((to_prefill, batch, context_total, num_steps))
        steps += num_steps
        context_total += num_steps * batch
        while due and due[0][0] <= steps:
            _, _, prompt, output = heapq.heappop(due)
            reserved -= prompt + max_gen_len
            context_total -= prompt + output
    columns = np.array(spans, dtype=np.int64).reshape(-1, 4).T
    return StepSchedule(*columns)


def _step_schedule_on_demand(prompts: list[int], outputs: list[int], max_batch: int, capacity: int) -> StepSchedule:
    """:func:`step_schedule` under on-demand KV allocation: :class:`ContinuousInstance`'s
    ``_admit``, ``_preempt`` and ``run`` with ``kv_on_demand``, counted in steps."""
    waiting = [[p, o, 0] for p, o in zip(prompts, outputs)]  # prompt, output, generated; front first
    waiting.reverse()  # popped from the end: the front of the queue is the list's last entry
    running: dict[int, list[int]] = {}  # admission number -> sample, in admission order
    due: list[tuple[int, int]] = []  # heap of (finish step, admission number)
    steps = number = context_total = 0
    spans: list[tuple[int, int, int, int]] = []
    while waiting or running:
        to_prefill = 0
        while waiting and len(running) < max_batch:
            prompt, output, generated = sample = waiting[-1]
            context = prompt + generated
            if context_total + context + len(running) + 1 > capacity and running:
                break
            waiting.pop()
            to_prefill += context
            context_total += context
            running[number] = sample
            heapq.heappush(due, (steps + output - generated, number))
            number += 1
        if context_total + len(running) > capacity:  # preempt the latest admitted (nothing was admitted)
            finish_step = {n: step for step, n in due}
            preempted = []
            while context_total + len(running) > capacity:
                if len(running) == 1:
                    raise PlanError(f"generation: the KV cache holds {capacity} tokens, fewer than one sample's "
                                    f"context")
                n = next(reversed(running))
                sample = running.pop(n)
                sample[2] = sample[1] - (finish_step.pop(n) - steps)
                context_total -= sample[0] + sample[2]
                preempted.append(sample)
            waiting.extend(preempted)  # the earliest admitted of them at the front (the end)
            due = [(step, n) for n, step in finish_step.items()]
            heapq.heapify(due)
        batch = len(running)
        num_steps = min(due[0][0] - steps, (capacity - context_total) // batch)
        spans.append((to_prefill, batch, context_total, num_steps))
        steps += num_steps
        context_total += num_steps * batch
        while due and due[0][0] <= steps:
            _, n = heapq.heappop(due)
            prompt, output, _ = running.pop(n)
            context_total -= prompt + output
    columns = np.array(spans, dtype=np.int64).reshape(-1, 4).T
    return StepSchedule(*columns)


def timed_end_s(schedule: StepSchedule, cm: CostModel, model, tp: int, pp: int, ep: int, start_s: float,
                prefill_memo: dict[int, float] | None = None) -> float:
    """When an instance of ``tp x pp`` devices (one of ``ep``) that starts at ``start_s`` ends
    ``schedule``: :class:`ContinuousInstance`'s clock, bit for bit (every prefill and every decode
    step added in order), with the steps timed in one elementwise pass where the cost model has one
    (:meth:`CostModel.decode_steps_s`), else one span at a time. ``prefill_memo``: prefill seconds
    by token count of this cost model, model and layout, kept by a caller that times many schedules."""
    num_steps, batch_sizes = schedule.num_steps, schedule.batch_sizes
    num_spans = len(num_steps)
    if num_spans == 0:
        return start_s
    prefilled = schedule.prefill_tokens > 0
    prefill_s: dict[int, float] = {} if prefill_memo is None else prefill_memo
    prefill_tokens = schedule.prefill_tokens[prefilled].tolist()
    missing = [tokens for tokens in dict.fromkeys(prefill_tokens) if tokens not in prefill_s]
    if missing:  # priced in one elementwise pass where the cost model has one
        priced = cm.prefills_s(model, np.array(missing, dtype=np.int64), tp, pp, ep)
        if priced is None:
            priced = [cm.prefill_s(model, tokens, tp, pp, ep=ep) for tokens in missing]
        prefill_s.update(zip(missing, np.asarray(priced).tolist()))
    # one slot per prefill and per step, in the order the instance's clock adds them
    slots = num_steps + prefilled
    first_slot = np.cumsum(slots) - slots
    durations = np.empty(int(slots.sum()) + 1)
    durations[0] = start_s
    is_step = np.ones(len(durations) - 1, dtype=bool)
    is_step[first_slot[prefilled]] = False
    durations[1:][~is_step] = [prefill_s[t] for t in prefill_tokens]
    step_batch = np.repeat(batch_sizes, num_steps)
    first_step = np.cumsum(num_steps) - num_steps
    step_in_span = np.arange(len(step_batch)) - np.repeat(first_step, num_steps)
    step_context = np.repeat(schedule.context_totals, num_steps) + step_in_span * step_batch
    steps_s = cm.decode_steps_s(model, step_batch, step_context, tp, pp, ep) if len(step_batch) else step_batch
    if steps_s is None:  # no elementwise pass: the spans one by one, as the instance asks for them
        steps_s = [t for b, c, n in zip(batch_sizes.tolist(), schedule.context_totals.tolist(), num_steps.tolist())
                   for t in cm.decode_span_s(model, b, c, n, tp, pp, ep)]
    durations[1:][is_step] = steps_s
    return float(np.cumsum(durations)[-1])


# continuous_instance_ends' step schedules: (ids of the length arrays, dp, instance, limits) ->
# (the arrays, kept alive so that their ids stay theirs, and the schedule). Batches' length arrays
# are never changed in place.
_SCHEDULES: dict[tuple, tuple[np.ndarray, np.ndarray, StepSchedule]] = {}
SCHEDULES_MAX_ENTRIES = 1024


def dispatch_samples(policy: GenerationPolicy, dp: int, output_lens: np.ndarray) -> list[np.ndarray]:
    """The sample ids each of ``dp`` instances generates, in the order it admits them: round-robin,
    or under ``policy.dispatch`` (:class:`~harness.core.plan.LengthDispatch`; StreamRL, Zhong et al.,
    arXiv 2504.15930, skewness-aware dispatch) the ranker's flagged samples dealt round-robin to the
    first ``num_long_instances`` instances and the others to the rest. The ranker flags
    ``round(long_frac n)`` samples (at least 1): ``round(recall x that)`` of the truly longest that
    many (ties by id), the rest of its flags samples outside them. Which ones it catches and which it
    flags by mistake are drawn by a generator seeded from the batch's lengths, so a batch is always
    dispatched the same way, whatever plan or backend asks."""
    ids = np.arange(len(output_lens))
    d = policy.dispatch
    if d is None:
        return [ids[k::dp] for k in range(dp)]
    if not 1 <= d.num_long_instances < dp:
        raise PlanError(f"length dispatch: {d.num_long_instances} long instances of {dp}; the others need one")
    n = len(output_lens)
    m = min(n, max(1, round(d.long_frac * n)))
    order = np.lexsort((ids, -np.asarray(output_lens)))  # longest first, ties by id
    longest, rest = order[:m], order[m:]
    rng = np.random.default_rng(zlib.crc32(np.asarray(output_lens, dtype=np.int64).tobytes()))
    caught = rng.choice(longest, size=round(d.ranker_recall * m), replace=False)
    mistaken = rng.choice(rest, size=min(len(rest), m - len(caught)), replace=False)
    flagged = np.zeros(n, dtype=bool)
    flagged[caught] = flagged[mistaken] = True
    long_ids, other_ids = ids[flagged], ids[~flagged]
    num_long = d.num_long_instances
    return ([long_ids[k::num_long] for k in range(num_long)]
            + [other_ids[k::dp - num_long] for k in range(dp - num_long)])


def continuous_instance_ends(cm: CostModel, task: Task, policy: GenerationPolicy, model, prompt_lens: np.ndarray,
                             output_lens: np.ndarray, start_s: float, kv_capacity_gb: float,
                             max_gen_len: int) -> GenerationResult:
    """:func:`simulate_generation` under continuous batching without migration, less what only a
    trace reads: each instance's end (its step schedule, :func:`step_schedule`, priced by
    :func:`timed_end_s`: the instance's clock bit for bit) and devices, no per-sample finishes
    and no spans. Planners scoring whole plans read this; the schedules are kept across calls on
    the same length arrays (candidate plans of one search share the batch)."""
    if policy.batching != "continuous" or policy.migration is not None:
        raise ValueError("continuous_instance_ends: continuous batching without migration only")
    s = task.allocation.strategy
    kv_tokens = kv_capacity_tokens(cm, model, s.tp, s.pp, kv_capacity_gb)
    max_batch = policy.max_batch_size or len(prompt_lens)
    instances = []
    dealt = None  # each instance's samples, dealt when a schedule is not kept yet
    for k in range(s.dp):
        key = (id(prompt_lens), id(output_lens), s.dp, k, max_batch, kv_tokens, max_gen_len, policy.dispatch,
               policy.kv_allocation)
        hit = _SCHEDULES.get(key)
        if hit is None:
            if len(_SCHEDULES) >= SCHEDULES_MAX_ENTRIES:
                _SCHEDULES.clear()
            dealt = dealt or dispatch_samples(policy, s.dp, output_lens)
            hit = _SCHEDULES[key] = (prompt_lens, output_lens, step_schedule(
                prompt_lens[dealt[k]], output_lens[dealt[k]], max_batch, kv_tokens, max_gen_len,
                policy.kv_allocation == "on_demand"))
        end_s = timed_end_s(hit[2], cm, model, s.tp, s.pp, s.ep, start_s)
        instances.append(InstanceResult(task.allocation.replica_devices(k), end_s))
    return GenerationResult([], instances)


def _rounds(num_samples: int, dp: int, round_size: int) -> list[list[np.ndarray]]:
    """Sample ids of instance ``k``'s round ``r``: ``rounds[r][k]`` (samples dealt round-robin)."""
    ids = np.arange(num_samples)
    mine = [ids[k::dp] for k in range(dp)]
    num_rounds = max((math.ceil(len(m) / round_size) for m in mine), default=0)
    return [[m[r * round_size:(r + 1) * round_size] for m in mine] for r in range(num_rounds)]


def padded_lengths(policy: GenerationPolicy, dp: int, prompt_lens: np.ndarray,
                   output_lens: np.ndarray) -> np.ndarray:
    """Sequence length (prompt + response) of every sample in the passes after generation: its
    own, or, when ``policy.pad_to_longest``, the longest of its static round (of any instance's
    round when the rounds are synced)."""
    seq = prompt_lens + output_lens
    if not policy.pad_to_longest:
        return seq
    out = seq.copy()
    round_size = policy.max_batch_size or max(1, math.ceil(len(seq) / dp))
    for members in _rounds(len(seq), dp, round_size):
        groups = [np.concatenate(members)] if policy.synced_instances else members
        for g in groups:
            if len(g):
                out[g] = int(prompt_lens[g].max()) + int(output_lens[g].max())
    return out


def _static(cm: CostModel, model, task: Task, policy: GenerationPolicy, prompts: np.ndarray,
            outputs: np.ndarray, start: float, finishes: list[SampleRecord], ep: int = 1) -> list[InstanceResult]:
    s = task.allocation.strategy
    tp, pp = s.tp, s.pp
    round_size = policy.max_batch_size or max(1, math.ceil(len(prompts) / s.dp))
    results = [InstanceResult(task.allocation.replica_devices(k), start) for k in range(s.dp)]
    nows = [start] * s.dp
    for members in _rounds(len(prompts), s.dp, round_size):
        everyone = np.concatenate(members)
        for k, ids in enumerate(members):
            if len(ids) == 0:
                continue
            res, now, batch = results[k], nows[k], len(ids)
            span_of = ids if not policy.synced_instances else everyone
            padded_prompt = int(prompts[span_of].max())
            dt = cm.prefill_s(model, padded_prompt * batch, tp, pp, ep=ep)
            res.spans.append(Span(res.devices, task.name, "prefill", now, now + dt))
            now += dt
            num_steps = int(outputs[span_of].max())
            step_times = cm.decode_span_s(model, batch, padded_prompt * batch, num_steps, tp, pp, ep)
            elapsed = np.cumsum(step_times)
            for i in ids:  # a row's last token comes out at the end of its own step
                finishes.append(SampleRecord(int(i), int(prompts[i]), int(outputs[i]),
                                             now + float(elapsed[int(outputs[i]) - 1])))
            res.spans.append(Span(res.devices, task.name, "decode", now, now + float(elapsed[-1])))
            nows[k] = now + float(elapsed[-1])
            res.peak_kv_tokens = max(res.peak_kv_tokens, (padded_prompt + num_steps) * batch)
        if policy.synced_instances:  # the next round starts on every rank together
            nows = [max(nows)] * s.dp
    for res, now in zip(results, nows):
        res.end_s = now
    return results


@dataclass
class GenerationResult:
    samples: list[SampleRecord]
    instances: list[InstanceResult]
    migrated_samples: int = 0
    tail_instances: int = 0
    migration_s: float | None = None  # when the migration happened

    @property
    def end_s(self) -> float:
        return max(i.end_s for i in self.instances)

    def device_free_s(self) -> dict[int, float]:
        """When each generation device is released (instances released at migration free early)."""
        return {d: inst.end_s for inst in self.instances for d in inst.devices}


def _make_instances(cm, task: Task, policy: GenerationPolicy, model, prompts, outputs, start_s, kv_tokens,
                    max_gen_len, finishes, ep: int = 1) -> list[ContinuousInstance]:
    s = task.allocation.strategy
    instances = []
    for k, ids in enumerate(dispatch_samples(policy, s.dp, outputs)):
        inst = ContinuousInstance(cm, model, task.allocation.replica_devices(k), s.tp, s.pp, start_s,
                                  policy.max_batch_size or len(prompts), kv_tokens, max_gen_len, finishes,
                                  task.name, ep, policy.kv_allocation == "on_demand")
        inst.waiting = [_Sample(int(i), int(prompts[i]), int(outputs[i])) for i in ids]
        instances.append(inst)
    return instances


def _migration_time(finish_times: list[float], num_samples: int, threshold_samples: int) -> float | None:
    """First time the number of unfinished samples drops below ``threshold_samples`` (while some are)."""
    for finished, t in enumerate(sorted(finish_times), start=1):
        if num_samples - finished < threshold_samples:
            return t if due(num_samples - finished, threshold_samples) else None
    return None


def _transfer_s(cm: CostModel, model, samples: list[_Sample], src: ContinuousInstance, dst: ContinuousInstance,
                transfer: str) -> float:
    if not samples or src is dst:
        return 0.0
    if transfer == "kv":
        per_device = sum(s.context for s in samples if s.has_kv) * kv_bytes_per_token(model) / (src.tp * src.pp)
    else:  # token ids only (int32); the receiver re-prefills
        per_device = 4.0 * sum(s.context for s in samples)
    return cm.p2p_s(per_device, src.devices[0], dst.devices[0])


def _migrate(cm: CostModel, model, instances: list[ContinuousInstance], num_targets: int, transfer: str) -> tuple[int, int]:
    """Move every unfinished sample to the ``num_targets`` instances holding the most; returns
    (samples moved, instances kept). Instances run on after their incoming transfers end."""
    tails, sources = tail_instances({k: inst.num_unfinished for k, inst in enumerate(instances)}, num_targets)
    targets = [instances[k] for k in tails]
    moved = 0
    arrivals = {id(t): t.now for t in targets}
    for k in sources:
        src = instances[k]
        samples = src.take_unfinished()
        if not samples:
            continue
        moved += len(samples)
        for j, sample in enumerate(samples):  # spread round-robin over the targets
            dst = instances[destination(tails, k, j)]
            sent = [sample]
            dt = _transfer_s(cm, model, sent, src, dst, transfer)
            src.result.spans.append(Span(src.devices, src.task_name, "migrate", src.now, src.now + dt, 0.0))
            src.now += dt
            arrivals[id(dst)] = max(arrivals[id(dst)], src.now)
            if transfer != "kv":
                sample.has_kv = False
            dst.waiting.append(sample)
        src.result.end_s = src.now
    for t in targets:
        t.now = arrivals[id(t)]
    return moved, len(targets)


def kv_capacity_tokens(cm: CostModel, model, tp: int, pp: int, kv_capacity_gb: float) -> int:
    """Tokens of KV cache an instance of ``tp x pp`` devices holds in ``kv_capacity_gb`` per device."""
    kv_per_token_gb = cm.kv_cache_gb(model, 1, tp, pp)
    return int(kv_capacity_gb / kv_per_token_gb) if kv_per_token_gb > 0 else 1 << 40


def simulate_generation(cm: CostModel, task: Task, policy: GenerationPolicy, model, prompt_lens: np.ndarray,
                        output_lens: np.ndarray, start_s: float, kv_capacity_gb: float,
                        max_gen_len: int, ep: int | None = None) -> GenerationResult:
    """``ep``: the expert-parallel degree of the whole generation layout, when ``task`` holds only
    some of its instances (a planner's estimate); None: the task's own."""
    return simulate_generation_each(cm, task, [policy], model, prompt_lens, output_lens, start_s, kv_capacity_gb,
                                    max_gen_len, ep)[0]


def simulate_generation_each(cm: CostModel, task: Task, policies: list[GenerationPolicy], model,
                             prompt_lens: np.ndarray, output_lens: np.ndarray, start_s: float,
                             kv_capacity_gb: float, max_gen_len: int, ep: int | None = None) -> list[GenerationResult]:
    """``[simulate_generation(..., policy, ...) for policy in policies]`` for policies that differ
    only in their migration (a planner sweeping the threshold): the unmigrated run, which fixes
    each policy's migration time, is made once. Results of policies that do not migrate are one
    shared object: read them, do not change them."""
    if len({replace(p, migration=None) for p in policies}) > 1:
        raise ValueError("simulate_generation_each: the policies differ in more than their migration")
    s = task.allocation.strategy
    ep = s.ep if ep is None else ep
    kv_tokens = kv_capacity_tokens(cm, model, s.tp, s.pp, kv_capacity_gb)
    policy = policies[0]
    if policy.batching == "static":
        finishes: list[SampleRecord] = []
        instances = _static(cm, model, task, policy, prompt_lens, output_lens, start_s, finishes, ep)
        finishes.sort(key=lambda r: r.sample_id)
        return [GenerationResult(finishes, instances)] * len(policies)

    def fresh():
        out: list[SampleRecord] = []
        return _make_instances(cm, task, policy, model, prompt_lens, output_lens, start_s, kv_tokens,
                               max_gen_len, out, ep), out

    instances, finishes = fresh()
    for inst in instances:
        inst.run()
    unmigrated = GenerationResult(finishes, [i.result for i in instances])
    finish_times = [f.finish_s for f in finishes]
    unmigrated.samples.sort(key=lambda r: r.sample_id)
    results = []
    for policy in policies:
        mig = policy.migration
        t_m = None
        if mig is not None and s.dp > 1:
            t_m = _migration_time(finish_times, len(prompt_lens), threshold(mig.threshold_frac, len(prompt_lens)))
        if t_m is None:
            results.append(unmigrated)
            continue
        instances, finishes = fresh()  # replay up to the migration time (instances are independent)
        for inst in instances:
            inst.run(until_s=t_m)
        moved, kept = _migrate(cm, model, instances, mig.num_tail_instances, mig.transfer)
        for inst in instances:
            inst.run()
        result = GenerationResult(finishes, [i.result for i in instances], moved, kept, t_m)
        result.samples.sort(key=lambda r: r.sample_id)
        results.append(result)
    return results
