"""Analytic cost model of RLHF training on a GPU cluster (docs/DESIGN.md section 4).

``CostModel`` is the entry point; the submodules hold the pieces:

* :mod:`.llama` -- parameter / FLOP / KV-byte arithmetic of LLaMA-style decoders, dense or
  mixtures of experts (total and active parameters, experts a decode step touches);
* :mod:`.compute` -- roofline times of forward, backward, prefill, decode step, optimizer;
* :mod:`.comm` -- alpha-beta point-to-point, ring collectives and all-to-all per network tier;
* :mod:`.memory` -- per-device weights, training state (ZeRO, expert parallelism), activations, KV cache;
* :mod:`.profile` -- measured op times (CSV) that override the analytic ones;
* :mod:`.engines` -- the rules by which a plan's execution engines change op times
  (``CostModel.with_engines``);
* :mod:`.model` -- ``CostModel``, bundling the above for one cluster and workload.
"""
from harness.costmodel.comm import (
    allgather_s,
    allreduce_s,
    alltoall_s,
    link_for_group,
    p2p_s,
    reduce_scatter_s,
)
from harness.costmodel.compute import ADAM_BYTES_PER_PARAM, OpCost, Roofline
from harness.costmodel.llama import (
    ModelDims,
    active_matmul_params_per_layer,
    embedding_params,
    expected_experts_touched,
    forward_flops,
    head_params,
    kv_bytes_per_token,
    matmul_params_per_layer,
    num_active_params,
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
    "active_matmul_params_per_layer",
    "allgather_s",
    "allreduce_s",
    "alltoall_s",
    "embedding_params",
    "expected_experts_touched",
    "forward_flops",
    "head_params",
    "kv_bytes_per_token",
    "kv_cache_gb",
    "link_for_group",
    "matmul_params_per_layer",
    "max_stage_params",
    "num_active_params",
    "num_params",
    "p2p_s",
    "params_per_layer",
    "reduce_scatter_s",
    "training_state_gb",
    "weights_gb",
]
