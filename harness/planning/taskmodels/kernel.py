"""Compiled continuous-batching schedule of :func:`harness.planning.taskmodels.generation.step_schedule`
(docs/DESIGN.md section 4).

This module owns :func:`step_schedule_spans`, the admission and finish bookkeeping of one
continuous-batching instance counted in decode steps: samples admitted in order while a slot is
free and the KV cache can reserve ``prompt + max_gen_len`` tokens (one is always admitted into an
empty batch), a span of decode steps until the next finish, the finished leaving. Its heap of
running samples is ordered by (finish step, admission number), as the interpreted function's
``heapq`` of tuples is, so both produce the same spans (tested). Planners build hundreds of these
schedules per plan over batches of thousands of samples (dynamic sampling's rounds: tens of
thousands), where the interpreted heap was the largest single cost.
"""
from __future__ import annotations

import numpy as np

from harness.compiled import njit


@njit(cache=True)
def step_schedule_spans(prompts, outputs, max_batch, kv_capacity_tokens, max_gen_len, spans):
    """Fill ``spans`` (at least ``len(prompts) + 1`` rows of 4 int64: prefill tokens, batch size,
    context tokens at the span's first step, decode steps) with the instance's spans in order;
    returns how many."""
    n = prompts.shape[0]
    key = np.empty(n, dtype=np.int64)  # heap of running samples: finish step,
    num = np.empty(n, dtype=np.int64)  # admission number,
    idx = np.empty(n, dtype=np.int64)  # sample index
    size = 0
    next_sample = number = steps = reserved = context_total = num_spans = 0
    while next_sample < n or size > 0:
        to_prefill = 0
        room = max_batch - size
        while next_sample < n and room > 0:
            prompt, output = prompts[next_sample], outputs[next_sample]
            need = prompt + max_gen_len
            if reserved + need > kv_capacity_tokens and size > 0:
                break
            reserved += need
            to_prefill += prompt
            context_total += prompt
            # push (steps + output, number, next_sample): sift up
            pos = size
            size += 1
            k, m = steps + output, number
            while pos > 0:
                parent = (pos - 1) // 2
                if key[parent] < k or (key[parent] == k and num[parent] < m):
                    break
                key[pos], num[pos], idx[pos] = key[parent], num[parent], idx[parent]
                pos = parent
            key[pos], num[pos], idx[pos] = k, m, next_sample
            number += 1
            next_sample += 1
            room -= 1
        num_steps = key[0] - steps
        spans[num_spans, 0] = to_prefill
        spans[num_spans, 1] = size
        spans[num_spans, 2] = context_total
        spans[num_spans, 3] = num_steps
        num_spans += 1
        steps += num_steps
        context_total += num_steps * size
        while size > 0 and key[0] <= steps:
            done = idx[0]
            reserved -= prompts[done] + max_gen_len
            context_total -= prompts[done] + outputs[done]
            # pop: the last entry sifts down from the root
            size -= 1
            k, m, i = key[size], num[size], idx[size]
            pos = 0
            while True:
                child = 2 * pos + 1
                if child >= size:
                    break
                if child + 1 < size and (key[child + 1] < key[child]
                                         or (key[child + 1] == key[child] and num[child + 1] < num[child])):
                    child += 1
                if k < key[child] or (k == key[child] and m < num[child]):
                    break
                key[pos], num[pos], idx[pos] = key[child], num[child], idx[child]
                pos = child
            if size > 0:
                key[pos], num[pos], idx[pos] = k, m, i
    return num_spans
