"""RLHFuse-Base (RLHFuse, NSDI'25, arXiv 2409.13221, section 7): RLHFuse without its two fusions.

What it is in the paper: the authors' own system with every optimisation except stage fusion, used
to isolate the fusions' benefit. Each task (generation, the three inference passes, actor and
critic training) gets its own parallel strategy over all GPUs; weights are resharded between a
model's layouts; stages run one after another.

What we reimplement:

- **Per-task strategy search**: brute force over every (dp, tp, pp) with dp*tp*pp = N, tp dividing
  the GPUs of a node, pp <= layers, the mini-batch divisible into micro-batches per replica, and
  memory-feasible; each candidate is scored by the simulator's own task model
  (:mod:`harness.planning.estimate`) on a representative batch; the fastest wins
  (:class:`harness.planning.layout_search.LayoutSearch`). Generation uses
  continuous batching (vLLM-style), as RLHFuse's generation engine does.
- **Memory**: every choice must fit beside the states the others keep resident (both models'
  training states, ref and reward weights) and the largest working set on the same devices, with
  memory reserved for the choices still to come; on a cluster too small for the fastest layouts
  the search takes slower ones that fit (more sharding, a higher ZeRO stage for training, fewer
  micro-batches in flight in 1F1B, ref and reward offloaded to host memory) and refuses only when
  nothing fits, naming the smallest requirement.
- **Resharding**: the actor's training weights are moved to the generation layout each iteration
  and the critic's to its inference layout when they differ (``realloc_*`` tasks). Ref and reward
  stay resident in their inference layouts (offloaded only where nothing resident fits).
- **No fusion**: no sample streaming, no migration (inter-stage), no fused actor+critic pipeline
  (intra-stage): each training task runs its own 1F1B schedule, actor first.

Modelled: all compute and communication through the cost model; ZeRO-1 (distributed optimizer)
shards optimizer states across dp, as Megatron-LM does for RLHFuse's training engine.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from harness.core.config import SystemConfig
from harness.core.plan import GenerationPolicy, Plan
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.layout_search import ALL_LATER_STEPS, LayoutSearch, checked, search_notes
from harness.system import PlanContext, System, register_system_config


@dataclass
class TaskLayouts:
    """Optional fixed layouts ``dp<D>tp<T>pp<P>`` per task; None = search."""

    gen: Optional[str] = None
    ref: Optional[str] = None
    reward: Optional[str] = None
    values: Optional[str] = None
    update_actor: Optional[str] = None
    update_critic: Optional[str] = None


@dataclass
class RLHFuseBaseConfig(SystemConfig):
    name: str = "rlhfuse_base"
    impl: str = "systems.rlhfuse.base.RLHFuseBase"
    zero_stage: int = 1  # distributed optimizer for training (Megatron-LM style)
    max_gen_batch_size: int = 256  # per generation instance (continuous batching slots)
    # Pin a task's layout instead of searching it, e.g. system.layouts.gen=dp32tp8pp1
    layouts: TaskLayouts = field(default_factory=TaskLayouts)


# the key that pins each task's layout (Plan.layout_keys: named in refusals' hints)
LAYOUT_KEYS = {task: f"system.layouts.{task}" for task in TaskLayouts.__dataclass_fields__}


def layout_search(ctx: PlanContext, cfg: RLHFuseBaseConfig) -> LayoutSearch:
    """The per-task search with this config's ZeRO stage and pinned layouts."""
    return LayoutSearch(ctx, cfg.name, cfg.zero_stage, pinned=asdict(cfg.layouts))


class RLHFuseBase(System):
    cfg: RLHFuseBaseConfig

    def plan(self, ctx: PlanContext) -> Plan:
        layouts = layout_search(ctx, self.cfg)
        layouts.expect(ALL_LATER_STEPS)
        layouts.search_training()
        layouts.search_inference()
        policy = GenerationPolicy(batching="continuous", max_batch_size=self.cfg.max_gen_batch_size)
        layouts.search_generation(policy)
        allocs = {name: layouts.allocation(r.strategy) for name, r in layouts.chosen.items()}
        plan = assemble_ppo_plan(ctx, self.cfg.name, allocs, policy, training=layouts.training_stages(),
                                 offloaded=sorted(layouts.offloaded),
                                 notes={**search_notes(layouts.chosen), **layouts.memory_notes()},
                                 layout_keys=LAYOUT_KEYS)
        return checked(plan, ctx)


register_system_config("rlhfuse_base", RLHFuseBaseConfig)
