"""Where each model's weights live on ``backend=ray``, and which copies of them are current.

A model's *home* is the layout of its training task (actor, critic), else of its first inference
task (ref and reward are never trained): the workers create it from the seeded initial weights (or
a checkpoint) and it is always current. A copy in another task's layout is current when a weight
movement filled it after the model's last training step (:class:`ModelHomes`); a task about to
compute with a stale copy has it refreshed first.
"""
from __future__ import annotations

from harness.backends.ray.driver.experience import stable_seed
from harness.core.plan import Allocation, Plan, TaskKind
from harness.core.units import execution_units
from harness.errors import PlanError
from harness.real.model import ModelArgs
from harness.real.parallel.store import layout_key

ROLES = ("actor", "critic", "ref", "reward")


def model_args(models) -> dict[str, ModelArgs]:
    return {role: ModelArgs.from_llama_config(getattr(models, role), value_head=role in ("critic", "reward"))
            for role in ROLES}


def role_seeds(seed: int, args: dict[str, ModelArgs]) -> dict[str, int]:
    """The reference model is the initial policy and the critic starts from the reward model
    (InstructGPT, Ouyang et al. 2022 section 3.5; DeepSpeed-Chat step 3) when dimensions match."""
    seeds = {"actor": stable_seed("init", seed, "actor"), "reward": stable_seed("init", seed, "reward")}
    seeds["ref"] = seeds["actor"] if args["ref"] == args["actor"] else stable_seed("init", seed, "ref")
    seeds["critic"] = seeds["reward"] if args["critic"] == args["reward"] else stable_seed("init", seed, "critic")
    return seeds


def plan_roles(plan: Plan) -> tuple[str, ...]:
    """The models ``plan`` computes with, in :data:`ROLES` order (a critic-free algorithm has no
    critic, one without a KL term no reference model, a rule-based reward no reward model)."""
    present = {t.model.value for t in plan.tasks}
    return tuple(role for role in ROLES if role in present)


def home_task(plan: Plan, role: str):
    """The task whose layout holds ``role``'s weights between uses: its training task, else its
    first inference task (ref and reward are never trained)."""
    of_role = [t for t in plan.tasks if t.model == role]
    for kind in (TaskKind.TRAIN, TaskKind.INFERENCE):
        for t in of_role:
            if t.kind == kind:
                return t
    raise PlanError(f"plan of {plan.system} has no training or inference task for the {role} model")


class ModelHomes:
    """Each model's home layout and weight version (its training steps so far), and the version
    each copy in another layout holds."""

    def __init__(self, plan: Plan):
        roles = plan_roles(plan)
        self.home: dict[str, Allocation] = {role: home_task(plan, role).allocation for role in roles}
        self.version: dict[str, int] = dict.fromkeys(roles, 0)
        self._copies: dict[tuple[str, str], int] = {}  # (role, layout) -> version it holds

    def is_home(self, role: str, alloc: Allocation) -> bool:
        return layout_key(alloc) == layout_key(self.home[role])

    def current(self, role: str, alloc: Allocation) -> bool:
        """Whether ``role``'s weights in ``alloc`` are the latest."""
        return self.is_home(role, alloc) or self._copies.get((role, layout_key(alloc))) == self.version[role]

    def held(self, role: str, alloc: Allocation) -> int | None:
        """The version of ``role``'s weights in ``alloc`` (None: no copy there)."""
        return self.version[role] if self.is_home(role, alloc) else self._copies.get((role, layout_key(alloc)))

    def refreshed(self, role: str, alloc: Allocation) -> None:
        """A weight movement filled the copy in ``alloc`` with the current weights."""
        self._copies[(role, layout_key(alloc))] = self.version[role]

    def freed(self, role: str, alloc: Allocation) -> None:
        self._copies.pop((role, layout_key(alloc)), None)

    def trained(self, role: str) -> None:
        """A training step changed the home weights: every copy is stale now."""
        self.version[role] += 1

    def transient_copies(self, plan: Plan) -> dict[tuple[str, str], tuple[Allocation, set[str]]]:
        """(model, layout) -> (allocation, tasks using it) for every copy of a model in a layout other
        than its home that the plan does not keep resident (``Plan.resident``): the driver frees such a
        copy once every task using it has finished; a movement filling a copy counts as a use."""
        resident = {(r.model.value, layout_key(plan.task(r.task).allocation)) for r in plan.resident}
        out: dict[tuple[str, str], tuple[Allocation, set[str]]] = {}
        for t in plan.tasks:
            role, key = t.model.value, layout_key(t.allocation)
            if t.kind == TaskKind.WEIGHT_MOVEMENT or self.is_home(role, t.allocation) or (role, key) in resident:
                continue
            out.setdefault((role, key), (t.allocation, set()))[1].add(t.name)
        for m in plan.weight_movements:
            entry = out.get((m.model.value, layout_key(m.target)))
            if entry is not None:
                entry[1].add(m.task)
        return out


def stale_movement_sources(plan: Plan) -> list[str]:
    """Weight movements whose source layout would hold stale weights when they run (the model trained
    since that copy was last filled), replaying two iterations in the plan's unit order. Such a plan
    is refused: moving from the home layout instead would use devices the scheduler did not give
    the movement (:func:`harness.planning.scheduler.unit_devices` claims the source layout's)."""
    homes, stale = ModelHomes(plan), []
    for _ in range(2):  # the second iteration starts from the first's versions
        for unit in execution_units(plan):
            for task in unit.tasks:
                move = plan.movement_of(task.name) if task.kind == TaskKind.WEIGHT_MOVEMENT else None
                if move is not None:
                    if not homes.current(move.model.value, move.source) and move.task not in stale:
                        stale.append(move.task)
                    homes.refreshed(move.model.value, move.target)
                elif task.kind == TaskKind.TRAIN:
                    homes.trained(task.model.value)
    return stale
