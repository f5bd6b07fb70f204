"""Per-task brute-force layout search (RLHFuse-Base, RLHFuse section 7), shared by every system
that chooses one (dp, tp, pp) per task on a given pool of devices.

Training layouts are searched first, actor and critic together, since their states stay resident
and bound the memory left for everything else; then inference, then generation (whose KV cache
gets what is left). Each candidate is scored by the simulator's own task model
(:mod:`harness.planning.estimate`) on a representative batch, and must fit in memory.

**Memory.** A :class:`~harness.planning.memory.MemoryLedger` counts, as each layout is chosen,
what :func:`~harness.planning.memory.check_plan_memory` will count in the plan: every state that
stays resident on the pool's devices (both trained models' weights, gradients and optimizer
states; ref and reward weights) plus the largest working set of a task there (a training stage's
peak in-flight activations, an inference pass's activations and non-resident weights, generation's
weights and KV cache). Before the first choice, the search reserves the cheapest way to make every
later one (:meth:`LayoutSearch.expect`), so a fast training layout cannot leave too little memory
for ref, reward, critic inference or generation; a choice then fits when it fits beside what is
chosen and what is reserved. Where nothing fits, slower layouts are tried in turn rather than
refusing the plan:

1. every (dp, tp, pp) at the configured ZeRO stage (more tp and pp shard more);
2. training also at higher ZeRO stages (2: gradients, 3: weights too, sharded over dp; data
   parallelism only, pp = 1, as DeepSpeed and FSDP run them);
3. training 1F1B holding fewer micro-batches in flight (pp/2, pp/4, ..., 1: less activation
   memory, more pipeline bubbles; :func:`one_f_one_b_limited`);
4. the same three again with ref and reward weights offloaded to host memory between uses
   (copied in over PCIe before each pass, as the simulator charges), when the system allows it
   (``offload``; not for RLHFuse's streamed inference).

**Expert parallelism.** For mixture-of-experts models the training and inference candidates
include each (dp, tp, pp) at every expert-parallel degree of
:func:`~harness.planning.strategies.ep_options` (dense models: the (dp, tp, pp) alone, as
before). Generation layouts keep ``ep = 1`` unless pinned: a generation instance is one dp replica
that batches, finishes and (RLHFuse) is released on its own in the instance model
(:mod:`harness.planning.taskmodels.generation`), while an ep group would tie ``ep`` instances into
one engine; a MoE actor generates with its experts sharded over tp.

Each choice takes the fastest candidate of the first tier that has one that fits; so a plan that
fits with the fastest layouts is the one the search made before memory was counted this way. A
search refuses only when no candidate fits (:class:`~harness.planning.memory.NoLayoutFits`),
naming the smallest requirement per device and its terms. Not a lever here: activation
recomputation, a workload setting (``workload.activation_recompute``) that the plan IR does not
carry per task.

:class:`LayoutSearch` searches on all devices (``mesh`` defaults to the cluster);
:class:`PoolLayoutSearch` on a pool (interleaving's ref/reward groups, disaggregation's pools).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable, Optional

from harness.errors import PlanError
from harness.core.plan import Allocation, GenerationPolicy, ParallelStrategy, Plan, Task, TrainingStage
from harness.planning.estimate import generation_s, inference_s, representative_batch, training_bound_s, training_s
from harness.planning.memory import (MemoryLedger, MemoryNeed, MemoryShortfall, NoLayoutFits, check_plan_memory,
                                     fused_attention, inference_activation_gb, kv_one_sample_gb,
                                     one_f_one_b_activation_gb)
from harness.planning.strategies import (SearchResult, candidate_strategies, parse_layout, search,
                                         smallest_requirement)
from harness.planning.workflow import PPO_TASKS, check_layout_fits, full_mesh, packed_stage_args, single_pipe_stage
from harness.schedule import Action, PipeSpec, Schedule
from harness.system import PlanContext

TRAINING = (("update_actor", "actor"), ("update_critic", "critic"))
INFERENCE = ("ref", "reward", "values")  # those the run's algorithm has: LayoutSearch.inference
# A candidate is skipped only when its lower bound beats the best by more than this relative
# margin: the bound and the simulated time sum the same stage times in different orders.
BOUND_MARGIN = 1e-9
# later steps a search on all devices reserves memory for before choosing training layouts
ALL_LATER_STEPS = ("ref", "reward", "values", "gen")


class LayoutSearch:
    def __init__(self, ctx: PlanContext, name: str, zero_stage: int, pinned: Optional[dict[str, str]] = None,
                 mesh: Optional[tuple[int, ...]] = None, offload: bool = True):
        self.ctx, self.name, self.zero_stage = ctx, name, zero_stage
        self.cm, self.w = ctx.cost_model, ctx.workload
        self.mesh = tuple(mesh) if mesh is not None else full_mesh(ctx.num_devices)
        self.n = len(self.mesh)
        self.batch = representative_batch(ctx)
        self.capacity = self.cm.hbm_capacity_gb
        self.seq_max = int(self.w.prompt_len.max + self.w.max_gen_len)
        self.chosen: dict[str, SearchResult] = {}
        self.stages: dict[str, TrainingStage] = {}  # chosen training layouts' stages
        self.in_flight: dict[str, int] = {}  # training tasks whose 1F1B holds fewer micro-batches in flight
        self.ledger = MemoryLedger(self.capacity)
        self.offload = offload  # ref/reward weights may live in host memory when no resident layout fits
        self.offloaded: set[str] = set()
        # more ways of making later steps (offloaded weights), reserved only when training fits no other way
        self.fallback_options: dict[str, list[MemoryNeed]] = {}
        self.pinned = {t: v for t, v in (pinned or {}).items() if v}
        # the training and inference tasks of the run's algorithm (no critic: no values, no
        # update_critic; no KL term: no ref; a rule-based reward: no reward model)
        self.training = tuple((t, r) for t, r in TRAINING if r in ctx.roles)
        self.inference = tuple(t for t in INFERENCE if PPO_TASKS[t][1] in ctx.roles)

    @property
    def resident_gb(self) -> dict[str, float]:
        """States chosen to stay resident on the pool's devices, GB per device."""
        return self.ledger.resident

    def allocation(self, s: ParallelStrategy) -> Allocation:
        """``s`` on this search's devices, in the order the plan will give it (:meth:`Allocation.in_engine_order`)."""
        return Allocation.in_engine_order(self.mesh, s)

    def candidates(self, role: str, zero: int = 0, task: str = "",
                   shared_with: tuple[str, ...] = ()) -> list[ParallelStrategy]:
        """Layouts of ``role``'s model over the pool (the pinned one if ``task`` is pinned); a layout
        shared with other roles' models (``shared_with``) must shard their heads too. Expert-parallel
        degrees for MoE models, but not for ``gen`` (module docstring)."""
        if task in self.pinned:  # pinned by the user: checked, not searched
            pinned = parse_layout(self.pinned[task], zero, task)
            check_layout_fits(pinned, self.n, self.ctx.cluster.gpus_per_node, self.ctx.model(role).num_layers,
                              f"{self.name} {task} (system.layouts.{task})",
                              [self.ctx.model(r) for r in (role, *shared_with)])
            return [pinned]
        models = [self.ctx.model(r) for r in (role, *shared_with)]
        return list(candidate_strategies(self.n, self.ctx.cluster.gpus_per_node, models[0].num_layers, zero,
                                         models=models, expert_parallel=task != "gen"))

    def shared_candidates(self) -> list[ParallelStrategy]:
        """Layouts of the one inference layout ref, reward and the critic's values share (those of
        them the algorithm has)."""
        others = tuple(PPO_TASKS[t][1] for t in self.inference)
        return self.candidates("actor", 0, self.shared_pin(), shared_with=others)

    def _search(self, candidates, score, what: str) -> SearchResult:
        self.ctx.report(f"{self.name}: {what}, {len(candidates)} layouts")
        result = search(candidates, score, what, system=self.name)
        self.ctx.report(f"{self.name}: {what}: {result.strategy}, estimate {result.time_s:.3g} s")
        return result

    def _what(self, task_name: str) -> str:
        return task_name

    # ---- what each choice holds in memory (as check_plan_memory counts it) ----------------------
    def training_need(self, task: str, role: str, s: ParallelStrategy, in_flight: int) -> MemoryNeed:
        """Training states, and the activations of ``in_flight`` micro-batches on the first stage."""
        model = self.ctx.model(role)
        return MemoryNeed({role: self.cm.training_state_gb(model, s.dp, s.tp, s.pp, s.zero_stage, ep=s.ep, etp=s.etp)},
                          {task: one_f_one_b_activation_gb(self.cm, model, s, self.w, in_flight)})

    def inference_need(self, task: str, s: ParallelStrategy, offload: bool = False) -> MemoryNeed:
        """Ref and reward keep their weights resident (unless offloaded: then the pass holds them
        while it runs); the critic's inference copy is held only while ``values`` runs."""
        role = PPO_TASKS[task][1]
        model = self.ctx.model(role)
        weights = self.cm.weights_gb(model, s.tp, s.pp, ep=s.ep, etp=s.etp)
        act = inference_activation_gb(self.cm, model, s, self.w, fused_attention(self.ctx.engines))
        if role in ("ref", "reward") and not offload:
            return MemoryNeed({role: weights}, {task: act})
        return MemoryNeed({}, {task: weights + act})

    def shared_inference_need(self, s: ParallelStrategy) -> MemoryNeed:
        """Ref, reward and values in one layout (RLHFuse's inter-stage fusion)."""
        need = MemoryNeed()
        for task in self.inference:
            need = need + self.inference_need(task, s)
        return need

    def generation_need(self, s: ParallelStrategy) -> MemoryNeed:
        actor = self.ctx.model("actor")
        return MemoryNeed({}, {"gen": self.cm.weights_gb(actor, s.tp, s.pp, ep=s.ep, etp=s.etp) +
                               kv_one_sample_gb(self.cm, actor, s, self.w)})

    def options(self, step: str, offload: bool = False) -> list[MemoryNeed]:
        """Every way of making ``step`` (``ref``, ``reward``, ``values``, ``gen`` or ``shared``),
        as memory needs, for :meth:`expect`; with ``offload``, the ways with offloaded weights."""
        if step in INFERENCE:
            if offload and (not self.offload or step == "values"):
                return []
            return [self.inference_need(step, s, offload) for s in self.candidates(PPO_TASKS[step][1], 0, step)]
        if offload:
            return []
        if step == "gen":
            return [self.generation_need(s) for s in self.candidates("actor", 0, "gen")]
        if step == "shared":
            return [self.shared_inference_need(s) for s in self.shared_candidates()]
        raise ValueError(f"unknown planning step {step!r}")

    def expect(self, steps: Iterable[str]) -> None:
        """Reserve memory for ``steps``, to be chosen after the next ones: the cheapest way with
        resident weights; the ways with offloaded weights are reserved only if training fits no
        other way (:attr:`fallback_options`)."""
        for step in steps:
            if step in INFERENCE and step not in self.inference or step == "shared" and not self.inference:
                continue  # a task the algorithm does not have
            self.ledger.expect(step, self.options(step))
            offloaded = self.options(step, offload=True)
            if offloaded:
                self.fallback_options[step] = offloaded

    def shared_pin(self) -> str:
        return next((t for t in self.inference if t in self.pinned), self.inference[0] if self.inference else "ref")

    # ---- training: actor and critic together ----------------------------------------------------
    def training_tiers(self, task: str, role: str) -> list[list[tuple[ParallelStrategy, Optional[int]]]]:
        """Candidates (layout, micro-batches in flight; None = 1F1B's own) by tier: the configured
        ZeRO stage; higher ZeRO stages added (pp = 1); then 1F1B holding fewer micro-batches in
        flight (half, a quarter, ... of pp, down to one: more pipeline bubbles)."""
        base = [(s, None) for s in self.candidates(role, self.zero_stage, task)]
        if task in self.pinned:
            return [base]
        zero = base + [(replace(s, zero_stage=z), None) for z in (2, 3) if z > self.zero_stage
                       for s, _ in base if s.pp == 1 and s.dp > 1]
        fewer = [(s, k) for s, _ in zero for k in _halvings(s.pp)]
        return [base, zero, zero + fewer]

    def training_stage(self, task: str, role: str, s: ParallelStrategy, in_flight: Optional[int] = None
                       ) -> TrainingStage:
        """The task's own 1F1B stage (raises PlanError when the mini-batch does not split over dp)."""
        w = self.w
        stage = single_pipe_stage(task, role, s, w.mini_batch_size, w.micro_batch_size, w.global_batch_size,
                                  **packed_stage_args(self.ctx))
        if in_flight is None:
            return stage
        pipe = next(iter(stage.schedule.pipes.values()))
        return replace(stage, schedule=one_f_one_b_limited(pipe, in_flight))

    def search_training(self) -> None:
        """The fastest actor and critic layouts (sum of estimated times) that fit together, beside
        what is resident and the cheapest way of making the later steps; the lowest tier that has
        such a pair wins (:meth:`training_tiers`), first with the later steps' weights resident,
        then allowing them to be offloaded (:attr:`fallback_options`). Without a critic, the
        fastest actor layout that fits, by the same rules."""
        w = self.w
        self.ctx.report(f"{self.name}: " + " and ".join(role for _, role in self.training) + " training layouts")
        tiers = {task: self.training_tiers(task, role) for task, role in self.training}
        levels = max(len(t) for t in tiers.values())
        stages, times, bounds = {}, {}, {}
        fallback = [(step, opts) for step, opts in self.fallback_options.items() if step in self.ledger.later]

        def need_of(task, role, cand):
            s, k = cand
            if (task, cand) not in stages:
                try:
                    stages[task, cand] = self.training_stage(task, role, s, k)
                except PlanError:  # the mini-batch does not split over dp in micro-batches
                    stages[task, cand] = None
            stage = stages[task, cand]
            if stage is None:
                return None
            num_mbs = next(iter(stage.schedule.pipes.values())).num_mbs
            if k is not None and k >= min(s.pp, num_mbs):
                return None  # holds no fewer than 1F1B itself
            return self.training_need(task, role, s, min(s.pp, num_mbs, k or s.pp))

        def time_of(task, role, cand):
            if (task, cand) not in times:
                times[task, cand] = training_s(self.ctx, Task(task, "train", role, self.allocation(cand[0])),
                                               stages[task, cand], w.mini_batch_size, self.batch)
            return times[task, cand]

        def bound_of(task, role, cand):  # <= time_of, without timing a schedule
            if (task, cand) not in bounds:
                bounds[task, cand] = training_bound_s(self.ctx, Task(task, "train", role, self.allocation(cand[0])),
                                                      stages[task, cand], w.mini_batch_size, self.batch)
            return bounds[task, cand]

        plans = [(False, level) for level in range(levels)] + ([(True, level) for level in range(levels)]
                                                               if fallback else [])
        for escalate, level in plans:
            if escalate and level == 0:  # reserve for the later steps' offloaded ways too
                for step, opts in fallback:
                    self.ledger.expect(step, self.ledger.later[step] + opts)
            cands = {task: tiers[task][min(level, len(tiers[task]) - 1)] for task, _ in self.training}
            needs = {task: [(c, need_of(task, role, c)) for c in cands[task]] for task, role in self.training}
            needs = {task: [(c, n) for c, n in v if n is not None] for task, v in needs.items()}
            if not all(needs.values()):
                continue
            if len(self.training) == 1:  # the actor alone
                best = self._fastest_alone(needs, time_of, bound_of)
            else:
                best = self._fastest_pair(needs, time_of, bound_of)
            if best is not None:
                for task, role, cand, _ in best:
                    self.chosen[task] = SearchResult(cand[0], time_of(task, role, cand),
                                                     len({c for c, _ in cands[task]}))
                    self.stages[task] = stages[task, cand]
                    if cand[1] is not None:
                        self.in_flight[task] = cand[1]
                total = best[0][3]
                for _, _, _, need in best[1:]:
                    total = total + need
                self.ledger.commit("training", total)
                return
        self._refuse_training([tiers[task][-1] for task, _ in self.training], need_of)

    def _fastest_alone(self, needs, time_of, bound_of):
        """The fastest fitting candidate of the one training task: ``((task, role, cand, need),)``."""
        [(task, role)] = self.training
        best = None
        for cand, need in needs[task]:
            if self.ledger.total_gb(need, "training") > self.capacity + 1e-9:
                continue
            if best is not None and bound_of(task, role, cand) * (1 - BOUND_MARGIN) > best[0]:
                continue
            t = time_of(task, role, cand)
            if best is None or t < best[0]:
                best = (t, cand, need)
        return None if best is None else ((task, role, best[1], best[2]),)

    def _fastest_pair(self, needs, time_of, bound_of):
        """The fastest pair of actor and critic candidates that fit together:
        ``((task, role, cand, need), (task, role, cand, need))``."""
        (ta, ra), (tc, rc) = self.training

        def least(task, role):  # a lower bound of the partner's need: its smallest state and activations
            return MemoryNeed({role: min(n.resident[role] for _, n in needs[task])},
                              {task: min(n.working[task] for _, n in needs[task])})
        plausible = {}
        for (task, role), (other, other_role) in ((self.training[0], self.training[1]),
                                                  (self.training[1], self.training[0])):
            partner = least(other, other_role)
            plausible[task] = [(c, n) for c, n in needs[task]
                               if self.ledger.total_gb(n + partner, "training") <= self.capacity + 1e-9]
        best = None
        for ca, na in plausible[ta]:
            for cc, nc in plausible[tc]:
                if self.ledger.total_gb(na + nc, "training") > self.capacity + 1e-9:
                    continue
                if best is not None and (bound_of(ta, ra, ca) + bound_of(tc, rc, cc)) * (1 - BOUND_MARGIN) > best[0]:
                    continue  # cannot beat the best pair: skip timing its schedules (same choice, fewer simulations)
                t = time_of(ta, ra, ca) + time_of(tc, rc, cc)
                if best is None or t < best[0]:
                    best = (t, ca, na, cc, nc)
        if best is None:
            return None
        _, ca, na, cc, nc = best
        return (ta, ra, ca, na), (tc, rc, cc, nc)

    def training_stages(self) -> list[TrainingStage]:
        """The chosen training layouts' stages (each task's own 1F1B, or one holding fewer
        micro-batches in flight when only that fits), for the plan assembler."""
        return [self.stages[task] for task, _ in self.training]

    def memory_notes(self, training: bool = True) -> dict[str, str]:
        """``memory/...`` plan notes naming the slower choices taken so that the plan fits (none
        when the fastest layouts fit); ``training``: this search's training stages are the plan's."""
        notes = {}
        if training:
            for task, _ in self.training:
                s = self.chosen[task].strategy if task in self.chosen else None
                if s is not None and s.zero_stage > self.zero_stage:
                    notes[f"memory/{task}"] = f"ZeRO-{s.zero_stage} (system.zero_stage={self.zero_stage})"
                if task in self.in_flight:
                    notes[f"memory/{task}"] = f"1F1B with {self.in_flight[task]} micro-batches in flight " \
                                              f"(of {s.pp} stages)"
        if self.offloaded:
            notes["memory/offloaded"] = ", ".join(sorted(self.offloaded)) + " weights in host memory between uses"
        return notes

    def _refuse_training(self, candidates: list, need_of) -> None:
        if len(self.training) == 1:
            self._refuse_actor_training(candidates[0], need_of)
        cands_a, cands_c = candidates
        (ta, ra), (tc, rc) = self.training
        pairs = [(ca, need_of(ta, ra, ca), cc, need_of(tc, rc, cc)) for ca in cands_a for cc in cands_c]
        pairs = [(ca, na, cc, nc) for ca, na, cc, nc in pairs if na is not None and nc is not None]
        what = f"update_actor+update_critic{self._where()}"
        if not pairs:
            raise PlanError(f"{self.name}: no feasible parallel strategy for {what}: the mini-batch of "
                            f"{self.w.mini_batch_size} samples splits over none of the layouts")
        ca, na, cc, nc = min(pairs, key=lambda p: self.ledger.total_gb(p[1] + p[3], "training"))
        total = self.ledger.total_gb(na + nc, "training")
        shortfall = MemoryShortfall(total, self.capacity, self.ledger.describe(na + nc, "training"))
        name = {c: f"{c[0]}" + (f" ({c[1]} in flight)" if c[1] else "") for c in (ca, cc)}
        raise NoLayoutFits(f"{self.name}: no feasible parallel strategy for {what} among "
                           f"{len(cands_a)} x {len(cands_c)} candidates"
                           f"{smallest_requirement([(f'actor {name[ca]} with critic {name[cc]}', shortfall)])} "
                           f"({self.cm.gpu.hbm_gb:g} GB x {self.cm.gpu.usable_memory_frac:g})")

    def _refuse_actor_training(self, cands, need_of) -> None:
        [(task, role)] = self.training
        needs = [(c, need_of(task, role, c)) for c in cands]
        needs = [(c, n) for c, n in needs if n is not None]
        what = f"{task}{self._where()}"
        if not needs:
            raise PlanError(f"{self.name}: no feasible parallel strategy for {what}: the mini-batch of "
                            f"{self.w.mini_batch_size} samples splits over none of the layouts")
        c, n = min(needs, key=lambda cn: self.ledger.total_gb(cn[1], "training"))
        shortfall = MemoryShortfall(self.ledger.total_gb(n, "training"), self.capacity,
                                    self.ledger.describe(n, "training"))
        name = f"{c[0]}" + (f" ({c[1]} in flight)" if c[1] else "")
        raise NoLayoutFits(f"{self.name}: no feasible parallel strategy for {what} among {len(cands)} candidates"
                           f"{smallest_requirement([(f'{role} {name}', shortfall)])} "
                           f"({self.cm.gpu.hbm_gb:g} GB x {self.cm.gpu.usable_memory_frac:g})")

    def _where(self) -> str:
        return ""

    # ---- inference ----------------------------------------------------------------------------
    def search_inference(self, shared: bool = False) -> None:
        """One layout per inference task, or (``shared``) one layout for all of them (those the
        algorithm has), scored by their sum; nothing when it has none."""
        if shared and not self.inference:
            return
        if shared:
            def score_all(s: ParallelStrategy) -> float:
                self.ledger.require(self.shared_inference_need(s), "shared")
                return sum(inference_s(self.ctx, Task(t, "inference", PPO_TASKS[t][1], self.allocation(s)),
                                       self.batch) for t in self.inference)
            result = self._search(self.shared_candidates(), score_all,
                                  "inference (shared layout)")
            self.chosen.update({t: result for t in self.inference})
            self.ledger.commit("shared", self.shared_inference_need(result.strategy))
        else:
            for task_name in self.inference:
                self.search_inference_task(task_name)

    def search_inference_task(self, task_name: str) -> SearchResult:
        """One inference task's layout: resident weights if any layout fits, else (ref and reward,
        when allowed) offloaded ones; ref/reward weights become resident once chosen."""
        role = PPO_TASKS[task_name][1]
        cands = self.candidates(role, 0, task_name)
        tiers = [False] + ([True] if self.offload and role in ("ref", "reward") else [])
        for offload in tiers:
            def score(s: ParallelStrategy, offload=offload) -> float:
                self.ledger.require(self.inference_need(task_name, s, offload), task_name)
                t = inference_s(self.ctx, Task(task_name, "inference", role, self.allocation(s)), self.batch)
                if offload:  # weights copied in from host memory before the pass, as the simulator charges
                    weights_gb = self.cm.weights_gb(self.ctx.model(role), s.tp, s.pp, ep=s.ep, etp=s.etp)
                    t += self.cm.host_transfer_s(weights_gb * 1e9)
                return t
            what = self._what(task_name) + (" (weights offloaded)" if offload else "")
            try:
                result = self._search(cands, score, what)
            except PlanError:
                if offload == tiers[-1]:
                    raise
                continue
            self.chosen[task_name] = result
            self.ledger.commit(task_name, self.inference_need(task_name, result.strategy, offload))
            if offload:
                self.offloaded.add(role)
            return result
        raise AssertionError("unreachable")

    # ---- generation ---------------------------------------------------------------------------
    def kv_capacity_gb(self, s: ParallelStrategy) -> float:
        """Memory a generation instance in layout ``s`` may fill with KV cache beside the resident states."""
        actor_weights = self.cm.weights_gb(self.ctx.model("actor"), s.tp, s.pp, ep=s.ep, etp=s.etp)
        return self.capacity - sum(self.ledger.resident.values()) - actor_weights

    def search_generation(self, policy: GenerationPolicy) -> None:
        best_s = [math.inf]  # the search keeps the first strictly fastest: a slower candidate may stop early

        def score(s: ParallelStrategy) -> float:
            self.ledger.require(self.generation_need(s), "gen")
            t = generation_s(self.ctx, Task("gen", "generate", "actor", self.allocation(s)), policy,
                             self.batch, self.kv_capacity_gb(s), stop_above=best_s[0])
            best_s[0] = min(best_s[0], t)
            return t
        self.chosen["gen"] = self._search(self.candidates("actor", 0, "gen"), score, self._what("gen"))
        self.ledger.commit("gen", self.generation_need(self.chosen["gen"].strategy))


