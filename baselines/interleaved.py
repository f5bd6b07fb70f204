"""The Interleaving placement strategy of Xiao et al., "An Adaptive Placement and Parallelism
Framework for Accelerating RLHF Training" (arXiv 2312.11819, published as FlexRLHF), as a plan:
``+system=interleaved``.

What the original does: instead of the co-located ("flattening") strategy that puts all four
models on every device, it places models that do not depend on each other on *exclusive* groups
of devices and orchestrates them so that they run at the same time. In a PPO iteration the
reference and reward models both consume only the generated responses and not each other's
output, so they get disjoint device groups and their inference passes overlap; the samples are
gathered, forwarded to each group and the results scattered back across the groups. Actor and
critic (trained every iteration) keep the whole cluster. The paper argues this removes memory
redundancy (ref and reward are each stored on half of the devices instead of on all of them) and
communication (smaller groups for ref/reward inference).

What we reimplement, as plan data:

- **Placement**: actor generation, actor and critic training and critic inference (``values``)
  on all devices; ref on the first group of nodes, reward on the second (halves of the nodes; on
  an odd number of nodes the larger model's group gets the extra node; on a one-node cluster the
  node's GPUs are halved). ``ref`` and ``reward`` read only ``responses``, so the simulator's list
  scheduler starts both as soon as generation ends and they run concurrently on their disjoint
  meshes; ``values`` (all devices) waits for both.
- **Parallelism**: every task's (dp, tp, pp) is chosen by the same brute-force search over the
  cost model that RLHFuse-Base uses (:class:`harness.planning.layout_search.PoolLayoutSearch`),
  restricted to the task's device group: the placement is the only difference from ``rlhfuse_base``. Generation uses
  continuous batching with the same per-instance batch limit, and the actor's (critic's) weights
  are resharded from the training layout to the generation (``values``) layout when they differ.
- **Memory**: actor and critic training states are resident on all devices; ref weights only on
  the ref group and reward weights only on the reward group, which leaves more room for the KV
  cache than co-location does. The training search on all devices reserves the larger of the two
  groups' cheapest ref/reward layouts (and critic inference's and generation's working sets); each
  group's search then sees everything the full-cluster tasks keep on its devices. As in
  ``rlhfuse_base``, slower layouts that fit (higher ZeRO stage, ref/reward weights offloaded to
  host memory) are taken before the plan is refused.

Modelled rather than executed: the gather / forward / scatter of samples between groups moves only
token ids (a few hundred KB per iteration for 512 samples of at most a few thousand tokens), which
is negligible next to the passes themselves and is not simulated. Not modelled: the paper's
automatic search over placements (the placement here is the fixed interleaving one), and any
overlap of ref/reward with training across iterations.

The pool helpers here (:func:`split_cluster`, :func:`pool_plan`) are shared with
``baselines/disaggregated.py``; the search and the plan assembly are the planning library's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.core.config import SystemConfig
from harness.costmodel.llama import num_params
from harness.errors import PlanError
from harness.core.plan import Allocation, GenerationPolicy, Plan
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.layout_search import PoolLayoutSearch, checked, search_notes
from harness.planning.memory import MemoryNeed
from harness.planning.strategies import SearchResult
from harness.planning.workflow import PPO_TASKS, full_mesh
from harness.system import PlanContext, System, register_system_config


@dataclass
class InterleavedConfig(SystemConfig):
    name: str = "interleaved"
    impl: str = "baselines.interleaved.Interleaved"
    zero_stage: int = 1  # distributed optimizer for actor/critic training (as rlhfuse_base)
    max_gen_batch_size: int = 256  # continuous-batching slots per generation instance (as rlhfuse_base)


# ---- helpers shared with baselines/disaggregated.py -------------------------------------------

def split_cluster(ctx: PlanContext, first_nodes: Optional[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two disjoint pools covering the cluster: the first ``first_nodes`` whole nodes and the rest,
    or (``first_nodes`` None, required on a one-node cluster) the two halves of the node's GPUs."""
    per_node, num_nodes, n = ctx.cluster.gpus_per_node, ctx.cluster.num_nodes, ctx.num_devices
    if first_nodes is None:
        if num_nodes != 1 or per_node < 2:
            raise PlanError(f"splitting GPUs within a node needs a one-node cluster with >= 2 GPUs "
                            f"(got {num_nodes} nodes x {per_node} GPUs)")
        cut = per_node // 2
    else:
        if not 1 <= first_nodes < num_nodes:
            raise PlanError(f"a split of whole nodes needs 1 <= {first_nodes} < {num_nodes} nodes")
        cut = first_nodes * per_node
    return tuple(range(cut)), tuple(range(cut, n))


