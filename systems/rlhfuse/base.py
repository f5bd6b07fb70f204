"""RLHFuse-Base (RLHFuse, NSDI'25, arXiv 2409.13221, section 7): RLHFuse without its two fusions.

What it is in the paper: the authors' own system with every optimisation except stage fusion, used
to isolate the fusions' benefit. Each task (generation, the three inference passes, actor and
critic training) gets its own parallel strategy over all GPUs; weights are resharded between a
model's layouts; stages run one after another.

What we reimplement:

- **Per-task strategy search**: brute force over every (dp, tp, pp) with dp*tp*pp = N, tp dividing
  the GPUs of a node, pp <= layers, the mini-batch divisible into micro-batches per replica, and
  memory-feasible; each candidate is scored by the simulator's own task model
  (:mod:`harness.estimate`) on a representative batch; the fastest wins. Generation uses
  continuous batching (vLLM-style), as RLHFuse's generation engine does.
- **Resharding**: the actor's training weights are moved to the generation layout each iteration
  and the critic's to its inference layout when they differ (``realloc_*`` tasks). Ref and reward
  stay resident in their inference layouts.
- **No fusion**: no sample streaming, no migration (inter-stage), no fused actor+critic pipeline
  (intra-stage): each training task runs its own 1F1B schedule, actor first.

Modelled: all compute and communication through the cost model; ZeRO-1 (distributed optimizer)
shards optimizer states across dp, as Megatron-LM does for RLHFuse's training engine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from harness.config import SystemConfig
from harness.errors import PlanError
from harness.estimate import generation_s, inference_s, representative_batch, training_s
from harness.plan import Allocation, GenerationPolicy, ParallelStrategy, Plan, ResidentState, Task
from harness.system import PlanContext, System, register_system_config
from harness.workflow import (PPO_TASKS, check_layout_fits, full_mesh, ppo_tasks, single_pipe_stage,
                              weight_movement)


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


_LAYOUT_RE = re.compile(r"^dp(\d+)tp(\d+)pp(\d+)$")


def parse_layout(text: str, zero_stage: int, what: str) -> ParallelStrategy:
    m = _LAYOUT_RE.match(text.strip())
    if not m:
        raise PlanError(f"system.layouts.{what}={text!r}: expected the form dp<D>tp<T>pp<P>, e.g. dp32tp8pp1")
    dp, tp, pp = (int(g) for g in m.groups())
    return ParallelStrategy(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_strategies(num_devices: int, gpus_per_node: int, num_layers: int, zero_stage: int = 0,
                         max_pp: int = 32) -> Iterable[ParallelStrategy]:
    for tp in _divisors(gpus_per_node):
        if num_devices % tp:
            continue
        for pp in _divisors(num_devices // tp):
            if pp > min(num_layers, max_pp):
                continue
            yield ParallelStrategy(dp=num_devices // (tp * pp), tp=tp, pp=pp, zero_stage=zero_stage)


@dataclass
class SearchResult:
    strategy: ParallelStrategy
    time_s: float
    num_candidates: int


def search(candidates: Iterable[ParallelStrategy], score: Callable[[ParallelStrategy], float], what: str) -> SearchResult:
    best: tuple[float, ParallelStrategy] | None = None
    tried, reasons = 0, []
    for strategy in candidates:
        tried += 1
        try:
            t = score(strategy)
        except PlanError as e:  # infeasible candidate: skip, remember why
            reasons.append(f"{strategy}: {e}")
            continue
        if best is None or t < best[0]:
            best = (t, strategy)
    if best is None:
        detail = "; ".join(reasons[:3])
        raise PlanError(f"rlhfuse_base: no feasible parallel strategy for {what} among {tried} candidates ({detail})")
    return SearchResult(best[1], best[0], tried)


class LayoutSearch:
    """The per-task brute-force layout search, shared by RLHFuse-Base and RLHFuse.

    Training layouts are searched first, since their states stay resident and bound the memory
    left for everything else; then inference, then generation (whose KV cache gets what is left).
    """

    def __init__(self, ctx: PlanContext, cfg: "RLHFuseBaseConfig"):
        self.ctx, self.cfg = ctx, cfg
        self.cm, self.w, self.n = ctx.cost_model, ctx.workload, ctx.num_devices
        self.mesh = full_mesh(self.n)
        self.batch = representative_batch(ctx)
        self.capacity = self.cm.hbm_capacity_gb
        self.seq_max = int(self.w.prompt_len.max + self.w.max_gen_len)
        self.chosen: dict[str, SearchResult] = {}
        self.resident_gb: dict[str, float] = {}
        self.pinned = {t: getattr(cfg.layouts, t) for t in PPO_TASKS if getattr(cfg.layouts, t)}

    def candidates(self, role: str, zero: int = 0, task: str = "") -> list[ParallelStrategy]:
        if task in self.pinned:  # pinned by the user: checked, not searched
            pinned = parse_layout(self.pinned[task], zero, task)
            check_layout_fits(pinned, self.n, self.ctx.cluster.gpus_per_node, self.ctx.model(role).num_layers,
                              f"{self.cfg.name} {task} (system.layouts.{task})")
            return [pinned]
        return list(candidate_strategies(self.n, self.ctx.cluster.gpus_per_node, self.ctx.model(role).num_layers, zero))

    def training_memory_gb(self, role: str, s: ParallelStrategy, peak_in_flight_mbs: int) -> float:
        model = self.ctx.model(role)
        return self.cm.training_state_gb(model, s.dp, s.tp, s.pp, s.zero_stage) + peak_in_flight_mbs * \
            self.cm.activation_gb(model, self.w.micro_batch_size, self.seq_max, s.tp, model.num_layers / s.pp,
                                  self.w.activation_recompute)

    def search_training(self) -> None:
        w, cm = self.w, self.cm
        for task_name, role in (("update_actor", "actor"), ("update_critic", "critic")):
            def score(s: ParallelStrategy, task_name=task_name, role=role) -> float:
                stage = single_pipe_stage(task_name, role, s, w.mini_batch_size, w.micro_batch_size, w.global_batch_size)
                peak_mbs = min(s.pp, next(iter(stage.schedule.pipes.values())).num_mbs)
                need = self.training_memory_gb(role, s, peak_mbs)
                if need + sum(self.resident_gb.values()) > self.capacity:
                    raise PlanError(f"needs {need:.1f} GB")
                task = Task(task_name, "train", role, Allocation(self.mesh, s))
                return training_s(self.ctx, task, stage, w.mini_batch_size, self.batch)
            self.chosen[task_name] = search(self.candidates(role, self.cfg.zero_stage, task_name), score, task_name)
            s = self.chosen[task_name].strategy
            self.resident_gb[role] = cm.training_state_gb(self.ctx.model(role), s.dp, s.tp, s.pp, s.zero_stage)

    def _inference_fits(self, roles: list[str], s: ParallelStrategy) -> None:
        need = sum(self.cm.weights_gb(self.ctx.model(r), s.tp, s.pp) for r in roles)
        if need + sum(self.resident_gb.values()) > self.capacity:
            raise PlanError(f"weights need {need:.1f} GB")

    def search_inference(self, shared: bool = False) -> None:
        """One layout per inference task, or (``shared``) one layout for all three, scored by their sum."""
        tasks = ("ref", "reward", "values")
        if shared:
            roles = [PPO_TASKS[t][1] for t in tasks]

            def score_all(s: ParallelStrategy) -> float:
                self._inference_fits(roles, s)
                return sum(inference_s(self.ctx, Task(t, "inference", r, Allocation(self.mesh, s)), self.batch)
                           for t, r in zip(tasks, roles))
            pinned = next((t for t in tasks if t in self.pinned), "ref")
            result = search(self.candidates("actor", 0, pinned), score_all, "inference (shared layout)")
            self.chosen.update({t: result for t in tasks})
        else:
            for task_name in tasks:
                role = PPO_TASKS[task_name][1]

                def score(s: ParallelStrategy, task_name=task_name, role=role) -> float:
                    self._inference_fits([role], s)
                    return inference_s(self.ctx, Task(task_name, "inference", role, Allocation(self.mesh, s)), self.batch)
                self.chosen[task_name] = search(self.candidates(role, 0, task_name), score, task_name)
        for task_name in ("ref", "reward"):
            s = self.chosen[task_name].strategy
            self.resident_gb[PPO_TASKS[task_name][1]] = self.cm.weights_gb(self.ctx.model(PPO_TASKS[task_name][1]), s.tp, s.pp)

    def kv_capacity_gb(self, s: ParallelStrategy) -> float:
        return self.capacity - sum(self.resident_gb.values()) - self.cm.weights_gb(self.ctx.model("actor"), s.tp, s.pp)

    def search_generation(self, policy: GenerationPolicy) -> None:
        actor = self.ctx.model("actor")

        def score(s: ParallelStrategy) -> float:
            free = self.kv_capacity_gb(s)
            if free < self.cm.kv_cache_gb(actor, self.seq_max, s.tp, s.pp):
                raise PlanError(f"only {free:.1f} GB left for the KV cache")
            return generation_s(self.ctx, Task("gen", "generate", "actor", Allocation(self.mesh, s)), policy,
                                self.batch, free)
        self.chosen["gen"] = search(self.candidates("actor", 0, "gen"), score, "gen")


class RLHFuseBase(System):
    cfg: RLHFuseBaseConfig

    def plan(self, ctx: PlanContext) -> Plan:
        layouts = LayoutSearch(ctx, self.cfg)
        layouts.search_training()
        layouts.search_inference()
        policy = GenerationPolicy(batching="continuous", max_batch_size=self.cfg.max_gen_batch_size)
        layouts.search_generation(policy)
        return self._assemble(ctx, layouts.chosen, policy)

    def _assemble(self, ctx: PlanContext, chosen: dict[str, SearchResult], policy: GenerationPolicy) -> Plan:
        w, mesh = ctx.workload, full_mesh(ctx.num_devices)
        allocs = {name: Allocation(mesh, r.strategy) for name, r in chosen.items()}
        tasks, moves, moved = [], [], {}
        for model, consumer, source in (("actor", "gen", "update_actor"), ("critic", "values", "update_critic")):
            src, dst = allocs[source].strategy, allocs[consumer].strategy
            if (src.tp, src.pp) != (dst.tp, dst.pp) or src.zero_stage == 3:
                task, move = weight_movement(model, consumer, allocs[source], allocs[consumer])
                tasks.append(task)
                moves.append(move)
                moved[consumer] = task.name
        tasks += ppo_tasks(allocs, moved)
        training = [single_pipe_stage(t, m, allocs[t].strategy, w.mini_batch_size, w.micro_batch_size,
                                      w.global_batch_size) for t, m in (("update_actor", "actor"), ("update_critic", "critic"))]
        return Plan(
            system=self.cfg.name, tasks=tasks, training=training, generation=policy, weight_movements=moves,
            resident=[ResidentState("actor", "update_actor", "train"), ResidentState("critic", "update_critic", "train"),
                      ResidentState("ref", "ref", "weights"), ResidentState("reward", "reward", "weights")],
            global_batch_size=w.global_batch_size, mini_batch_size=w.mini_batch_size,
            notes={f"search/{k}": f"{r.strategy} ({r.num_candidates} candidates, est. {r.time_s:.2f} s)"
                   for k, r in chosen.items()},
        )


register_system_config("rlhfuse_base", RLHFuseBaseConfig)
