"""Strategy enumeration and the generic best-of search that planners share.

- :func:`candidate_strategies`: every (dp, tp, pp) over a mesh of N devices with tp dividing the
  GPUs of a node (tensor parallelism stays on NVLink, Megatron-LM practice) and the models' heads
  (:func:`tp_splits_heads`), and pp within the model's layers; for mixture-of-experts models also
  every expert-parallel degree of :func:`ep_options` (dense models: exactly the (dp, tp, pp) set);
- :func:`mesh_options` / :func:`strategy_options`: ReaLHF's per-call search space (aligned slices
  of a node or ranges of whole nodes; strategies filling them, training ones splitting the
  mini-batch into micro-batches per replica);
- :func:`parse_layout`: a pinned ``dp<D>tp<T>pp<P>`` (``ep<E>`` after it: expert parallelism) from the
  command line;
- :func:`check_expert_parallel`: every task's ep fits its model (a mixture of experts whose experts
  ep divides; 1 for a dense model);
- :func:`search`: score every candidate, skip infeasible ones (PlanError), keep the fastest, and
  say why none fit when none does, naming the smallest memory requirement among them
  (:class:`harness.planning.memory.MemoryShortfall`).
"""
from __future__ import annotations

import bisect
from collections import abc
import itertools
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from harness.costmodel.llama import ModelDims, expert_parallel_problem
from harness.errors import PlanError
from harness.core.plan import ParallelStrategy
from harness.planning.memory import MemoryShortfall, NoLayoutFits

_LAYOUT_RE = re.compile(r"^dp(\d+)tp(\d+)pp(\d+)(?:ep(\d+)(?:etp(\d+))?)?$")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_layout(text: str, zero_stage: int, what: str) -> ParallelStrategy:
    """A pinned layout ``dp<D>tp<T>pp<P>``, optionally followed by ``ep<E>`` (expert parallelism of a
    mixture-of-experts model, carved from dp: E divides D) and then ``etp<X>`` (expert tensor
    parallelism: E*X divides D*T), as ``str(ParallelStrategy)`` writes it."""
    m = _LAYOUT_RE.match(text.strip())
    if not m:
        raise PlanError(f"system.layouts.{what}={text!r}: expected the form dp<D>tp<T>pp<P>, e.g. dp32tp8pp1, "
                        f"optionally with ep<E> for expert parallelism, e.g. dp32tp4pp1ep8, and etp<X> after it "
                        f"for expert tensor parallelism, e.g. dp16tp2pp1ep8etp1")
    dp, tp, pp = (int(g) for g in m.groups()[:3])
    ep = int(m.group(4)) if m.group(4) is not None else 1
    etp = int(m.group(5)) if m.group(5) is not None else None
    try:
        return ParallelStrategy(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, ep=ep, etp=etp)
    except PlanError as e:
        raise PlanError(f"system.layouts.{what}={text!r}: {e}") from None


def tp_splits_heads(tp: int, models: Sequence[Any] = ()) -> bool:
    """Tensor parallelism of degree ``tp`` can shard every model in ``models``: it splits the query
    heads evenly, and the KV heads evenly or replicates them (``tp`` a multiple of the KV heads, as
    Megatron-LM and vLLM do under grouped-query attention)."""
    return all(m.num_heads % tp == 0 and (m.num_kv_heads % tp == 0 or tp % m.num_kv_heads == 0)
               for m in models)


def largest_tp(gpus_per_node: int, models: Sequence[Any] = (), num_devices: int | None = None) -> int:
    """The largest tensor-parallel degree that divides a node's GPUs (and ``num_devices``) and shards
    every model in ``models`` (1 always does): the default of systems that fill a node with tp."""
    return max(tp for tp in divisors(gpus_per_node)
               if tp_splits_heads(tp, models) and (num_devices is None or num_devices % tp == 0))


def ep_options(dp: int, gpus_per_node: int, models: Sequence[Any] = ()) -> list[int]:
    """Expert-parallel degrees a search tries at data parallelism ``dp``: 1, and for models that are
    all mixtures of experts, the powers of two up to a node's GPUs that divide ``dp`` and every
    model's routed experts (Megatron-core's conditions: ep divides dp and num_experts).

    The bound keeps the search small (at most ``log2(gpus_per_node) + 1`` degrees per (dp, tp, pp):
    1, 2, 4, 8 on 8-GPU nodes, so at most 4x the dense candidates) and where expert parallelism pays:
    beyond a node's GPUs the group's all-to-alls leave NVLink for the NICs on every MoE layer, while
    the memory it saves (the routed experts / ep) is already most of what it can save at 8 (7/8 of
    the experts). Powers of two: the experts counts of released MoE models (64, 128, 256) are."""
    return [1, *_moe_ep_degrees(dp, gpus_per_node, models)]


