"""Digests of a model's full weights: what ``summary.json`` records as ``final_weights``.

A backend that holds real weights reports, after an iteration, one digest per trained model in
``StepTrace.extra["param_digest"]`` (:data:`harness.core.trace.PARAM_DIGEST`); the runner writes the last
iteration's to ``summary.json``. :func:`weights_digest` is that digest, computed from the model's
full state dict (every tensor assembled from its pipeline stages, tensor-parallel slices or ZeRO-3
shards under the single-device model's names).
"""
from __future__ import annotations

import hashlib
from typing import Mapping, Optional

import torch


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of a full state dict, as a lowercase hex string. Defined as the SHA-256 of the
    concatenation, over the entries in the order of their names sorted as Python strings (Unicode
    code points, e.g. ``layers.0.attn.wq.weight`` before ``layers.1...``), of: the name encoded as
    UTF-8, one zero byte, then the tensor's values converted to float32 (exact for float32 and
    bfloat16 weights) in row-major (C) order, as little-endian IEEE-754 bytes (4 per value).

    The same hash means bit-identical float32 weights under the same names. Layouts that change
    the order of float summation (dp, tp, pp, ZeRO-3) end with weights that agree to ~1e-8 but
    hash differently: compare weights across systems by their floats (``sum``, ``l2``), and use
    the hash for identity within one configuration (a re-run, a saved copy)."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode("utf-8") + b"\0")
        values = state[name].detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        h.update(values.astype("<f4", copy=False).tobytes())
    return h.hexdigest()


def weights_digest(state: Mapping[str, torch.Tensor],
                   init: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, float | int | str]:
    """The digest of a full state dict: ``num_params`` (values), ``sum`` and ``l2`` (sum and L2 norm
    of all values in float64, entries in sorted-name order), ``update_l2`` (L2 distance from
    ``init``, the same model's initial state dict; only when given) and ``sha256``
    (:func:`weights_sha256`)."""
    flat = torch.cat([state[n].detach().reshape(-1).double().cpu() for n in sorted(state)])
    out: dict[str, float | int | str] = {"num_params": int(flat.numel()), "sum": float(flat.sum()),
                                         "l2": float(flat.norm())}
    if init is not None:
        start = torch.cat([init[n].detach().reshape(-1).double().cpu() for n in sorted(init)])
        out["update_l2"] = float((flat - start).norm())
    out["sha256"] = weights_sha256(state)
    return out
