"""Packed micro-batches of real execution: several samples of a right-padded batch as one row.

A batch here is right-padded: ``tokens`` and ``attn`` are (B, W), row i's first ``n_i`` tokens real;
the per-token arrays of the losses (``action_mask``, ``old_logprobs``, ``advantages``, ...) are
(B, W - 1), entry j belonging to the prediction of token j + 1 from position j.
:func:`pack` concatenates the real tokens of the chosen rows into one row of L = sum n_i tokens
with ``segment_ids`` (the sample each token belongs to), so attention stays inside a sample and
positions restart at each sample (:func:`harness.real.model.build_positions_and_mask`: a
variable-length attention, as NeMo-RL's and verl's packed micro-batches run it, without padding
between samples). A per-token array takes the first ``n_i`` entries of each row: entries
``0 .. n_i - 2`` are the sample's own predictions, entry ``n_i - 1`` (its last token predicting the
next sample's first) is the one a right-padded row already masks (it predicts padding), so the
packed (1, L - 1) arrays mask every cross-sample prediction. A loss summed over masked tokens is
therefore the same packed or not; :func:`unpack` puts a packed row's per-token outputs back in the
batch's layout.

Which samples share a micro-batch is decided by :mod:`harness.planning.packing` (first-fit
decreasing to a token budget for forward-only passes, a balanced split into the schedule's
micro-batch count for training); this module only lays the tensors out.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

# the keys that hold a batch's tokens (width W); every other (B, W - 1) array is per predicted token
TOKEN_KEYS = ("tokens", "attn")


def row_lengths(attn: Tensor) -> Tensor:
    """Real tokens per row of a right-padded ``attn`` (B, W)."""
    return attn.sum(dim=1).long()


def pack(data: Mapping[str, Tensor], rows: Sequence[int]) -> dict[str, Tensor]:
    """Rows ``rows`` of the right-padded batch ``data`` (``tokens`` and ``attn`` (B, W), per-token
    arrays (B, W - 1)) as one packed row: ``tokens``, ``attn`` (all ones) and ``segment_ids`` (1, L),
    each per-token array (1, L - 1), and ``lengths`` (the samples' token counts, in ``rows`` order)."""
    index = torch.as_tensor(list(rows), dtype=torch.long, device=data["attn"].device)
    lengths = row_lengths(data["attn"][index])
    if (lengths < 1).any():
        raise ValueError(f"pack: rows {[r for r, n in zip(rows, lengths.tolist()) if n < 1]} hold no tokens")
    width = data["tokens"].shape[1]
    out: dict[str, Tensor] = {}
    for name, value in data.items():
        rows_v = value[index]
        if name in TOKEN_KEYS:
            out[name] = torch.cat([r[:n] for r, n in zip(rows_v, lengths.tolist())])[None]
        elif value.dim() == 2 and value.shape[1] == width - 1:
            # entry n_i - 1 of a full-width row does not exist: it predicts nothing, so it is 0
            padded = torch.cat([rows_v, rows_v.new_zeros(len(rows_v), 1)], dim=1)
            out[name] = torch.cat([r[:n] for r, n in zip(padded, lengths.tolist())])[None, :-1]
        else:
            raise ValueError(f"pack: {name!r} of shape {tuple(value.shape)} is neither per token (B, {width}) "
                             f"nor per prediction (B, {width - 1})")
    out["attn"] = torch.ones_like(out["attn"])
    # on the batch's device (a worker's tensors live on its GPU): the sample index of every token
    out["segment_ids"] = torch.repeat_interleave(torch.arange(len(index), device=lengths.device), lengths)[None]
    out["lengths"] = lengths
    return out


def unpack(packed: Tensor, lengths: Sequence[int], width: int) -> Tensor:
    """A packed row's per-prediction output (L - 1,) or (1, L - 1) back in the batch layout
    (len(lengths), width - 1): sample i's ``n_i - 1`` predictions first in its row, the rest 0
    (as a right-padded pass leaves them masked)."""
    flat = packed.reshape(-1)
    out = flat.new_zeros(len(lengths), width - 1)
    start = 0
    for i, n in enumerate(int(n) for n in lengths):
        out[i, :n - 1] = flat[start:start + n - 1]
        start += n
    return out


def last_positions(lengths: Sequence[int]) -> Tensor:
    """Each sample's last token's position in the packed row (where a scalar head's score is read)."""
    return torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.long), 0) - 1