def _moe_ep_degrees(ranks: int, gpus_per_node: int, models: Sequence[Any]) -> list[int]:
    """The powers of two from 2 up to a node's GPUs that divide ``ranks`` and every model's routed
    experts; none unless the models are all mixtures of experts."""
    dims = [ModelDims.of(m) for m in models]
    if not dims or not all(d.is_moe for d in dims):
        return []
    out, ep = [], 2
    while ep <= gpus_per_node:
        if ranks % ep == 0 and all(d.num_experts % ep == 0 for d in dims):
            out.append(ep)
        ep *= 2
    return out


def expert_tp_options(dp: int, tp: int, gpus_per_node: int, models: Sequence[Any] = ()) -> list[int]:
    """Expert-parallel degrees a search tries at expert tensor parallelism 1 beside ``tp > 1`` (Megatron-
    core's ``expert_tensor_parallel_size=1``: ep folded over dp x tp): the powers of two from 2 up to a
    node's GPUs that divide ``dp * tp`` and every model's routed experts, so that a domain of ``ep``
    consecutive ranks stays in a node, as :func:`ep_options` keeps its groups. None at tp = 1 (there
    etp = 1 is the plain layout) or for dense models."""
    return _moe_ep_degrees(dp * tp, gpus_per_node, models) if tp > 1 else []


def candidate_strategies(num_devices: int, gpus_per_node: int, num_layers: int, zero_stage: int = 0,
                         max_pp: int = 32, models: Sequence[Any] = (),
                         expert_parallel: bool = True) -> Iterable[ParallelStrategy]:
    """Layouts of ``num_devices``; with ``models``, only tensor-parallel degrees that shard their heads,
    and, when they are mixtures of experts (and ``expert_parallel``), each (dp, tp, pp) with every
    expert-parallel degree of :func:`ep_options` (ep = 1 first), then, where tp > 1, with every degree of
    :func:`expert_tp_options` at expert tensor parallelism 1 (each expert whole on one rank, as
    NeMo-RL's MoE recipes set it). Dense models: the (dp, tp, pp) alone."""
    moe = expert_parallel and bool(models) and all(ModelDims.of(m).is_moe for m in models)
    for tp in divisors(gpus_per_node):
        if num_devices % tp or not tp_splits_heads(tp, models):
            continue
        for pp in divisors(num_devices // tp):
            if pp > min(num_layers, max_pp):
                continue
            dp = num_devices // (tp * pp)
            yield ParallelStrategy(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage)
            if moe:
                for ep in ep_options(dp, gpus_per_node, models)[1:]:
                    yield ParallelStrategy(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, ep=ep)
                for ep in expert_tp_options(dp, tp, gpus_per_node, models):
                    yield ParallelStrategy(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, ep=ep, etp=1)


class MeshOptions(abc.Sequence):
    """ReaLHF's meshes, in a fixed order: every contiguous aligned slice of one node (sizes dividing
    the node, smaller than it), node by node, then every range of whole nodes, by first node and
    length. A sequence made on demand: at 512 nodes it holds 138,496 meshes, most of them thousands
    of devices long, and a search draws a few hundred (building them took ~10 CPU s)."""

    def __init__(self, num_nodes: int, gpus_per_node: int):
        self.num_nodes, self.gpus_per_node = num_nodes, gpus_per_node
        self._slices = [(size, offset) for size in divisors(gpus_per_node)[:-1]
                        for offset in range(0, gpus_per_node, size)]
        self._num_slices = num_nodes * len(self._slices)
        # first index of each start node's ranges (node s has num_nodes - s of them)
        self._range_starts = list(itertools.accumulate((num_nodes - s for s in range(num_nodes)), initial=0))

    def __len__(self) -> int:
        return self._num_slices + self._range_starts[-1]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"mesh option {index} of {len(self)}")
        per_node = self.gpus_per_node
        if index < self._num_slices:
            node, k = divmod(index, len(self._slices))
            size, offset = self._slices[k]
            base = node * per_node + offset
            return tuple(range(base, base + size))
        k = index - self._num_slices
        start = bisect.bisect_right(self._range_starts, k) - 1
        length = k - self._range_starts[start] + 1
        return tuple(range(start * per_node, (start + length) * per_node))


def mesh_options(num_nodes: int, gpus_per_node: int) -> MeshOptions:
    """Contiguous aligned slices of one node (sizes dividing the node) and ranges of whole nodes."""
    return MeshOptions(num_nodes, gpus_per_node)


