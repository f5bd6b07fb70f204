"""RLHFuse (Zhong et al., NSDI'25, arXiv 2409.13221): ``+system=rlhfuse``.

RLHFuse-Base (:mod:`systems.rlhfuse.base`) plus the paper's two stage fusions, each switchable so
that an ablation is one override:

- **Inter-stage fusion** (section 4, ``system.inter_stage``): generation streams each finished
  sample to ref/reward/critic inference, and the long tail migrates to a few instances so the
  others run inference (:mod:`systems.rlhfuse.inter` chooses R_t, ``m`` and BS_max). The three
  inference tasks share one layout so a freed replica can run all of them on a sample.
- **Intra-stage fusion** (section 5, ``system.intra_stage``): actor and critic training run as
  one fused bidirectional pipeline schedule found by search (:mod:`systems.rlhfuse.intra`).
  Candidate layouts: equal tp for both models (merging ``s`` stages of the smaller-tp model into
  one rank of the larger tp is the same as laying that model out at the larger tp with ``pp/s``
  stages, so equal tp covers it), actor ``pp_a`` and critic ``pp_c`` near the ones the base search
  chose (exactly those of a layout pinned with ``system.layouts.update_actor/update_critic``), ``N = lcm(pp_a, pp_c)`` ranks per group, ``G = devices / (N tp)`` groups; each candidate
  is scored by its best quick schedule (serial 1F1B or two greedy policies) plus
  gradient sync and optimizer step; the best one is then annealed under the memory left next to
  the resident states.

Memory: the base search's ledger (:mod:`harness.planning.layout_search`) reserves the shared
inference layout's weights from the start; a fused candidate's schedule may hold as much activation
memory as is left beside both models' training states, the ref and reward weights (or the most the
shared layout will need) and the other tasks' working sets, and the chosen schedule's states and
peak then replace the base training layouts' in the ledger, so the shared layout is chosen beside
them. Where no fused layout fits, training runs as separate 1F1B stages in the base search's
layouts (note ``fused/fallback``); where nothing fits with a shared, resident inference layout, the
plan is made without inter-stage fusion (``inter/fallback``), whose ref and reward may be
offloaded.

What is reimplemented: the planning algorithms and the policies as plan data; what is modelled:
their execution, by the simulator (and later the real backend) from that data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from harness.errors import ConfigError
from harness.core.option_effects import effective_when
from harness.core.plan import (Allocation, GenerationPolicy, MovementKind, ParallelStrategy, Plan, Task, TrainingStage,
                          WeightMovement)
from harness.planning.assembler import assemble_ppo_plan, needs_movement
from harness.planning.layout_search import ALL_LATER_STEPS, LayoutSearch, checked
from harness.planning.memory import MemoryNeed, MemoryShortfall, NoLayoutFits
from harness.planning.strategies import divisors, smallest_requirement, tp_splits_heads
from harness.planning.taskmodels.passes import grad_sync_s, training_pipe_costs
from harness.planning import packing
from harness.planning.workflow import PPO_TASKS, full_mesh, packed_stage_args
from harness.schedule import ScheduleError, simulate
from harness.system import PlanContext, System, register_system_config
from systems.rlhfuse.base import LAYOUT_KEYS, RLHFuseBaseConfig, layout_search
from systems.rlhfuse.inter import choose_inter_stage
from systems.rlhfuse.intra.config import PLANNING_MAX_STEPS, FusedSearchConfig


# Greedy policies used to score candidate fused layouts (the chosen layout's search tries all).
CANDIDATE_POLICIES = ("larger", "fifo")
# Options of long-tail migration: set without inter-stage fusion they are refused (harness/core/option_effects.py).
INTER_STAGE_ONLY = effective_when(("system.inter_stage", "==", True),
                                  why="long-tail migration is part of inter-stage fusion")


@dataclass
class RLHFuseConfig(RLHFuseBaseConfig):
    name: str = "rlhfuse"
    impl: str = "systems.rlhfuse.system.RLHFuse"
    inter_stage: bool = True  # section 4: sample streaming + long-tail migration
    intra_stage: bool = True  # section 5: fused actor+critic pipeline schedule
    # R_t / batch; None = chosen by simulation over 5%..95%
    migration_frac: Optional[float] = field(default=None, metadata=INTER_STAGE_ONLY)
    migration_transfer: str = field(default="kv", metadata=INTER_STAGE_ONLY)  # kv | tokens (re-prefill on arrival)
    # the fused schedule's search (systems/rlhfuse/intra/config.py): a step budget by default (same
    # config and seed => same plan); a wall-clock limit (its time_limit_s or the run's
    # planning_budget_s) replaces it when set
    fused_search: FusedSearchConfig = field(default_factory=lambda: FusedSearchConfig(max_steps=PLANNING_MAX_STEPS),
                                            metadata=effective_when(("system.intra_stage", "==", True),
                                                                    why="the fused schedule is intra-stage fusion"))


@dataclass
class FusedCandidate:
    actor: ParallelStrategy
    critic: ParallelStrategy
    pipes: dict
    costs: dict
    estimate_s: float


def _pp_choices(base_pp: int, num_layers: int) -> list[int]:
    return sorted({p for p in (base_pp // 2, base_pp, base_pp * 2) if 1 <= p <= num_layers})


class RLHFuse(System):
    cfg: RLHFuseConfig

    def check_config(self) -> None:
        cfg = self.cfg
        if cfg.migration_transfer not in ("kv", "tokens"):
            raise ConfigError(f"system.migration_transfer={cfg.migration_transfer!r}; use kv or tokens")
        if cfg.migration_frac is not None and not 0.0 <= cfg.migration_frac < 1.0:
            raise ConfigError(f"system.migration_frac={cfg.migration_frac} must be in [0, 1)")
        try:
            cfg.fused_search.check()
        except ValueError as e:
            raise ConfigError(f"system.fused_search.{e}") from None

    def plan(self, ctx: PlanContext) -> Plan:
        self.check_config()
        try:
            return checked(self._plan(ctx, self.cfg.inter_stage), ctx)
        except NoLayoutFits as e:
            if not self.cfg.inter_stage:
                raise
            # the shared inference layout keeps ref and reward resident; without inter-stage fusion
            # they get their own layouts and may be offloaded: slower, and it may fit
            plan = checked(self._plan(ctx, False), ctx)  # its refusal names the smaller requirement
            plan.notes["inter/fallback"] = f"no inter-stage fusion: with it, {e}"
            return plan

    def _plan(self, ctx: PlanContext, inter_stage: bool) -> Plan:
        """Base search (its training layouts seed the fused candidates; with inter-stage fusion its
        inference layouts stand in for the shared one until that is chosen), then the fused stage,
        then the shared inference layout. The ledger reserves the shared layout's memory from the
        start, and the fused stage's states and activation peak replace the base training ones."""
        layouts = layout_search(ctx, self.cfg)
        layouts.offload = not inter_stage  # streamed inference keeps its weights resident
        layouts.expect(ALL_LATER_STEPS + (("shared",) if inter_stage else ()))
        layouts.search_training()
        layouts.search_inference()
        policy = GenerationPolicy(batching="continuous", max_batch_size=self.cfg.max_gen_batch_size)
        layouts.search_generation(policy)
        notes: dict = {f"search/{k}": str(r.strategy) for k, r in layouts.chosen.items()}
        allocs = {name: layouts.allocation(r.strategy) for name, r in layouts.chosen.items()}
        training = self._training(ctx, layouts, allocs, notes)
        if inter_stage and not layouts.inference:
            notes["inter/off"] = (f"algo={ctx.algorithm.name} runs no inference task (no reference model, reward "
                                  f"model or critic): nothing to stream samples to or to run beside the long tail")
            inter_stage = False
        if inter_stage:
            policy = self._inter_stage(ctx, layouts, allocs, policy, notes)
        notes.update(layouts.memory_notes(training=not any(st.fused for st in training)))  # the base search's stages
        return assemble_ppo_plan(ctx, self.cfg.name, allocs, policy, training=training,
                                 stream_inference=inter_stage, offloaded=sorted(layouts.offloaded),
                                 notes=notes, layout_keys=LAYOUT_KEYS)

    # ---- inter-stage fusion (section 4) -----------------------------------------------------
    def _inter_stage(self, ctx, layouts: LayoutSearch, allocs, policy, notes) -> GenerationPolicy:
        """Choose the shared inference layout and R_t together (:func:`choose_inter_stage`), among
        the layouts whose ref and reward weights fit beside the training states and every working
        set on the devices (the fused stage's activation peak, generation's weights and KV cache)."""
        roles = tuple((t, PPO_TASKS[t][1]) for t in layouts.inference)  # those the algorithm runs
        all_candidates = layouts.shared_candidates()

        def fitting() -> tuple[list[ParallelStrategy], list]:
            fits, shortfalls = [], []
            for cand in all_candidates:
                try:
                    layouts.ledger.require(layouts.shared_inference_need(cand), "shared")
                except MemoryShortfall as e:
                    shortfalls.append((cand, e))
                    continue
                fits.append(cand)
            return fits, shortfalls
        candidates, shortfalls = fitting()
        if not candidates:
            # generation was chosen beside the per-task inference layouts, which may hold less than
            # any shared one: choose it again beside the shared layout that needs the least
            smallest = min(all_candidates, key=lambda c: layouts.ledger.total_gb(layouts.shared_inference_need(c),
                                                                                 "shared"))
            layouts.ledger.commit("shared", layouts.shared_inference_need(smallest))
            layouts.search_generation(policy)
            allocs["gen"] = layouts.allocation(layouts.chosen["gen"].strategy)
            notes["search/gen"] = str(layouts.chosen["gen"].strategy)
            candidates, shortfalls = fitting()
        if not candidates:
            raise NoLayoutFits(f"rlhfuse: no shared inference layout fits in memory{smallest_requirement(shortfalls)}")
        gen = Task("gen", "generate", "actor", allocs["gen"])

        def make_inference(strategy: ParallelStrategy):
            alloc = layouts.allocation(strategy)
            tasks = [Task(n, "inference", m, alloc) for n, m in roles]
            moves = {}  # as the assembler decides it: the critic fetched per inference replica
            if "update_critic" in allocs and needs_movement(allocs["update_critic"], alloc):
                moves["values"] = WeightMovement("values", "critic", allocs["update_critic"], alloc,
                                                 MovementKind.PER_REPLICA)
            return tasks, moves

        kv_gb = layouts.kv_capacity_gb(allocs["gen"].strategy)
        choice, layout = choose_inter_stage(ctx, gen, candidates, make_inference, policy, kv_gb,
                                            self.cfg.migration_transfer, pinned_frac=self.cfg.migration_frac)
        for name, _ in roles:
            allocs[name] = layouts.allocation(layout)
        layouts.ledger.commit("shared", layouts.shared_inference_need(layout))
        mig = choice.policy
        notes.update({"inference/shared_layout": str(layout), "migration/threshold_frac": mig.threshold_frac,
                      "migration/num_tail_instances": mig.num_tail_instances, "migration/bs_max": choice.bs_max,
                      "migration/transfer": mig.transfer,
                      "migration/curve_s": {f"{k:.2f}": round(v, 4) for k, v in choice.curve.items()}})
        return GenerationPolicy("continuous", policy.max_batch_size,
                                migration=mig if mig.threshold_frac > 0 else None)

    # ---- intra-stage fusion (section 5) -----------------------------------------------------
    def _training(self, ctx, layouts: LayoutSearch, allocs: dict, notes: dict) -> list[TrainingStage]:
        w = ctx.workload
        if not self.cfg.intra_stage:
            return layouts.training_stages()
        if not ctx.algorithm.has_critic:
            notes["fused/off"] = (f"algo={ctx.algorithm.name} has no critic: the fused actor-critic pipeline "
                                  f"(intra-stage fusion) needs both; the actor trains in its own 1F1B")
            return layouts.training_stages()
        from systems.rlhfuse.intra import greedy_schedule, search_fused_schedule, serial_schedule

        best: FusedCandidate | None = None
        tried = 0
        ctx.report("rlhfuse: fused actor+critic layouts")
        for cand in self._fused_candidates(ctx, layouts):
            tried += 1
            serial = serial_schedule(cand.pipes)
            cap = self._mem_cap(ctx, layouts, cand)
            serial_result = simulate(serial, cand.costs, record_times=False)
            if serial_result.max_peak_memory > cap:
                continue  # not even serial 1F1B fits next to the resident states
            # quick score: the better of two greedy policies (the search later tries all of them)
            quick = [serial_result.makespan]
            for policy in CANDIDATE_POLICIES:
                try:
                    quick.append(simulate(greedy_schedule(cand.pipes, cand.costs, cap, policy=policy), cand.costs,
                                          record_times=False).makespan)
                except ScheduleError:
                    continue
            # per mini-batch: the fused pipeline, then both models' gradient sync and optimizer step
            cand.estimate_s = min(quick) + \
                sum(self._sync_s(ctx, strategy, role, mesh) for role, strategy, mesh in
                    zip(("actor", "critic"), (cand.actor, cand.critic), self._fused_meshes(ctx.num_devices, cand.actor,
                                                                                            cand.critic)))
            if best is None or cand.estimate_s < best.estimate_s:
                best = cand
        if best is None:
            # no fused layout leaves room for its activations: train as the base search chose, each
            # model in its own 1F1B stage (slower, and fits: the ledger holds those layouts)
            notes["fused/fallback"] = (f"no fused actor+critic layout fits among {tried} candidates; "
                                       f"separate 1F1B stages")
            return layouts.training_stages()
        search = self.cfg.fused_search
        time_limit_s = ctx.wall_clock_budget_s(search.time_limit_s)
        ctx.report(f"rlhfuse: fused schedule of {best.actor} + {best.critic} (of {tried} layouts), quick estimate "
                   f"{best.estimate_s:.4g} s; annealing {search.step_budget} steps" if time_limit_s is None else
                   f"rlhfuse: fused schedule of {best.actor} + {best.critic}, annealing for {time_limit_s:g} s")
        if time_limit_s is not None:  # the wall clock replaces the step budget
            search = replace(search, time_limit_s=time_limit_s, max_steps=None)
        result = search_fused_schedule(best.pipes, best.costs, self._mem_cap(ctx, layouts, best), search)
        # the fused stage's states and activation peak replace the base training layouts' in the ledger
        peak = simulate(result.schedule, best.costs, record_times=False).max_peak_memory
        layouts.ledger.commit("training", self._fused_need(ctx, best, peak))
        actor_mesh, critic_mesh = self._fused_meshes(ctx.num_devices, best.actor, best.critic)
        allocs["update_actor"] = Allocation(actor_mesh, best.actor)
        allocs["update_critic"] = Allocation(critic_mesh, best.critic)
        notes.update({"fused/actor": str(best.actor), "fused/critic": str(best.critic), "fused/candidates": tried,
                      "fused/makespan_s": round(result.makespan, 6), "fused/lower_bound_s": round(result.lower_bound, 6),
                      "fused/serial_makespan_s": round(result.serial_makespan, 6),
                      "fused/serial_no_barrier_makespan_s": round(result.serial_no_barrier_makespan, 6),
                      "fused/peak_memory_vs_serial": round(result.peak_memory / result.serial_peak_memory, 4),
                      "fused/greedy_makespan_s": round(result.greedy_makespan, 6),
                      "fused/bubble_frac": round(result.bubble_frac, 4),
                      "fused/serial_bubble_frac": round(self._serial_bubble(best), 4),
                      "fused/search_s": round(result.search_s, 2)})
        if search.makespan_slack_frac > 0:  # the time given up for memory, against the shortest found
            notes.update({"fused/makespan_slack_frac": search.makespan_slack_frac,
                          "fused/phase1_makespan_s": round(result.phase1_makespan, 6)})
        return [TrainingStage(("update_actor", "update_critic"), result.schedule,
                              w.global_batch_size // w.mini_batch_size, w.micro_batch_size, w.micro_batch_tokens)]

    @staticmethod
    def _sync_s(ctx, strategy: ParallelStrategy, role: str, mesh: tuple[int, ...]) -> float:
        task = Task(f"update_{role}", "train", role, Allocation(mesh, strategy))
        return sum(grad_sync_s(ctx.cost_model, task, ctx.model(role)))

    @staticmethod
    def _serial_bubble(cand: FusedCandidate) -> float:
        from systems.rlhfuse.intra import serial_schedule

        res = simulate(serial_schedule(cand.pipes), cand.costs, record_times=False)
        return res.bubble_frac

    @classmethod
    def _fused_meshes(cls, n: int, actor: ParallelStrategy, critic: ParallelStrategy
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The actor's and the critic's meshes in the fused stage: actor stage ``p`` and critic stage
        ``pp - 1 - p`` on the same devices (the bidirectional pairing of RLHFuse section 5).

        Two pipelines of one depth with expert parallelism (either model) take Megatron-core's
        order (:meth:`Allocation.pipeline_outermost`, as :meth:`Allocation.in_engine_order` places
        the other systems' MoE pipelines): the actor stage-major, its stage ``p``'s replicas on
        ``dp * tp`` consecutive devices, so each ep group is ``ep * tp`` of them; the critic's stage
        ``q`` on the actor's block ``pp - 1 - q``, replica by replica. Otherwise the plain order
        (a replica's stages side by side) and its reversal (:meth:`_reversed_mesh`), which also
        serves pipelines of different depths."""
        tp, num_ranks = actor.tp, math.lcm(actor.pp, critic.pp)
        pp, dp = actor.pp, actor.dp
        if actor.pp == critic.pp > 1 and max(actor.ep, critic.ep) > 1:
            block = dp * tp  # one stage's replicas, side by side

            def mesh(stage_block):
                return tuple(stage_block(p) * block + k * tp + t for k in range(dp) for p in range(pp) for t in range(tp))

            return mesh(lambda p: p), mesh(lambda q: pp - 1 - q)
        return full_mesh(n), cls._reversed_mesh(n, tp, num_ranks, critic.pp)

    @staticmethod
    def _reversed_mesh(n: int, tp: int, num_ranks: int, pp: int) -> tuple[int, ...]:
        """Critic mesh whose replica ``g*K2 + j``, stage s sits on logical rank N-1-(j*pp+s) of group g."""
        groups, per_group = n // (num_ranks * tp), num_ranks // pp
        mesh = []
        for g in range(groups):
            for j in range(per_group):
                for s in range(pp):
                    rank = g * num_ranks + num_ranks - 1 - (j * pp + s)
                    mesh.extend(rank * tp + t for t in range(tp))
        return tuple(mesh)

    @staticmethod
    def _fused_need(ctx, cand: FusedCandidate, peak_gb: float = 0.0) -> MemoryNeed:
        """Both models' training states on every device of the fused stage, and its activation peak
        (the peak of the fused schedule, which both training tasks hold)."""
        cm = ctx.cost_model
        a, c = cand.actor, cand.critic
        return MemoryNeed({"actor": cm.training_state_gb(ctx.model("actor"), a.dp, a.tp, a.pp, a.zero_stage, ep=a.ep,
                                                         etp=a.etp),
                           "critic": cm.training_state_gb(ctx.model("critic"), c.dp, c.tp, c.pp, c.zero_stage,
                                                          ep=c.ep, etp=c.etp)},
                          {"update_actor": peak_gb, "update_critic": peak_gb})

    def _mem_cap(self, ctx, layouts: LayoutSearch, cand: FusedCandidate) -> float:
        """Activation memory the fused schedule may hold per device: what is left beside both
        models' training states, the ref and reward weights (or the most the shared inference
        layout still to be chosen will need, if more) and everything else resident, provided the
        other tasks' working sets fit there too."""
        return layouts.ledger.headroom_gb(self._fused_need(ctx, cand), "training")

    def _fused_candidates(self, ctx, layouts: LayoutSearch):
        from systems.rlhfuse.intra import fused_pipes

        w, cm, n = ctx.workload, ctx.cost_model, ctx.num_devices
        base_a, base_c = layouts.chosen["update_actor"].strategy, layouts.chosen["update_critic"].strategy
        actor, critic = ctx.model("actor"), ctx.model("critic")
        seq = float((layouts.batch.prompt_lens + layouts.batch.output_lens).mean())
        # micro-batches of micro_batch_size samples, or under sequence packing the planned bins of a
        # mini-batch dealt over each model's replicas, each of nearly equal tokens (as single_pipe_stage
        # plans a packed stage), their activations counted at the budget's worth of the longest samples
        packed = packed_stage_args(ctx)
        budget, bins = packed["micro_batch_tokens"], packed["packed_bins"]
        at_longest = packing.samples_at_longest(w.micro_batch_size, budget, layouts.seq_max)

        def micro_batches(dp: int) -> Optional[tuple[int, float]]:
            """(micro-batches per replica, samples in each) for ``dp`` replicas; None if they do not divide."""
            if budget is None:
                return None if w.mini_batch_size % (dp * w.micro_batch_size) else \
                    (w.mini_batch_size // (dp * w.micro_batch_size), float(w.micro_batch_size))
            if w.mini_batch_size % dp:
                return None
            m = packing.per_replica(bins, dp)
            return m, packing.samples_per_microbatch(w.mini_batch_size, dp, m)
        # a layout the user pinned (system.layouts.update_actor / update_critic) keeps its pp in the
        # fused stage; the others try half and twice the base search's pp
        pp_a_choices = [base_a.pp] if "update_actor" in layouts.pinned else _pp_choices(base_a.pp, actor.num_layers)
        pp_c_choices = [base_c.pp] if "update_critic" in layouts.pinned else _pp_choices(base_c.pp, critic.num_layers)
        for tp in sorted({base_a.tp, base_c.tp}):
            for pp_a in pp_a_choices:
                for pp_c in pp_c_choices:
                    num_ranks = math.lcm(pp_a, pp_c)
                    if (n % (num_ranks * tp) or tp not in divisors(ctx.cluster.gpus_per_node)
                            or not tp_splits_heads(tp, [actor, critic])):
                        continue
                    groups = n // (num_ranks * tp)
                    dp_a, dp_c = groups * num_ranks // pp_a, groups * num_ranks // pp_c
                    split_a, split_c = micro_batches(dp_a), micro_batches(dp_c)
                    if split_a is None or split_c is None:
                        continue
                    (m_a, samples_a), (m_c, samples_c) = split_a, split_c
                    # a MoE model keeps the base layout's expert parallelism where it divides the new dp
                    sa = ParallelStrategy(dp_a, tp, pp_a, self.cfg.zero_stage, *_kept_ep(base_a, dp_a, tp))
                    sc = ParallelStrategy(dp_c, tp, pp_c, self.cfg.zero_stage, *_kept_ep(base_c, dp_c, tp))
                    pipes = fused_pipes(pp_a, pp_c, m_a, m_c, "actor", "critic")
                    # a MoE model's ep groups' reach on the meshes the plan gives it (_fused_meshes); a
                    # dense model has none, and its meshes are not built here
                    meshes = self._fused_meshes(n, sa, sc) if max(sa.ep, sc.ep) > 1 else None
                    ep_spans = {"actor": Allocation(meshes[0], sa).ep_span if sa.ep > 1 else None,
                                "critic": Allocation(meshes[1], sc).ep_span if sc.ep > 1 else None}
                    costs = {}
                    for name, pipe in pipes.items():
                        model = actor if pipe.model == "actor" else critic
                        strategy = sa if pipe.model == "actor" else sc
                        samples = samples_a if pipe.model == "actor" else samples_c
                        p2p = (cm.p2p_s(samples * seq * model.hidden_size * 2 / tp, 0, tp) if pipe.num_stages > 1
                               else 0.0)
                        # activation memory at the longest sequence, as the memory check counts it
                        costs[name] = training_pipe_costs(cm, model, pipe.num_stages, tp, samples, seq,
                                                          layouts.seq_max, w.activation_recompute, p2p,
                                                          strategy.ep, ep_spans[pipe.model], strategy.etp,
                                                          activation_samples=at_longest)
                    cand = FusedCandidate(sa, sc, pipes, costs, math.inf)
                    act_need = max(c.activation[0] for c in costs.values())
                    if self._mem_cap(ctx, layouts, cand) < 2 * act_need:
                        continue
                    yield cand


def _kept_ep(base: ParallelStrategy, dp: int, tp: int) -> tuple[int, Optional[int]]:
    """``(ep, etp)`` of a fused candidate with ``dp`` replicas of ``tp`` ranks: the base layout's
    expert parallelism (with its expert tensor parallelism, where ``ep * etp`` divides ``dp * tp``)
    where it fits, else ``ep`` alone where it divides ``dp``, else none."""
    if base.etp is not None and base.etp != tp and (dp * tp) % (base.ep * base.etp) == 0:
        return base.ep, base.etp
    return (base.ep, None) if dp % base.ep == 0 else (1, None)


register_system_config("rlhfuse", RLHFuseConfig)
