"""The cost model systems plan with and the simulator runs on (docs/DESIGN.md section 4).

Owns :class:`CostModel`, one object that answers every "how long" and "how big" question
for one cluster and workload: compute-op times (``cluster.cost_model``: ``calibrated``, laws
fitted on measured GPU profiles from :mod:`.calibrated`, the default of the H100/A100 cluster
configs; or ``roofline``, datasheet rooflines from :mod:`.compute`; either overridden by a
measured :class:`~harness.costmodel.profile.ProfileTable` where it has an entry), collective
times over device ids (measured NCCL curves where calibrated and measured, else alpha-beta per
tier from :mod:`.comm`) and per-device memory footprints (:mod:`.memory`). Devices are global ids ``0 .. num_devices - 1``, device
``d`` on node ``d // gpus_per_node``.

Execution engines: :meth:`CostModel.with_engines` gives the same cost model with its op times as a
plan's engines run them (the rules of :mod:`.engines`); without engines, a prefill or decode step is
that of a CUDA-graph engine and forward, backward and optimizer steps are our kernels'.

Groups given by size only (the tp group of a compute op, the tp x pp devices of a
generation instance) are assumed to be packed onto consecutive devices: they talk over
NVLink when they fit on one node, else over the NICs.

Expert parallelism (mixture-of-experts models, :mod:`.llama`): the op and memory methods take
``ep``, the expert-parallel degree of the layout (default 1: none). Its ep ranks are carved from
the data-parallel group (as in Megatron-core): consecutive dp replicas. A training pass's
all-to-alls run over NVLink when the group's members lie within a node's worth of consecutive
devices, else over the NICs (alpha-beta, :func:`harness.costmodel.comm.alltoall_s`; no all-to-all
was measured), timed as the tp all-reduces are and added where they are. The span comes from the
layout's device order (:attr:`harness.core.plan.Allocation.ep_span`): ``ep * tp`` in
Megatron-core's order, pipeline outermost, which the plans of verl and NeMo-RL on Megatron-core
take (:meth:`~harness.core.plan.Allocation.pipeline_outermost`, ``baselines/refit.py``); across
the pipeline's stages too where a replica's stages sit side by side (the plain order the other
plans keep). A generation instance's group is ``ep`` instances of ``tp * pp`` devices side by
side. ``ep > 1`` on a dense model, or an ``ep`` that does not divide its experts, raises PlanError.

Speed: the generation simulator calls :meth:`CostModel.decode_step_s` ~1e5 times per
simulated iteration. Configs are read once in the constructor into plain dataclasses; models
go through :meth:`ModelDims.of` (identity-cached) and the counts derived from them are
memoised, so a call is a handful of float operations.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Optional, Sequence

import numpy as np

from harness.core.config import GpuConfig, LinkConfig
from harness.costmodel import comm, memory
from harness.costmodel.calibrated import CalibratedCompute, Calibration
from harness.costmodel.compute import Roofline
from harness.costmodel.engines import EngineCosts
from harness.costmodel.llama import ModelDims, expert_parallel_problem
from harness.costmodel.memory import max_stage_params, updated_params_per_device
from harness.costmodel.profile import ProfileTable
from harness.errors import PlanError


# Bound of the op-time memo (entries; ~200 bytes each): cleared when full, which only costs recomputation.
MEMO_MAX_ENTRIES = 1 << 20


def _memoised(method):
    """Memoise a compute-time method of :class:`CostModel` on its arguments.

    Planners ask for the same op times over and over: the generation task model asks for
    ~1e5-1e7 decode steps per plan, mostly repeats (migration replays, candidate layouts sharing
    a tp x pp; 6x fewer evaluations on RLHFuse 13B, 40x at 4,096 GPUs), and streaming inference
    re-times the same micro-batches. A cost model is immutable once built, so a memo keyed on the
    arguments is exact. The model config is keyed by its :class:`ModelDims` record's identity
    (the record is kept alive beside the memo, so an id is never reused while cached)."""
    name = method.__name__

    @functools.wraps(method)
    def memoised(self, model: Any, *args: Any, **kwargs: Any) -> float:
        d = ModelDims.of(model)
        key = (name, id(d), args, tuple(kwargs.items())) if kwargs else (name, id(d), args)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = method(self, d, *args, **kwargs)
            self._memo_dims[id(d)] = d
            if len(self._memo) > MEMO_MAX_ENTRIES:
                self._memo.clear()
        return hit

    return memoised


class CostModel:
    """Times (seconds) and footprints (GB) of RLHF ops on ``cluster``, for ``workload``."""

    def __init__(self, cluster: Any, workload: Any, profile: Optional[ProfileTable] = None):
        # the rules of a plan's execution engines (with_engines); None: our kernels' op times as they are
        self.engine_costs: Optional[EngineCosts] = None
        self.name = str(cluster.name)
        self.num_nodes = int(cluster.num_nodes)
        self.gpus_per_node = int(cluster.gpus_per_node)
        self.num_devices = self.num_nodes * self.gpus_per_node
        g = cluster.gpu
        self.gpu = GpuConfig(
            name=str(g.name),
            peak_bf16_tflops=float(g.peak_bf16_tflops),
            hbm_gb=float(g.hbm_gb),
            hbm_bandwidth_gbps=float(g.hbm_bandwidth_gbps),
            matmul_efficiency_frac=float(g.matmul_efficiency_frac),
            memory_efficiency_frac=float(g.memory_efficiency_frac),
            usable_memory_frac=float(g.usable_memory_frac),
        )
        self.intra_node = comm.plain_link(cluster.intra_node)
        self.inter_node = comm.plain_link(cluster.inter_node)
        self.host_to_device = comm.plain_link(cluster.host_to_device)
        self._multi_node_links: dict[int, LinkConfig] = {}
        self._memo: dict[tuple, float] = {}  # answers of the @_memoised methods
        self._memo_dims: dict[int, ModelDims] = {}
        self.host_memory_gb = float(cluster.host_memory_gb)
        self.recompute = str(workload.activation_recompute)
        if self.recompute not in memory.RECOMPUTE_MODES:
            raise ValueError(
                f"workload.activation_recompute must be one of {memory.RECOMPUTE_MODES}, "
                f"not {self.recompute!r}"
            )
        self.profile = profile
        self.kind = str(getattr(cluster, "cost_model", "roofline"))
        self.calibration: Optional[Calibration] = None
        if self.kind == "calibrated":
            name = getattr(cluster, "calibration", None)
            if not name:
                raise ValueError("cluster.cost_model=calibrated needs cluster.calibration "
                                 "(h100, a100 or a path to a fitted JSON file)")
            self.calibration = Calibration.load(str(name))
        elif self.kind != "roofline":
            raise ValueError(f"cluster.cost_model must be roofline or calibrated, not {self.kind!r}")
        # The datasheet roofline is always available (the calibration report compares with it).
        self.roofline = Roofline(self.gpu, allreduce_s=self._packed_allreduce_s,
                                 p2p_s=self._packed_p2p_s, alltoall_s=self._packed_alltoall_s)
        self.compute = self.roofline
        if self.calibration is not None:
            self.compute = CalibratedCompute(self.calibration, self.gpu.peak_bf16_tflops,
                                             allreduce_s=self._packed_allreduce_s,
                                             p2p_s=self._packed_p2p_s, alltoall_s=self._packed_alltoall_s)

    def with_engines(self, engines: Any, gen_gather_s: float = 0.0) -> "CostModel":
        """This cost model with every op timed as ``engines`` (:class:`harness.core.engines.Engines`,
        fitted constants resolved) run it, ``gen_gather_s`` the all-gather of the actor's weights at
        every generation step (:class:`harness.costmodel.engines.EngineCosts`). A shallow copy: it
        shares this model's configs and op memo; memory, links and collectives are unchanged."""
        plain = self if self.engine_costs is None else self.engine_costs.base
        view = copy.copy(plain)
        view.engine_costs = EngineCosts(plain, engines, gen_gather_s)
        return view

    @property
    def identity(self) -> str:
        """Which cost model times ops: ``roofline`` or ``calibrated (<source>)``."""
        if self.calibration is None:
            return "roofline (datasheet)"
        return f"calibrated ({self.calibration.source})"

    # -- links ----------------------------------------------------------------------------

    def _link_for_size(self, group_size: int) -> Any:
        return self.intra_node if group_size <= self.gpus_per_node else self.inter_node

    def _packed_allreduce_s(self, num_bytes: float, n: int) -> float:
        if n <= 1 or num_bytes <= 0:
            return 0.0
        if n <= self.gpus_per_node and self.calibration is not None:
            curve = self.calibration.all_reduce.get(n)
            if curve is not None:
                return curve(num_bytes)
        return comm.allreduce_s(num_bytes, n, self._link_for_size(n))

    def _packed_alltoall_s(self, num_bytes: float, ep: int, span: int) -> float:
        """One all-to-all over an expert-parallel group of ``ep`` ranks, each holding ``num_bytes``,
        whose members lie among ``span`` consecutive devices: NVLink when those fit on one node, else
        the per-GPU NIC (module docstring)."""
        if ep <= 1 or num_bytes <= 0:
            return 0.0
        return comm.alltoall_s(num_bytes, ep, self._link_for_size(span))

    def alltoall_s(self, num_bytes: float, ep: int, span: int) -> float:
        """Public form of the all-to-all timing the op methods use (:meth:`_packed_alltoall_s`)."""
        return self._packed_alltoall_s(num_bytes, ep, span)

    @staticmethod
    def check_expert_parallel(model: Any, ep: int) -> None:
        """PlanError when ``model`` cannot run at expert-parallel degree ``ep``
        (:func:`~harness.costmodel.llama.expert_parallel_problem`)."""
        if ep != 1:
            problem = expert_parallel_problem(model, ep)
            if problem:
                raise PlanError(problem)

    def _packed_p2p_s(self, num_bytes: float, group_size: int) -> float:
        if self.calibration is not None:
            return self.transfer_s(num_bytes, intra_node=group_size <= self.gpus_per_node)
        return comm.p2p_s(num_bytes, self._link_for_size(group_size))

    def transfer_s(self, num_bytes: float, intra_node: bool) -> float:
        """One point-to-point send of ``num_bytes`` inside a node or between two nodes: the
        measured NCCL send/recv curve when calibrated, else alpha-beta over the tier."""
        if num_bytes <= 0:
            return 0.0
        if self.calibration is not None:
            curve = (self.calibration.send_recv_intra if intra_node
                     else self.calibration.send_recv_inter)
            if curve is not None:
                return curve(num_bytes)
        link = self.intra_node if intra_node else self.inter_node
        return link.latency_us * 1e-6 + num_bytes / (link.bandwidth_gbps * 1e9 * link.efficiency_frac)

    def link_between(self, src: int, dst: int) -> Any:
        """The link a transfer from device ``src`` to device ``dst`` uses."""
        if src // self.gpus_per_node == dst // self.gpus_per_node:
            return self.intra_node
        return self.inter_node

    def link_for_group(self, device_ids: Sequence[int]) -> Any:
        """Effective link of a ring collective over ``device_ids``.

        On one node: NVLink. Across nodes: NCCL runs one ring channel per NIC, and on a
        rail-optimised fabric each of the group's ``g`` GPUs on a node drives its own NIC, so the
        ``g`` channels cross node boundaries in parallel while their intra-node hops ride NVLink.
        The effective bandwidth is ``min(NVLink, g x NIC)`` (our reading of NCCL's ring/channel
        design; e.g. a full-node group on 8 x 200 Gb/s sees ~8 x 25 GB/s). A group with one GPU
        per node (a dp group with tp = 8) gets one NIC."""
        per_node: dict[int, int] = {}
        for d in device_ids:
            if not 0 <= d < self.num_devices:
                raise ValueError(f"device id {d} outside the cluster's {self.num_devices} devices")
            node = d // self.gpus_per_node
            per_node[node] = per_node.get(node, 0) + 1
        if len(per_node) <= 1:
            return self.intra_node
        return self._multi_node_link(max(per_node.values()))

    def _multi_node_link(self, gpus_per_node_in_group: int) -> Any:
        link = self._multi_node_links.get(gpus_per_node_in_group)
        if link is None:
            nic = self.inter_node.bandwidth_gbps * self.inter_node.efficiency_frac
            nvlink = self.intra_node.bandwidth_gbps * self.intra_node.efficiency_frac
            link = LinkConfig(bandwidth_gbps=min(nvlink, gpus_per_node_in_group * nic),
                              latency_us=self.inter_node.latency_us, efficiency_frac=1.0)
            self._multi_node_links[gpus_per_node_in_group] = link
        return link

    # -- communication --------------------------------------------------------------------

    def p2p_s(self, num_bytes: float, src: int, dst: int) -> float:
        if src == dst:
            return 0.0
        if self.calibration is not None:
            return self.transfer_s(num_bytes, src // self.gpus_per_node == dst // self.gpus_per_node)
        return comm.p2p_s(num_bytes, self.link_between(src, dst))

    def allreduce_s(self, num_bytes: float, device_ids: Sequence[int]) -> float:
        """All-reduce of a ``num_bytes`` buffer held by every device of the group: the measured
        NCCL curve for a one-node group of a measured size when calibrated, else a ring over
        the group's link."""
        link = self.link_for_group(device_ids)
        if link is self.intra_node and len(device_ids) <= self.gpus_per_node:
            return self._packed_allreduce_s(num_bytes, len(device_ids))
        return comm.allreduce_s(num_bytes, len(device_ids), link)

    def allgather_s(self, num_bytes: float, device_ids: Sequence[int]) -> float:
        """Ring all-gather whose gathered output is ``num_bytes``."""
        return comm.allgather_s(num_bytes, len(device_ids), self.link_for_group(device_ids))

    def reduce_scatter_s(self, num_bytes: float, device_ids: Sequence[int]) -> float:
        """Ring reduce-scatter of a ``num_bytes`` input."""
        return comm.reduce_scatter_s(num_bytes, len(device_ids), self.link_for_group(device_ids))

    def host_transfer_s(self, num_bytes: float) -> float:
        """Host <-> device copy of ``num_bytes`` over PCIe (offload / reload)."""
        return comm.p2p_s(num_bytes, self.host_to_device)

    # -- compute --------------------------------------------------------------------------

    def _profiled(self, op: str, d: ModelDims, tp: int, num_tokens: float) -> Optional[float]:
        if self.profile is None:
            return None
        return self.profile.lookup(op, d.name, tp, num_tokens)

    def forward_s(self, model: Any, num_tokens: float, seq_len: float, tp: int = 1,
                  num_layers: Optional[float] = None,
                  include_head: Optional[bool] = None, ep: int = 1, ep_span: Optional[int] = None,
                  etp: Optional[int] = None) -> float:
        """Forward of ``num_tokens`` tokens in causal sequences of ``seq_len`` through
        ``num_layers`` layers (a pipeline stage; all when ``None``). A profiled whole-model
        time is scaled by ``num_layers / model.num_layers``. ``ep``: the layout's expert
        parallelism, ``ep_span``: the devices its ep group lies among, which set the link of the
        all-to-alls (:attr:`harness.core.plan.Allocation.ep_span`; None: ``ep * tp``); ``etp``: its
        expert tensor parallelism (:attr:`harness.core.plan.ParallelStrategy.etp`; None: ``tp``)."""
        if self.engine_costs is not None:
            return self.engine_costs.forward_s(model, num_tokens, seq_len, tp, num_layers, include_head, ep, ep_span,
                                               etp)
        if ep != 1:
            self.check_expert_parallel(model, ep)
            return self._forward_s(model, num_tokens, seq_len, tp, num_layers, include_head, ep, ep_span, etp)
        return self._forward_s(model, num_tokens, seq_len, tp, num_layers, include_head)

    @_memoised
    def _forward_s(self, model: Any, num_tokens: float, seq_len: float, tp: int = 1,
                   num_layers: Optional[float] = None, include_head: Optional[bool] = None,
                   ep: int = 1, ep_span: Optional[int] = None, etp: Optional[int] = None) -> float:
        d = ModelDims.of(model)
        measured = self._profiled("forward", d, tp, num_tokens)
        if measured is not None:
            return measured * _layer_frac(d, num_layers)
        if ep != 1:
            return self.compute.forward_s(d, num_tokens, seq_len / 2.0, tp, num_layers, include_head, ep, ep_span,
                                          etp)
        return self.compute.forward_s(d, num_tokens, seq_len / 2.0, tp, num_layers,
                                      include_head)

    def backward_s(self, model: Any, num_tokens: float, seq_len: float, tp: int = 1,
                   num_layers: Optional[float] = None, include_head: Optional[bool] = None,
                   recompute: Optional[str] = None, ep: int = 1, ep_span: Optional[int] = None,
                   etp: Optional[int] = None) -> float:
        """Backward (with the workload's activation recomputation unless ``recompute``); ``ep``,
        ``ep_span``, ``etp`` as in :meth:`forward_s`."""
        if self.engine_costs is not None:
            return self.engine_costs.backward_s(model, num_tokens, seq_len, tp, num_layers, include_head, recompute,
                                                ep, ep_span, etp)
        if ep != 1:
            self.check_expert_parallel(model, ep)
            return self._backward_s(model, num_tokens, seq_len, tp, num_layers, include_head, recompute, ep, ep_span,
                                    etp)
        return self._backward_s(model, num_tokens, seq_len, tp, num_layers, include_head, recompute)

    @_memoised
    def _backward_s(self, model: Any, num_tokens: float, seq_len: float, tp: int = 1,
                    num_layers: Optional[float] = None, include_head: Optional[bool] = None,
                    recompute: Optional[str] = None, ep: int = 1, ep_span: Optional[int] = None,
                    etp: Optional[int] = None) -> float:
        d = ModelDims.of(model)
        measured = self._profiled("backward", d, tp, num_tokens)
        if measured is not None:
            return measured * _layer_frac(d, num_layers)
        if ep != 1:
            return self.compute.backward_s(d, num_tokens, seq_len / 2.0, tp, num_layers, include_head,
                                           recompute or self.recompute, ep, ep_span, etp)
        return self.compute.backward_s(d, num_tokens, seq_len / 2.0, tp, num_layers,
                                       include_head, recompute or self.recompute)

    def prefill_s(self, model: Any, num_tokens: float, tp: int = 1, pp: int = 1,
                  seq_len: Optional[float] = None, ep: int = 1) -> float:
        """Prefill of ``num_tokens`` prompt tokens (sequences of ``seq_len``, default one)
        on a tp x pp generation instance (a CUDA-graph engine's, without engines; see :mod:`.calibrated`),
        one of ``ep`` expert-parallel instances (a MoE model's)."""
        if self.engine_costs is not None:
            return self.engine_costs.prefill_s(model, num_tokens, tp, pp, seq_len, ep)
        if ep != 1:
            self.check_expert_parallel(model, ep)
            return self._prefill_s(model, num_tokens, tp, pp, seq_len, ep)
        return self._prefill_s(model, num_tokens, tp, pp, seq_len)

    @_memoised
    def _prefill_s(self, model: Any, num_tokens: float, tp: int = 1, pp: int = 1,
                   seq_len: Optional[float] = None, ep: int = 1) -> float:
        d = ModelDims.of(model)
        if self.profile is not None and num_tokens > 0:
            # Same steady-state pipeline rule as decode_step_s, micro-batches of whole
            # sequences.
            num_seqs = 1.0 if seq_len is None else num_tokens / min(seq_len, num_tokens)
            mb = num_tokens / max(1.0, min(pp, num_seqs))
            measured = self.profile.lookup("prefill", d.name, tp, mb)
            if measured is not None:
                return measured + self._pp_hops_s(d, mb, tp, pp)
        if self.calibration is not None:
            if ep != 1:
                return self.compute.prefill_s(d, num_tokens, tp, pp, seq_len, ep)
            return self.compute.prefill_s(d, num_tokens, tp, pp, seq_len)
        if ep != 1:
            return self.roofline.prefill_s(d, num_tokens, tp, pp, seq_len, ep)
        return self.roofline.prefill_s(d, num_tokens, tp, pp, seq_len)

    def decode_step_s(self, model: Any, batch_size: int, context_tokens_total: float,
                      tp: int = 1, pp: int = 1, ep: int = 1) -> float:
        """One decode step of ``batch_size`` samples whose caches hold
        ``context_tokens_total`` tokens in all, on a tp x pp generation instance (one of ``ep``
        expert-parallel instances stepping together, for a MoE model). A
        profiled time (measured at pp = 1 for the micro-batch size) stands for the
        ``pp`` stage times of a step (see :mod:`.compute`); the pipeline hops are added."""
        if self.engine_costs is not None:
            return self.engine_costs.decode_step_s(model, batch_size, context_tokens_total, tp, pp, ep)
        if ep != 1:
            self.check_expert_parallel(model, ep)
            return self._decode_step_s(model, batch_size, context_tokens_total, tp, pp, ep)
        return self._decode_step_s(model, batch_size, context_tokens_total, tp, pp)

    @_memoised
    def _decode_step_s(self, model: Any, batch_size: int, context_tokens_total: float,
                       tp: int = 1, pp: int = 1, ep: int = 1) -> float:
        d = ModelDims.of(model)
        if self.profile is not None and batch_size > 0:
            mb = batch_size / min(pp, batch_size)
            measured = self.profile.lookup("decode_step", d.name, tp, mb)
            if measured is not None:
                return measured + self._pp_hops_s(d, mb, tp, pp)
        if self.calibration is not None:
            if ep != 1:
                return self.compute.decode_step_s(d, batch_size, context_tokens_total, tp, pp, ep)
            return self.compute.decode_step_s(d, batch_size, context_tokens_total, tp, pp)
        if ep != 1:
            return self.roofline.decode_step_s(d, batch_size, context_tokens_total, tp, pp, ep)
        return self.roofline.decode_step_s(d, batch_size, context_tokens_total, tp, pp)

    def decode_steps_s(self, model: Any, batch_sizes: np.ndarray, context_totals: np.ndarray, tp: int = 1,
                       pp: int = 1, ep: int = 1) -> Optional[np.ndarray]:
        """:meth:`decode_step_s` of many steps at once, elementwise and bit for bit: step ``i`` of
        ``batch_sizes[i]`` (positive) samples holding ``context_totals[i]`` context tokens (integer
        arrays). The calibrated model's (and its engines') steps only; None for a profile table or
        the roofline, whose steps a caller then asks for one span at a time."""
        if self.engine_costs is not None:
            return self.engine_costs.decode_steps_s(model, batch_sizes, context_totals, tp, pp, ep)
        if self.profile is not None or self.calibration is None:
            return None
        if ep != 1:
            self.check_expert_parallel(model, ep)
        return self.compute.decode_steps_s(ModelDims.of(model), batch_sizes, context_totals, tp, pp, ep)

    def prefills_s(self, model: Any, num_tokens: np.ndarray, tp: int = 1, pp: int = 1,
                   ep: int = 1) -> Optional[np.ndarray]:
        """:meth:`prefill_s` of many prefills of one sequence each at once, elementwise and bit for
        bit (``num_tokens``: positive integer token counts). The calibrated model's (and its
        engines') only; None for a profile table or the roofline, whose prefills a caller then asks
        for one at a time."""
        if self.engine_costs is not None:
            return self.engine_costs.prefills_s(model, num_tokens, tp, pp, ep)
        if self.profile is not None or self.calibration is None:
            return None
        if ep != 1:
            self.check_expert_parallel(model, ep)
        return self.compute.prefills_s(ModelDims.of(model), num_tokens, tp, pp, ep)

    def decode_span_s(self, model: Any, batch_size: int, context_tokens_total: int, num_steps: int,
                      tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[float, ...]:
        """The :meth:`decode_step_s` times of ``num_steps`` consecutive steps of one batch, each
        step adding a token to every sample: contexts ``c, c + b, c + 2b, ...``. One memo hit
        per span instead of one per step (the generation task model's inner loop); the
        calibrated model times a span in one pass."""
        if self.engine_costs is not None:
            return self.engine_costs.decode_span_s(model, batch_size, context_tokens_total, num_steps, tp, pp, ep)
        if ep != 1:
            self.check_expert_parallel(model, ep)
            return self._decode_span_s(model, batch_size, context_tokens_total, num_steps, tp, pp, ep)
        return self._decode_span_s(model, batch_size, context_tokens_total, num_steps, tp, pp)

    @_memoised
    def _decode_span_s(self, model: Any, batch_size: int, context_tokens_total: int, num_steps: int,
                       tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[float, ...]:
        if self.profile is None and self.calibration is not None:
            if ep != 1:
                return tuple(self.compute.decode_span_s(model, batch_size, context_tokens_total, num_steps, tp, pp,
                                                        ep))
            return tuple(self.compute.decode_span_s(model, batch_size, context_tokens_total, num_steps, tp, pp))
        if ep != 1:
            return tuple(self._decode_step_s(model, batch_size, context_tokens_total + j * batch_size, tp, pp, ep)
                         for j in range(num_steps))
        return tuple(self._decode_step_s(model, batch_size, context_tokens_total + j * batch_size, tp, pp)
                     for j in range(num_steps))

    def _pp_hops_s(self, d: ModelDims, mb_tokens: float, tp: int, pp: int) -> float:
        if pp <= 1:
            return 0.0
        return (pp - 1) * self._packed_p2p_s(mb_tokens * d.hidden_size * 2, tp * pp)

    def optimizer_step_s(self, model: Any, dp: int = 1, tp: int = 1, pp: int = 1,
                         zero_stage: int = 0, ep: int = 1, etp: Optional[int] = None) -> float:
        """Adam step on the most loaded device: its stage's parameters / tp, further / dp
        when ZeRO (any stage >= 1) shards the optimizer states; a MoE model's routed experts
        / (ep * etp), sharded over the ranks holding the same experts
        (:func:`~harness.costmodel.memory.updated_params_per_device`)."""
        if self.engine_costs is not None:
            return self.engine_costs.optimizer_step_s(model, dp, tp, pp, zero_stage, ep, etp)
        d = ModelDims.of(model)
        self.check_expert_parallel(d, ep)
        params = updated_params_per_device(d, dp, tp, pp, zero_stage, ep, etp)
        measured = self._profiled("optimizer_step", d, tp, 0)
        if measured is not None:  # measured for the whole model on tp ranks: scale by params
            return measured * params * tp / max_stage_params(d, 1)
        return self.compute.optimizer_step_s(params)

    # -- memory ---------------------------------------------------------------------------

    @property
    def hbm_capacity_gb(self) -> float:
        """HBM a plan may fill per device: ``hbm_gb * usable_memory_frac``."""
        return self.gpu.hbm_gb * self.gpu.usable_memory_frac

    def weights_gb(self, model: Any, tp: int = 1, pp: int = 1, dtype_bytes: int = 2, ep: int = 1,
                   etp: Optional[int] = None) -> float:
        """Weights on one device of a tp x pp layout (a MoE model's routed experts split over ``ep``,
        each over ``etp``; None: ``tp``)."""
        d = ModelDims.of(model)
        self.check_expert_parallel(d, ep)
        return memory.weights_gb(d, tp, pp, dtype_bytes, ep, etp)

    def expert_weights_gb(self, model: Any, tp: int = 1, pp: int = 1, ep: int = 1,
                          etp: Optional[int] = None) -> float:
        """The routed-expert part of :meth:`weights_gb` (0 for a dense model)."""
        return memory.expert_weights_gb(ModelDims.of(model), tp, pp, ep, etp=etp)

    def training_state_gb(self, model: Any, dp: int = 1, tp: int = 1, pp: int = 1,
                          zero_stage: int = 0, optimizer_offload: bool = False, ep: int = 1,
                          etp: Optional[int] = None) -> float:
        d = ModelDims.of(model)
        self.check_expert_parallel(d, ep)
        return memory.training_state_gb(d, dp, tp, pp, zero_stage, optimizer_offload, ep, etp)

    def activation_gb(self, model: Any, micro_batch_size: float, seq_len: float, tp: int = 1,
                      num_layers: Optional[float] = None, recompute: Optional[str] = None,
                      include_logits: bool = False, fused_attention: bool = False) -> float:
        """Activations of one micro-batch (workload's recomputation unless ``recompute``)."""
        return memory.activation_gb(ModelDims.of(model), micro_batch_size, seq_len, tp,
                                    num_layers, recompute or self.recompute, include_logits, fused_attention)

    def kv_cache_gb(self, model: Any, num_tokens: float, tp: int = 1, pp: int = 1) -> float:
        return memory.kv_cache_gb(ModelDims.of(model), num_tokens, tp, pp)


def _layer_frac(d: ModelDims, num_layers: Optional[float]) -> float:
    return 1.0 if num_layers is None else num_layers / d.num_layers