def strategy_options(mesh_size: int, gpus_per_node: int, num_layers: int, train: bool, mini_batch: int,
                     micro_batch: int, zero_stage: int, models: Sequence[Any] = ()) -> list[ParallelStrategy]:
    out = []
    for tp in divisors(min(mesh_size, gpus_per_node)):
        if gpus_per_node % tp or mesh_size % tp or not tp_splits_heads(tp, models):
            continue
        for pp in divisors(mesh_size // tp):
            dp = mesh_size // (tp * pp)
            if pp > num_layers or (train and mini_batch % (dp * micro_batch)):
                continue
            out.append(ParallelStrategy(dp, tp, pp, zero_stage if train else 0))
    return out


@dataclass
class SearchResult:
    strategy: ParallelStrategy
    time_s: float
    num_candidates: int


def smallest_requirement(shortfalls: list[tuple[object, MemoryShortfall]]) -> str:
    """``; the smallest requirement: <candidate> needs X GB per device (...) but only Y GB is usable``."""
    if not shortfalls:
        return ""
    what, e = min(shortfalls, key=lambda x: x[1].need_gb)
    return (f"; the smallest requirement: {what} needs {e.need_gb:.1f} GB per device ({e.terms}) "
            f"but only {e.capacity_gb:.1f} GB is usable")


def search(candidates: Iterable[ParallelStrategy], score: Callable[[ParallelStrategy], float], what: str,
           system: str = "rlhfuse_base") -> SearchResult:
    """The fastest candidate by ``score``; a candidate whose score raises PlanError is infeasible.
    When none is feasible the error names the smallest memory requirement among the candidates that
    did not fit (a :class:`~harness.planning.memory.MemoryShortfall` raised by ``score``)."""
    best: tuple[float, ParallelStrategy] | None = None
    tried, reasons, shortfalls = 0, [], []
    for strategy in candidates:
        tried += 1
        try:
            t = score(strategy)
        except PlanError as e:  # infeasible candidate: skip, remember why
            reasons.append(f"{strategy}: {e}")
            if isinstance(e, MemoryShortfall):
                shortfalls.append((strategy, e))
            continue
        if best is None or t < best[0]:
            best = (t, strategy)
    if best is None:
        detail = "; ".join(reasons[:3])
        error = NoLayoutFits if shortfalls and len(shortfalls) == len(reasons) else PlanError
        raise error(f"{system}: no feasible parallel strategy for {what} among {tried} candidates"
                    f"{smallest_requirement(shortfalls)} ({detail})")
    return SearchResult(best[1], best[0], tried)


def check_expert_parallel(plan: Any, models: Any) -> None:
    """Every task's (and weight movement's) expert-parallel degree fits its model
    (:func:`harness.costmodel.llama.expert_parallel_problem`: ep > 1 only on a mixture-of-experts
    model whose experts it divides), and a generate task with ep > 1 does not migrate its long tail
    (migration releases instances whose devices hold experts the tail still needs). PlanError naming
    the task otherwise."""
    for task in plan.tasks:
        ep = task.allocation.strategy.ep
        model = getattr(models, task.model.value)
        problem = expert_parallel_problem(model, ep)
        if problem:
            raise PlanError(f"task {task.name} runs {model.name} at {task.allocation.strategy}: {problem}")
        if ep > 1 and task.kind == "generate" and plan.generation.migration is not None:
            raise PlanError(f"task {task.name} generates at {task.allocation.strategy} with long-tail migration: "
                            f"the instances it releases hold 1/{ep} of the experts the tail still needs; pin a "
                            f"generation layout without ep, or turn migration off")
    for move in plan.weight_movements:
        model = getattr(models, move.model.value)
        for alloc in (move.source, move.target):
            problem = expert_parallel_problem(model, alloc.strategy.ep)
            if problem:
                raise PlanError(f"weight movement {move.task} of {model.name} at {alloc.strategy}: {problem}")


def check_tensor_parallel(plan: Any, models: Any) -> None:
    """Every task's tensor-parallel degree shards its model's heads
    (:func:`tp_splits_heads`); searched layouts only offer such degrees,
    so this catches pinned layouts and a system's fixed choices (PlanError naming the task)."""

    for task in plan.tasks:
        tp = task.allocation.strategy.tp
        model = getattr(models, task.model.value)
        if not tp_splits_heads(tp, [model]):
            raise PlanError(f"task {task.name} runs {model.name} ({model.num_heads} heads, {model.num_kv_heads} KV "
                            f"heads) at tp={tp}, which does not shard its heads; pin a layout whose tp divides "
                            f"the heads, or use nodes of GPUs that it divides (cluster.gpus_per_node)")
