"""Simulated actor generation, token step by token step (DESIGN section 4).

Each data-parallel replica of the ``gen`` task's allocation is one generation instance (tp x pp
devices). Samples are dealt to instances round-robin. Two batching policies, from
``Plan.generation``:

- ``continuous`` (Orca / vLLM): an instance admits waiting samples whenever a slot and KV memory
  are free, runs one prefill for the newly admitted prompts, then decode steps over all running
  samples; a sample leaves the batch the step it reaches its target length. KV memory is reserved
  per sample for prompt + ``max_gen_len`` tokens at admission (no preemption; conservative).
- ``static`` (DeepSpeed-Chat's hybrid engine): an instance takes its samples in rounds of
  ``max_batch_size``; each round prefills, then decodes until its *longest* sample ends, with the
  batch size fixed and contexts padded (finished rows keep computing).

Each decode step costs ``CostModel.decode_step_s(batch, context tokens, tp, pp)`` (roofline:
weights and KV streamed vs. FLOPs). Steps between two batch changes form one span per device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from harness.costmodel import CostModel
from harness.plan import GenerationPolicy, Task
from harness.trace import SampleRecord, Span


@dataclass
class InstanceResult:
    devices: tuple[int, ...]
    end_s: float
    spans: list[Span] = field(default_factory=list)
    peak_kv_tokens: int = 0


@dataclass
class GenerationResult:
    samples: list[SampleRecord]
    instances: list[InstanceResult]

    @property
    def end_s(self) -> float:
        return max(i.end_s for i in self.instances)


def _decode_run(cm: CostModel, model, batch: int, context_total: int, num_steps: int, tp: int, pp: int,
                context_growth_per_step: int) -> float:
    """Time of ``num_steps`` decode steps with a fixed batch whose total context grows each step."""
    total = 0.0
    for j in range(num_steps):
        total += cm.decode_step_s(model, batch, context_total + j * context_growth_per_step, tp, pp)
    return total


def _spans(devices, start: float, end: float, kind: str, flops: float = 0.0) -> list[Span]:
    return [Span(tuple(devices), "gen", kind, start, end, flops)]


def _continuous(cm: CostModel, model, devices, prompts: np.ndarray, outputs: np.ndarray, ids: np.ndarray,
                start: float, tp: int, pp: int, max_batch: int, kv_capacity_tokens: int, max_gen_len: int,
                finishes: list[SampleRecord]) -> InstanceResult:
    res = InstanceResult(tuple(devices), start)
    waiting = list(range(len(ids)))
    running_ctx: list[int] = []  # current context length of each running sample
    running_left: list[int] = []  # tokens still to generate
    running_idx: list[int] = []
    reserved = 0
    now = start
    while waiting or running_idx:
        admitted = []
        while waiting and len(running_idx) + len(admitted) < max_batch:
            i = waiting[0]
            need = int(prompts[i]) + max_gen_len
            if reserved + need > kv_capacity_tokens and (running_idx or admitted):
                break
            waiting.pop(0)
            reserved += need
            admitted.append(i)
        if admitted:
            tokens = int(sum(prompts[i] for i in admitted))
            dt = cm.prefill_s(model, tokens, tp, pp)
            res.spans += _spans(devices, now, now + dt, "prefill")
            now += dt
            for i in admitted:
                running_idx.append(i)
                running_ctx.append(int(prompts[i]))
                running_left.append(int(outputs[i]))
        res.peak_kv_tokens = max(res.peak_kv_tokens, sum(running_ctx) + sum(running_left))
        # run until the next sample finishes (the batch is fixed until then)
        num_steps = min(running_left)
        batch = len(running_idx)
        dt = _decode_run(cm, model, batch, sum(running_ctx), num_steps, tp, pp, batch)
        res.spans += _spans(devices, now, now + dt, "decode")
        now += dt
        keep = []
        for k, i in enumerate(running_idx):
            running_ctx[k] += num_steps
            running_left[k] -= num_steps
            if running_left[k] == 0:
                finishes.append(SampleRecord(int(ids[i]), int(prompts[i]), int(outputs[i]), now))
                reserved -= int(prompts[i]) + max_gen_len
            else:
                keep.append(k)
        running_idx = [running_idx[k] for k in keep]
        running_ctx = [running_ctx[k] for k in keep]
        running_left = [running_left[k] for k in keep]
    res.end_s = now
    return res


def _static(cm: CostModel, model, devices, prompts: np.ndarray, outputs: np.ndarray, ids: np.ndarray,
            start: float, tp: int, pp: int, round_size: int, finishes: list[SampleRecord]) -> InstanceResult:
    res = InstanceResult(tuple(devices), start)
    now = start
    for lo in range(0, len(ids), round_size):
        sel = slice(lo, lo + round_size)
        p, o, batch = prompts[sel], outputs[sel], len(ids[sel])
        padded_prompt = int(p.max())
        dt = cm.prefill_s(model, padded_prompt * batch, tp, pp)
        res.spans += _spans(devices, now, now + dt, "prefill")
        now += dt
        num_steps = int(o.max())
        per_step_start = now
        dt = _decode_run(cm, model, batch, padded_prompt * batch, num_steps, tp, pp, batch)
        step_s = dt / num_steps
        for k in range(batch):  # finish times by linear interpolation over this round's steps
            finishes.append(SampleRecord(int(ids[sel][k]), int(p[k]), int(o[k]), per_step_start + step_s * int(o[k])))
        res.spans += _spans(devices, now, now + dt, "decode")
        now += dt
        res.peak_kv_tokens = max(res.peak_kv_tokens, (padded_prompt + num_steps) * batch)
    res.end_s = now
    return res


def simulate_generation(cm: CostModel, task: Task, policy: GenerationPolicy, model, prompt_lens: np.ndarray,
                        output_lens: np.ndarray, start_s: float, kv_capacity_gb: float,
                        max_gen_len: int) -> GenerationResult:
    s = task.allocation.strategy
    kv_per_token_gb = cm.kv_cache_gb(model, 1, s.tp, s.pp)
    kv_capacity_tokens = int(kv_capacity_gb / kv_per_token_gb) if kv_per_token_gb > 0 else 1 << 40
    ids = np.arange(len(prompt_lens))
    finishes: list[SampleRecord] = []
    instances = []
    for k in range(s.dp):
        mine = ids[k::s.dp]
        devices = task.allocation.replica_devices(k)
        if len(mine) == 0:
            instances.append(InstanceResult(tuple(devices), start_s))
            continue
        if policy.batching == "static":
            size = policy.max_batch_size or len(mine)
            inst = _static(cm, model, devices, prompt_lens[mine], output_lens[mine], mine, start_s,
                           s.tp, s.pp, size, finishes)
        else:
            max_batch = policy.max_batch_size or len(mine)
            inst = _continuous(cm, model, devices, prompt_lens[mine], output_lens[mine], mine, start_s,
                               s.tp, s.pp, max_batch, kv_capacity_tokens, max_gen_len, finishes)
        instances.append(inst)
    finishes.sort(key=lambda r: r.sample_id)
    return GenerationResult(finishes, instances)
