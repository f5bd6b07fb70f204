"""Analytic cost model of RLHF training on a GPU cluster (docs/DESIGN.md section 4).

``CostModel`` is the entry point; the submodules hold the pieces:

* :mod:`.llama` -- parameter / FLOP / KV-byte arithmetic of LLaMA-style decoders;
* :mod:`.compute` -- roofline times of forward, backward, prefill, decode step, optimizer;
* :mod:`.comm` -- alpha-beta point-to-point and ring collectives per network tier;
* :mod:`.memory` -- per-device weights, training state (ZeRO), activations, KV cache;
* :mod:`.profile` -- measured op times (CSV) that override the analytic ones;
* :mod:`.engines` -- the rules by which a plan's execution engines change op times
  (``CostModel.with_engines``);
* :mod:`.model` -- ``CostModel``, bundling the above for one cluster and workload.
"""
from harness.costmodel.comm import (
    allgather_s,
    allreduce_s,
    link_for_group,
    p2p_s,
    reduce_scatter_s,
)
from harness.costmodel.compute import ADAM_BYTES_PER_PARAM, OpCost, Roofline
from harness.costmodel.llama import (
    ModelDims,
    embedding_params,
    forward_flops,
    head_params,
    kv_bytes_per_token,
    matmul_params_per_layer,
    num_params,
    params_per_layer,
)
from harness.costmodel.memory import (
    activation_bytes_per_layer,
    activation_gb,
    kv_cache_gb,
    max_stage_params,
    training_state_gb,
    weights_gb,
)
from harness.costmodel.model import CostModel
from harness.costmodel.profile import ProfileTable

__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "CostModel",
    "ModelDims",
    "OpCost",
    "ProfileTable",
    "Roofline",
    "activation_bytes_per_layer",
    "activation_gb",
    "allgather_s",
    "allreduce_s",
    "embedding_params",
    "forward_flops",
    "head_params",
    "kv_bytes_per_token",
    "kv_cache_gb",
    "link_for_group",
    "matmul_params_per_layer",
    "max_stage_params",
    "num_params",
    "p2p_s",
    "params_per_layer",
    "reduce_scatter_s",
    "training_state_gb",
    "weights_gb",
]