def pool_plan(ctx: PlanContext, name: str, chosen: dict[str, SearchResult], meshes: dict[str, tuple[int, ...]],
              policy: GenerationPolicy, **kwargs) -> Plan:
    """Searched layouts placed on per-task meshes, assembled into the PPO plan."""
    allocs = {t: Allocation.in_engine_order(meshes[t], r.strategy) for t, r in chosen.items()}
    notes = {**search_notes(chosen, meshes), **kwargs.pop("notes", {})}
    return assemble_ppo_plan(ctx, name, allocs, policy, notes=notes, **kwargs)


# ---- the interleaving strategy ------------------------------------------------------------------

def ref_reward_groups(ctx: PlanContext) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ref on the first half of the nodes, reward on the second; an odd node goes to the larger model."""
    num_nodes = ctx.cluster.num_nodes
    if num_nodes == 1:
        return split_cluster(ctx, None)
    ref_larger = num_params(ctx.model("ref")) >= num_params(ctx.model("reward"))
    return split_cluster(ctx, (num_nodes + 1) // 2 if ref_larger else num_nodes // 2)


class Interleaved(System):
    cfg: InterleavedConfig

    def plan(self, ctx: PlanContext) -> Plan:
        cfg = self.cfg
        if not (ctx.algorithm.has_reference and ctx.algorithm.has_reward_model):
            missing = " and ".join(m for m, has in (("reference model", ctx.algorithm.has_reference),
                                                    ("reward model", ctx.algorithm.has_reward_model)) if not has)
            raise PlanError(f"interleaved splits the cluster between the reference and the reward model; "
                            f"algo={ctx.algorithm.name} has no {missing}: choose another system")
        everywhere = full_mesh(ctx.num_devices)
        full = PoolLayoutSearch(ctx, cfg.name, cfg.zero_stage, everywhere)
        ref_mesh, reward_mesh = ref_reward_groups(ctx)
        groups = {"ref": PoolLayoutSearch(ctx, cfg.name, cfg.zero_stage, ref_mesh),
                  "reward": PoolLayoutSearch(ctx, cfg.name, cfg.zero_stage, reward_mesh)}
        # On every device either ref or reward weights are resident: the larger bounds the rest.
        ref, reward = groups["ref"], groups["reward"]
        full.ledger.expect("ref|reward", [either(a, b) for a in ref.options("ref") for b in reward.options("reward")])
        full.fallback_options["ref|reward"] = [
            either(a, b) for a in ref.options("ref") + ref.options("ref", offload=True)
            for b in reward.options("reward") + reward.options("reward", offload=True)]
        full.expect(("values", "gen"))
        full.search_training()  # actor/critic states on all devices bound what is left for the rest
        meshes = {t: everywhere for t in PPO_TASKS}
        picked = {}
        for task_name, group in groups.items():
            group.ledger = full.ledger.copy(drop_later=("ref|reward",))  # what the full-cluster tasks hold there
            full.chosen[task_name] = group.search_inference_task(task_name)
            picked[task_name] = group.inference_need(task_name, group.chosen[task_name].strategy,
                                                     PPO_TASKS[task_name][1] in group.offloaded)
            full.offloaded |= group.offloaded
            meshes[task_name] = group.mesh
        full.ledger.commit("ref|reward", either(picked["ref"], picked["reward"]))
        if "values" in full.inference:  # the critic's inference (an algorithm with a critic)
            full.search_inference_task("values")
        policy = GenerationPolicy(batching="continuous", max_batch_size=cfg.max_gen_batch_size)
        full.search_generation(policy)
        notes = {"placement": f"ref on devices {ref_mesh[0]}..{ref_mesh[-1]}, reward on devices "
                              f"{reward_mesh[0]}..{reward_mesh[-1]}, everything else on all {ctx.num_devices}"}
        notes.update(full.memory_notes())
        plan = pool_plan(ctx, cfg.name, full.chosen, meshes, policy, training=full.training_stages(),
                         offloaded=sorted(full.offloaded), notes=notes)
        return checked(plan, ctx)


def either(ref: MemoryNeed, reward: MemoryNeed) -> MemoryNeed:
    """Ref on one group, reward on the other, as seen from a task on all devices: the larger resident
    weights (``ref|reward``) and both working sets."""
    return MemoryNeed({"ref|reward": max(ref.resident_gb, reward.resident_gb)}, {**ref.working, **reward.working})


register_system_config("interleaved", InterleavedConfig)
