"""Per-task brute-force layout search (RLHFuse-Base, RLHFuse section 7), shared by every system
that chooses one (dp, tp, pp) per task on a given pool of devices.

Training layouts are searched first, since their states stay resident and bound the memory left
for everything else; then inference, then generation (whose KV cache gets what is left). Each
candidate is scored by the simulator's own task model (:mod:`harness.planning.estimate`) on a
representative batch, and must fit in memory next to what is already resident.

:class:`LayoutSearch` searches on all devices (``mesh`` defaults to the cluster);
:class:`PoolLayoutSearch` on a pool (interleaving's ref/reward groups, disaggregation's pools), where
an inference candidate must also hold one layer's forward activations, as the memory check counts
an inference task.
"""
from __future__ import annotations

from typing import Optional

from harness.errors import PlanError
from harness.plan import Allocation, GenerationPolicy, ParallelStrategy, Task
from harness.planning.estimate import generation_s, inference_s, representative_batch, training_s
from harness.planning.strategies import SearchResult, candidate_strategies, parse_layout, search
from harness.planning.workflow import PPO_TASKS, check_layout_fits, full_mesh, single_pipe_stage
from harness.system import PlanContext


class LayoutSearch:
    def __init__(self, ctx: PlanContext, name: str, zero_stage: int, pinned: Optional[dict[str, str]] = None,
                 mesh: Optional[tuple[int, ...]] = None):
        self.ctx, self.name, self.zero_stage = ctx, name, zero_stage
        self.cm, self.w = ctx.cost_model, ctx.workload
        self.mesh = tuple(mesh) if mesh is not None else full_mesh(ctx.num_devices)
        self.n = len(self.mesh)
        self.batch = representative_batch(ctx)
        self.capacity = self.cm.hbm_capacity_gb
        self.seq_max = int(self.w.prompt_len.max + self.w.max_gen_len)
        self.chosen: dict[str, SearchResult] = {}
        self.resident_gb: dict[str, float] = {}
        # per-device memory that states chosen later will hold (e.g. ref/reward weights found by a
        # previous pass): training candidates must leave room for it (:func:`search_until_fits`)
        self.reserved_gb: dict[str, float] = {}
        self.pinned = {t: v for t, v in (pinned or {}).items() if v}

    def candidates(self, role: str, zero: int = 0, task: str = "") -> list[ParallelStrategy]:
        if task in self.pinned:  # pinned by the user: checked, not searched
            pinned = parse_layout(self.pinned[task], zero, task)
            check_layout_fits(pinned, self.n, self.ctx.cluster.gpus_per_node, self.ctx.model(role).num_layers,
                              f"{self.name} {task} (system.layouts.{task})")
            return [pinned]
        return list(candidate_strategies(self.n, self.ctx.cluster.gpus_per_node, self.ctx.model(role).num_layers, zero))

    def _search(self, candidates, score, what: str) -> SearchResult:
        return search(candidates, score, what, system=self.name)

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
                held = sum(self.resident_gb.values()) + sum(self.reserved_gb.values())
                if need + held > self.capacity:
                    raise PlanError(f"needs {need:.1f} GB" + (f" beside {held:.1f} GB held by other models"
                                                              if held else ""))
                task = Task(task_name, "train", role, Allocation(self.mesh, s))
                return training_s(self.ctx, task, stage, w.mini_batch_size, self.batch)
            self.chosen[task_name] = self._search(self.candidates(role, self.zero_stage, task_name), score, task_name)
            s = self.chosen[task_name].strategy
            self.resident_gb[role] = cm.training_state_gb(self.ctx.model(role), s.dp, s.tp, s.pp, s.zero_stage)

    def inference_fits(self, roles: list[str], s: ParallelStrategy) -> None:
        """Raise PlanError when the weights of ``roles`` in layout ``s`` do not fit beside the
        resident states. Resident inference-only weights (ref, reward) of ``roles`` are not counted
        twice: layout ``s`` replaces theirs; trained models' states stay resident beside it."""
        need = sum(self.cm.weights_gb(self.ctx.model(r), s.tp, s.pp) for r in roles)
        held = sum(v for k, v in self.resident_gb.items() if not (k in roles and k in ("ref", "reward")))
        if need + held > self.capacity:
            raise PlanError(f"weights need {need:.1f} GB beside {held:.1f} GB resident")

    def search_inference(self, shared: bool = False) -> None:
        """One layout per inference task, or (``shared``) one layout for all three, scored by their sum."""
        tasks = ("ref", "reward", "values")
        if shared:
            roles = [PPO_TASKS[t][1] for t in tasks]

            def score_all(s: ParallelStrategy) -> float:
                self.inference_fits(roles, s)
                return sum(inference_s(self.ctx, Task(t, "inference", r, Allocation(self.mesh, s)), self.batch)
                           for t, r in zip(tasks, roles))
            pinned = next((t for t in tasks if t in self.pinned), "ref")
            result = self._search(self.candidates("actor", 0, pinned), score_all, "inference (shared layout)")
            self.chosen.update({t: result for t in tasks})
        else:
            for task_name in tasks:
                self.search_inference_task(task_name)

    def search_inference_task(self, task_name: str) -> SearchResult:
        """One inference task's layout; ref/reward weights become resident once chosen."""
        role = PPO_TASKS[task_name][1]

        def score(s: ParallelStrategy) -> float:
            self.inference_fits([role], s)
            return inference_s(self.ctx, Task(task_name, "inference", role, Allocation(self.mesh, s)), self.batch)
        self.chosen[task_name] = self._search(self.candidates(role, 0, task_name), score, self._what(task_name))
        if task_name in ("ref", "reward"):
            s = self.chosen[task_name].strategy
            self.resident_gb[role] = self.cm.weights_gb(self.ctx.model(role), s.tp, s.pp)
        return self.chosen[task_name]

    def _what(self, task_name: str) -> str:
        return task_name

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
        self.chosen["gen"] = self._search(self.candidates("actor", 0, "gen"), score, "gen")