def _halvings(pp: int) -> list[int]:
    """pp // 2, pp // 4, ..., 1 (empty for pp = 1)."""
    out, k = [], pp // 2
    while k >= 1:
        out.append(k)
        k //= 2
    return out


def one_f_one_b_limited(pipe: PipeSpec, in_flight: int) -> Schedule:
    """1F1B (PipeDream-flush) on ``pipe`` with at most ``in_flight`` micro-batches in flight per
    stage: stage ``s`` runs min(P - s - 1, in_flight - 1) warm-up forwards instead of P - s - 1, then
    alternates one forward / one backward. Less activation memory, more bubbles (``in_flight`` = 1
    runs one micro-batch through the pipeline at a time)."""
    num_mbs = pipe.num_mbs
    order = {}
    for stage in range(pipe.num_stages):
        warmup = min(pipe.num_stages - stage - 1, in_flight - 1, num_mbs)
        fwd = [Action(pipe.name, stage, "F", mb) for mb in range(num_mbs)]
        bwd = [Action(pipe.name, stage, "B", mb) for mb in range(num_mbs)]
        actions = fwd[:warmup]
        for i in range(num_mbs - warmup):
            actions += [fwd[warmup + i], bwd[i]]
        actions += bwd[num_mbs - warmup:]
        order[pipe.stage_to_rank[stage]] = actions
    return Schedule({pipe.name: pipe}, order)


