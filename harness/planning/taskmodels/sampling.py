"""Dynamic sampling's rounds as the passes after generation see them (DAPO, arXiv 2503.14476
section 3.2; the batch's rounds and kept samples: :func:`harness.core.workload.make_sampled_batch`).

A group's fate (kept: its responses neither all pass nor all fail) is known once every one of its
responses is scored, so a kept sample can stream to inference no earlier than its group's last
response. This module turns a round's per-sample scoring times into the kept samples' stream: the
simulator's generate handler (:mod:`harness.planning.simulate`) and RLHFuse's inter-stage choice
(``systems/rlhfuse/inter.py``) read it.
"""
from __future__ import annotations

import numpy as np

from harness.core.trace import SampleRecord
from harness.core.workload import Batch


def group_ready_s(scored_s: np.ndarray, group_size: int) -> np.ndarray:
    """Per sample, when every response of its group (``group_size`` consecutive samples) is scored."""
    return np.repeat(np.asarray(scored_s, dtype=float).reshape(-1, group_size).max(axis=1), group_size)


def kept_stream(batch: Batch, ready_s: np.ndarray) -> list[SampleRecord]:
    """The batch's kept samples (``batch.trained_ids``) as a stream: sample ``i`` of the batch, ready
    at ``ready_s[batch.trained_ids[i]]`` (``ready_s`` over the rounds' samples laid end to end, or
    over a prefix of them: kept samples beyond it are left out)."""
    return [SampleRecord(i, int(batch.prompt_lens[i]), int(batch.output_lens[i]), float(ready_s[j]))
            for i, j in enumerate(batch.trained_ids.tolist()) if j < len(ready_s)]