def search_notes(chosen: dict[str, SearchResult], meshes: Optional[dict[str, tuple[int, ...]]] = None
                 ) -> dict[str, str]:
    """``search/<task>`` plan notes: the chosen strategy (on how many devices, when ``meshes`` says),
    the candidates tried and the estimated time."""
    def where(task: str) -> str:
        return f" on {len(meshes[task])} devices" if meshes is not None else ""
    return {f"search/{k}": f"{r.strategy}{where(k)} ({r.num_candidates} candidates, est. {r.time_s:.2f} s)"
            for k, r in chosen.items()}


def search_until_fits(search_pass, max_passes: int = 3):
    """Run ``search_pass(reserved_gb) -> (plan, layouts)`` until its plan fits in device memory.

    A first pass chooses training layouts before it knows which inference layouts (and so how
    much resident ref/reward weight memory) will sit beside them; when the assembled plan then does
    not fit (:func:`harness.planning.memory.check_plan_memory`), the next pass reserves what the
    previous one left resident besides the training states, so training chooses a more sharded
    layout that fits instead of the plan being refused. Raises the last PlanMemoryError when no
    pass fits."""
    from harness.errors import PlanMemoryError
    from harness.planning.memory import check_plan_memory

    reserved: dict[str, float] = {}
    for attempt in range(max_passes):
        plan, layouts = search_pass(reserved)
        try:
            check_plan_memory(plan, layouts.ctx.cost_model, layouts.ctx.models, layouts.ctx.workload)
            if attempt:
                plan.notes["search/memory_passes"] = attempt + 1
            return plan
        except PlanMemoryError:
            if attempt == max_passes - 1:
                raise
            now = {k: v for k, v in layouts.resident_gb.items() if k not in ("actor", "critic")}
            if all(reserved.get(k, 0.0) >= v for k, v in now.items()):
                raise  # nothing new to reserve: another pass would choose the same layouts
            reserved = {k: max(v, reserved.get(k, 0.0)) for k, v in now.items()}


class PoolLayoutSearch(LayoutSearch):
    """The same search on a pool of devices (``mesh``). ``resident_gb`` holds what else stays on
    the pool's devices all iteration (set it before searching when other pools' states share them)."""

    def __init__(self, ctx: PlanContext, name: str, zero_stage: int, mesh: tuple[int, ...]):
        super().__init__(ctx, name, zero_stage, mesh=mesh)

    def inference_fits(self, roles: list[str], s) -> None:
        """Weights plus one layer's forward activations (as :mod:`harness.planning.memory` counts an
        inference task) must fit beside the resident states."""
        weights = sum(self.cm.weights_gb(self.ctx.model(r), s.tp, s.pp) for r in roles)
        act = max(self.cm.activation_gb(self.ctx.model(r), self.w.micro_batch_size, self.seq_max, s.tp, 1, "none")
                  for r in roles)
        if weights + act + sum(self.resident_gb.values()) > self.capacity:
            raise PlanError(f"weights need {weights:.1f} GB, activations {act:.1f} GB")

    def _what(self, task_name: str) -> str:
        return f"{task_name} on {self.n} devices"
