"""The Disaggregated (Separation) placement strategy of Xiao et al., "An Adaptive Placement and
Parallelism Framework for Accelerating RLHF Training" (arXiv 2312.11819, published as FlexRLHF),
as a plan: ``+system=disaggregated``.

What the original does: training and generation run on separate device pools. The training pool
holds the four models (actor and critic trained, ref and reward for inference) and runs every
non-generation task; the generation pool holds an extra *shadow* copy of the actor, laid out for
inference, which generates the responses. After each actor update the shadow actor's weights are
synchronised from the trained actor, re-partitioned from the training layout to the generation
layout. Each pool uses the parallelism suited to its work, at the price of the synchronisation
and of each pool idling while the other works (PPO is on-policy: generation needs the new
weights, training needs the new samples).

What we reimplement, as plan data:

- **Pools**: the generation pool is ``gen_nodes`` whole nodes (the last ones), the training pool
  the rest (on a one-node cluster, the two halves of the node's GPUs). ``update_actor``,
  ``update_critic``, ``ref``, ``reward`` and ``values`` run on the training pool, ``gen`` on the
  generation pool; the meshes are disjoint and together cover the cluster.
- **Parallelism**: each task's (dp, tp, pp) is chosen within its pool by the same brute-force
  search over the cost model that RLHFuse-Base uses (:class:`harness.planning.layout_search.PoolLayoutSearch`); generation uses continuous batching with the same
  per-instance batch limit as ``rlhfuse_base``. The generation pool runs as many shadow replicas
  as its searched dp.
- **Synchronisation**: a ``param_sync`` weight-movement task each iteration moves the trained
  actor's weights point-to-point from its training layout to every generation replica, with the
  tensor-parallel layout remapped (:func:`harness.planning.realloc.reallocation_transfers`: each receiving
  replica gets one full copy of the actor, 2 bytes per parameter; the simulator bounds the time by
  the receivers' and the senders' links, :func:`harness.planning.taskmodels.passes.weight_movement_s`).
  It is part of the iteration (``gen`` reads the synced weights), so it counts in the step time.
- **Split**: ``system.gen_nodes`` fixes the generation pool's size; 0 (default) lets the cost
  model choose it. Each candidate split is planned (per-pool layout searches, cached per pool)
  and scored by the simulated makespan of one iteration (the sim backend on the workload's
  iteration-0 batch); the fastest wins and every tried split's makespan is recorded in
  ``plan.notes["split/curve_s"]``. ``system.split_search=exhaustive`` tries every split of whole
  nodes; ``refine`` (default, to keep planning fast on 32 nodes) tries 1, 2, 4, ... nodes and
  ``num_nodes - 1``, then bisects towards the best between its tried neighbours until they are
  adjacent (exact when makespan is unimodal in the split, which holds when generation time falls
  and training time rises with the generation pool's size).
- **Memory**: the generation pool holds only the shadow actor's weights and the KV cache; the
  training pool holds actor and critic training states and ref and reward weights. The training
  pool's search reserves memory for its inference tasks before choosing training layouts and, as
  in ``rlhfuse_base``, takes slower layouts that fit (higher ZeRO stage, ref/reward weights
  offloaded to host memory) before a split is found infeasible.

Not modelled: asynchronous/off-policy overlap of generation with training (the paper's strategy
is synchronous PPO), and the paper's search over placements beyond this one split.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from harness.core.config import SystemConfig
from harness.errors import PlanError
from harness.core.option_effects import Condition, effective_when
from harness.core.plan import GenerationPolicy, MovementKind, Plan
from harness.planning.estimate import simulated_makespan_s
from harness.planning.layout_search import PoolLayoutSearch
from harness.planning.strategies import SearchResult
from harness.system import PlanContext, System, register_system_config
from harness.core.workload import draw_batch
from baselines.interleaved import pool_plan, split_cluster

SPLIT_SEARCHES = ("refine", "exhaustive")
TRAINING_POOL_TASKS = ("update_actor", "update_critic", "ref", "reward", "values")


@dataclass
class DisaggregatedConfig(SystemConfig):
    name: str = "disaggregated"
    impl: str = "baselines.disaggregated.Disaggregated"
    gen_nodes: int = 0  # whole nodes in the generation pool; 0 = chosen by the cost model
    split_search: str = field(  # refine | exhaustive (how gen_nodes = 0 searches the splits)
        default="refine", metadata=effective_when(
            ("system.gen_nodes", "==", 0), Condition("cluster.num_nodes", "!=", 1, says="cluster.num_nodes > 1"),
            why="only a split of several nodes that is not fixed is searched"))
    zero_stage: int = 1  # distributed optimizer for actor/critic training (as rlhfuse_base)
    max_gen_batch_size: int = 256  # continuous-batching slots per generation instance (as rlhfuse_base)


def coarse_splits(num_nodes: int) -> list[int]:
    """1, 2, 4, ... generation nodes and num_nodes - 1."""
    out, k = {num_nodes - 1}, 1
    while k < num_nodes:
        out.add(k)
        k *= 2
    return sorted(out)


def refine_splits(curve: dict[int, float], num_nodes: int) -> list[int]:
    """Untried splits halfway between the best tried split and its nearest tried neighbours."""
    best = min(curve, key=curve.get)
    lower = max((k for k in curve if k < best), default=None)
    upper = min((k for k in curve if k > best), default=None)
    out = []
    for lo, hi in ((lower, best), (best, upper)):
        if lo is not None and hi is not None and hi - lo > 1:
            out.append((lo + hi) // 2)
    return [k for k in out if k not in curve and 1 <= k < num_nodes]


@contextmanager
def _pool_context(pool: str, mesh: tuple[int, ...]):
    try:
        yield
    except PlanError as e:
        raise PlanError(f"disaggregated {pool} pool (devices {mesh[0]}..{mesh[-1]}): "
                        f"{str(e).removeprefix('disaggregated: ')}") from e


def search_splits(num_nodes: int, score: Callable[[int], float], exhaustive: bool = False
                  ) -> tuple[dict[int, float], dict[int, str]]:
    """Score splits (generation nodes -> makespan; PlanError = infeasible): every split, or the
    coarse ones then :func:`refine_splits` until the best's tried neighbours are adjacent.
    Returns the feasible splits' scores and the infeasible splits' reasons."""
    curve: dict[int, float] = {}  # infeasible splits score inf here, so refinement moves away from them
    infeasible: dict[int, str] = {}
    todo = list(range(1, num_nodes)) if exhaustive else coarse_splits(num_nodes)
    while todo:
        for k in todo:
            try:
                curve[k] = score(k)
            except PlanError as e:  # a pool too small for its models: record why
                infeasible[k] = str(e)[:300]
                curve[k] = math.inf
        feasible = any(v < math.inf for v in curve.values())
        todo = refine_splits(curve, num_nodes) if feasible and not exhaustive else []
    return {k: v for k, v in curve.items() if v < math.inf}, infeasible


class SplitPlanner:
    """Plans and scores the disaggregated plan for one split; pool searches are cached per mesh."""

    def __init__(self, ctx: PlanContext, cfg: DisaggregatedConfig):
        self.ctx, self.cfg = ctx, cfg
        self.policy = GenerationPolicy(batching="continuous", max_batch_size=cfg.max_gen_batch_size)
        self.batch = draw_batch(ctx.workload, ctx.seed, 0, ctx.algorithm)
        self._gen: dict[tuple[int, ...], SearchResult] = {}
        self._train: dict[tuple[int, ...], tuple[dict[str, SearchResult], list, list[str], dict]] = {}

    def gen_layout(self, mesh: tuple[int, ...]) -> SearchResult:
        if mesh not in self._gen:
            pool = PoolLayoutSearch(self.ctx, self.cfg.name, self.cfg.zero_stage, mesh)  # nothing else resident there
            with _pool_context("generation", mesh):
                pool.search_generation(self.policy)
            self._gen[mesh] = pool.chosen["gen"]
        return self._gen[mesh]

    def training_layouts(self, mesh: tuple[int, ...]) -> tuple[dict[str, SearchResult], list, list[str], dict]:
        """The training pool's layouts, its training stages, the models it offloads and the
        ``memory/...`` notes."""
        if mesh not in self._train:
            pool = PoolLayoutSearch(self.ctx, self.cfg.name, self.cfg.zero_stage, mesh)
            with _pool_context("training", mesh):
                pool.expect(("ref", "reward", "values"))  # generation runs on the other pool
                pool.search_training()
                pool.search_inference()
            self._train[mesh] = ({t: pool.chosen[t] for t in TRAINING_POOL_TASKS if t in pool.chosen},
                                 pool.training_stages(),
                                 sorted(pool.offloaded), pool.memory_notes())
        return self._train[mesh]

    def plan(self, gen_nodes: int | None) -> Plan:
        """``gen_nodes`` None: one-node cluster, halves of its GPUs."""
        if gen_nodes is None:
            train_mesh, gen_mesh = split_cluster(self.ctx, None)
        else:
            train_mesh, gen_mesh = split_cluster(self.ctx, self.ctx.cluster.num_nodes - gen_nodes)
        train, stages, offloaded, memory_notes = self.training_layouts(train_mesh)
        chosen = {**train, "gen": self.gen_layout(gen_mesh)}
        meshes = {t: train_mesh for t in TRAINING_POOL_TASKS} | {"gen": gen_mesh}
        notes = {"split/gen_devices": f"{gen_mesh[0]}..{gen_mesh[-1]} ({len(gen_mesh)} devices)",
                 "split/train_devices": f"{train_mesh[0]}..{train_mesh[-1]} ({len(train_mesh)} devices)",
                 "split/gen_replicas": chosen["gen"].strategy.dp, **memory_notes}
        if gen_nodes is not None:
            notes["split/gen_nodes"] = gen_nodes
        return pool_plan(self.ctx, self.cfg.name, chosen, meshes, self.policy, actor_sync=MovementKind.PARAM_SYNC,
                         training=stages, offloaded=offloaded, notes=notes)

    def makespan_s(self, plan: Plan) -> float:
        """Simulated iteration time (checks memory first; raises PlanMemoryError if it does not fit)."""
        return simulated_makespan_s(self.ctx, plan, self.batch)


class Disaggregated(System):
    cfg: DisaggregatedConfig

    def plan(self, ctx: PlanContext) -> Plan:
        cfg, num_nodes = self.cfg, ctx.cluster.num_nodes
        if cfg.split_search not in SPLIT_SEARCHES:
            raise PlanError(f"system.split_search={cfg.split_search!r}: expected one of {SPLIT_SEARCHES}")
        planner = SplitPlanner(ctx, cfg)
        if num_nodes == 1:
            if cfg.gen_nodes:
                raise PlanError(f"system.gen_nodes={cfg.gen_nodes}: a one-node cluster is split into halves "
                                f"of its GPUs; leave system.gen_nodes=0")
            plan = planner.plan(None)
            plan.notes["split/curve_s"] = {"half": float(f"{planner.makespan_s(plan):.6g}")}
            return plan
        if cfg.gen_nodes:
            if not 1 <= cfg.gen_nodes < num_nodes:
                raise PlanError(f"system.gen_nodes={cfg.gen_nodes}: the generation pool needs 1 .. "
                                f"{num_nodes - 1} of the cluster's {num_nodes} nodes (0 = choose)")
            return planner.plan(cfg.gen_nodes)
        return self._search_split(planner, num_nodes)

    def _search_split(self, planner: SplitPlanner, num_nodes: int) -> Plan:
        plans: dict[int, Plan] = {}

        def score(gen_nodes: int) -> float:
            plans[gen_nodes] = planner.plan(gen_nodes)
            return planner.makespan_s(plans[gen_nodes])

        curve, infeasible = search_splits(num_nodes, score, self.cfg.split_search == "exhaustive")
        if not curve:
            detail = "; ".join(f"{k} gen nodes: {why}" for k, why in sorted(infeasible.items())[:3])
            raise PlanError(f"disaggregated: no split of the {num_nodes} nodes into a generation and a training "
                            f"pool fits ({detail})")
        plan = plans[min(curve, key=curve.get)]
        plan.notes["split/search"] = self.cfg.split_search
        plan.notes["split/curve_s"] = {str(k): float(f"{v:.6g}") for k, v in sorted(curve.items())}
        if infeasible:
            plan.notes["split/infeasible"] = {str(k): why for k, why in sorted(infeasible.items())}
        return plan


register_system_config("disaggregated", DisaggregatedConfig)