def search_notes(chosen: dict[str, SearchResult], meshes: Optional[dict[str, tuple[int, ...]]] = None
                 ) -> dict[str, str]:
    """``search/<task>`` plan notes: the chosen strategy (on how many devices, when ``meshes`` says),
    the candidates tried and the estimated time."""
    def where(task: str) -> str:
        return f" on {len(meshes[task])} devices" if meshes is not None else ""
    return {f"search/{k}": f"{r.strategy}{where(k)} ({r.num_candidates} candidates, est. {r.time_s:.2f} s)"
            for k, r in chosen.items()}


def checked(plan: Plan, ctx: PlanContext) -> Plan:
    """``plan`` after :func:`~harness.planning.memory.check_plan_memory`. The searches keep every
    choice inside device memory by the check's own arithmetic, so this raises only if the two
    disagree (a bug), with the check's full breakdown."""
    check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    return plan


class PoolLayoutSearch(LayoutSearch):
    """The same search on a pool of devices (``mesh``). Its ledger holds what stays on the pool's
    devices all iteration (copy another pool's ledger in when their states share the devices)."""

    def __init__(self, ctx: PlanContext, name: str, zero_stage: int, mesh: tuple[int, ...], offload: bool = True):
        super().__init__(ctx, name, zero_stage, mesh=mesh, offload=offload)

    def _what(self, task_name: str) -> str:
        return f"{task_name} on {self.n} devices"

    def _where(self) -> str:
        return f" on {self.n} devices"
