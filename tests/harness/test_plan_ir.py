"""The explicit plan IR: enums, stream edges, features, structural checks, JSON (current and legacy)."""
import copy
import json

import pytest

from harness.errors import PlanError
from harness.core.plan import (Allocation, Feature, GenerationPolicy, LengthDispatch, MigrationPolicy, ModelRole,
                               MovementKind, ParallelStrategy, Plan, ResidentState, Task, TaskKind, TrainingStage,
                               WeightMovement)
from harness.planning.assembler import assemble_ppo_plan
from harness.planning.workflow import PPO_TASKS
from harness.schedule import PipeSpec, build

FULL = Allocation((0, 1, 2, 3), ParallelStrategy(dp=2, tp=2))
OTHER = Allocation((0, 1, 2, 3), ParallelStrategy(dp=4))
ONE = Allocation((0,), ParallelStrategy())


def stage(tasks, num_pipes=None) -> TrainingStage:
    num_pipes = len(tasks) if num_pipes is None else num_pipes
    pipes = [PipeSpec("ABCDEFGH"[i], 1, 1, (0,), "actor") for i in range(num_pipes)]
    return TrainingStage(tuple(tasks), build("1f1b", pipes), num_minibatches=1, micro_batch_size=1)


def ppo_plan(tiny_ctx, allocations=None, **kw) -> Plan:
    allocs = {n: FULL for n in PPO_TASKS}
    allocs.update(allocations or {})
    generation = kw.pop("generation", GenerationPolicy())
    plan = assemble_ppo_plan(tiny_ctx, "test", allocs, generation, **kw)
    plan.validate(4)
    return plan


# ---- enums ----------------------------------------------------------------------------------------
def test_enums_coerce_from_strings():
    t = Task("gen", "generate", "actor", ONE)
    assert t.kind is TaskKind.GENERATE and t.model is ModelRole.ACTOR
    assert t.kind == "generate" and str(t.kind) == "generate" and str(t.model) == "actor"
    t = Task("x", TaskKind.WEIGHT_MOVEMENT, ModelRole.CRITIC, ONE, ["a"], ["b"])
    assert t.reads == ("a",) and t.writes == ("b",)
    m = WeightMovement("values", "critic", ONE, ONE, "per_replica")
    assert m.model is ModelRole.CRITIC and m.kind is MovementKind.PER_REPLICA
    assert WeightMovement("r", "actor", ONE, ONE).kind is MovementKind.REALLOC
    assert ResidentState("ref", "ref").model is ModelRole.REF


@pytest.mark.parametrize("kind,model,match", [
    ("decode", "actor", "unknown kind 'decode'"),
    ("generate", "policy", "unknown model 'policy'"),
    ("Generate", "actor", "unknown kind"),
])
def test_bad_kind_or_model_raises(kind, model, match):
    with pytest.raises(PlanError, match=match):
        Task("t", kind, model, ONE)


@pytest.mark.parametrize("kind", ["generate", "train", "weight_movement"])
def test_only_inference_tasks_consume_a_stream(kind):
    with pytest.raises(PlanError, match="only inference tasks consume a stream"):
        Task("t", kind, "actor", ONE, stream_from="gen")
    assert Task("t", "inference", "ref", ONE, stream_from="gen").stream_from == "gen"


def test_resident_state_and_generation_policy_checks():
    with pytest.raises(PlanError, match="expected train or weights"):
        ResidentState("actor", "gen", "grads")
    with pytest.raises(PlanError, match="continuous' or 'static"):
        GenerationPolicy("dynamic")


# ---- features -------------------------------------------------------------------------------------
def test_plain_plan_has_no_features(tiny_ctx):
    assert ppo_plan(tiny_ctx).features() == []


def test_features_are_listed_in_order(tiny_ctx):
    plan = ppo_plan(tiny_ctx, {"values": OTHER, "ref": OTHER, "reward": OTHER}, stream_inference=True,
                    generation=GenerationPolicy(migration=MigrationPolicy(0.1, 1)),
                    training=[stage(("update_actor", "update_critic"))], offloaded=("ref",))
    assert plan.features() == [Feature.STREAMING, Feature.MIGRATION, Feature.FUSED_TRAINING, Feature.OFFLOAD,
                               Feature.PER_REPLICA_MOVEMENT]


@pytest.mark.parametrize("kw,feature", [
    ({"stream_inference": True}, Feature.STREAMING),
    ({"generation": GenerationPolicy(migration=MigrationPolicy(0.2, 2, "tokens"))}, Feature.MIGRATION),
    ({"offloaded": ("reward",)}, Feature.OFFLOAD),
])
def test_each_feature_alone(tiny_ctx, kw, feature):
    assert ppo_plan(tiny_ctx, **kw).features() == [feature]


def test_fused_training_from_several_tasks_or_several_pipes(tiny_ctx):
    two_tasks = ppo_plan(tiny_ctx, training=[stage(("update_actor", "update_critic"))])
    assert two_tasks.features() == [Feature.FUSED_TRAINING]
    # one task whose stage runs several pipes (e.g. several pipes of one model) is fused too
    two_pipes = ppo_plan(tiny_ctx, training=[stage(("update_actor",), num_pipes=2), stage(("update_critic",))])
    assert not two_pipes.training[0].fused
    assert two_pipes.features() == [Feature.FUSED_TRAINING]
    assert ppo_plan(tiny_ctx, training=[stage(("update_actor",)), stage(("update_critic",))]).features() == []


def test_per_replica_movement_feature_alone():
    plan = Plan("t", [Task("values", "inference", "critic", ONE)],
                weight_movements=[WeightMovement("values", "critic", ONE, ONE, MovementKind.PER_REPLICA)])
    plan.validate(1)
    assert plan.features() == [Feature.PER_REPLICA_MOVEMENT]


# ---- queries --------------------------------------------------------------------------------------
def test_stream_edges_stage_of_and_movement_of():
    st = stage(("t",))
    plan = Plan("t", [Task("gen", "generate", "actor", ONE, writes=("r",)),
                      Task("a", "inference", "ref", ONE, ("r",), ("x",), "gen"),
                      Task("b", "inference", "reward", ONE, ("r",), ("y",)),
                      Task("m", "weight_movement", "actor", ONE),
                      Task("t", "train", "actor", ONE, ("x", "y"))],
                training=[st], weight_movements=[WeightMovement("m", "actor", ONE, ONE)])
    plan.validate(1)
    assert plan.stream_edges() == [("gen", "a")]
    assert plan.stage_of("t") is st and plan.stage_of("a") is None
    assert plan.movement_of("m").task == "m" and plan.movement_of("t") is None
    assert [t.name for t in plan.tasks_of(TaskKind.INFERENCE)] == ["a", "b"]


# ---- validate -------------------------------------------------------------------------------------
def test_validate_rejects_a_stream_from_a_non_generate_task():
    plan = Plan("t", [Task("gen", "generate", "actor", ONE, writes=("r",)),
                      Task("values", "inference", "critic", ONE, ("r",), ("v",)),
                      Task("ref", "inference", "ref", ONE, ("r",), ("l",), stream_from="values")])
    with pytest.raises(PlanError, match="streams from 'values', which is not a generate task"):
        plan.validate(1)


def test_validate_rejects_a_stream_from_a_missing_task():
    plan = Plan("t", [Task("ref", "inference", "ref", ONE, stream_from="gen")])
    with pytest.raises(PlanError, match="streams from 'gen'"):
        plan.validate(1)


def test_validate_rejects_per_replica_movement_on_a_movement_task():
    plan = Plan("t", [Task("realloc_critic_values", "weight_movement", "critic", ONE)],
                weight_movements=[WeightMovement("realloc_critic_values", "critic", ONE, ONE,
                                                 MovementKind.PER_REPLICA)])
    with pytest.raises(PlanError, match="kind per_replica is attached to a weight_movement task"):
        plan.validate(1)


@pytest.mark.parametrize("kind", [MovementKind.REALLOC, MovementKind.PARAM_SYNC])
def test_validate_rejects_a_task_movement_on_a_non_movement_task(kind):
    plan = Plan("t", [Task("values", "inference", "critic", ONE)],
                weight_movements=[WeightMovement("values", "critic", ONE, ONE, kind)])
    with pytest.raises(PlanError, match=f"kind {kind.value} is attached to a inference task"):
        plan.validate(1)


def test_validate_rejects_movement_of_a_missing_task_and_other_structure():
    with pytest.raises(PlanError, match="names task 'nope'"):
        Plan("t", [Task("a", "inference", "ref", ONE)],
             weight_movements=[WeightMovement("nope", "actor", ONE, ONE)]).validate(1)
    with pytest.raises(PlanError, match="duplicate task names"):
        Plan("t", [Task("a", "inference", "ref", ONE), Task("a", "inference", "ref", ONE)]).validate(1)
    with pytest.raises(PlanError, match="not a train task"):
        Plan("t", [Task("a", "inference", "ref", ONE)], training=[stage(("a",))]).validate(1)
    with pytest.raises(PlanError, match="both as resident and as offloaded"):
        Plan("t", [Task("ref", "inference", "ref", ONE)], resident=[ResidentState("ref", "ref")],
             offloaded=["ref"]).validate(1)
    with pytest.raises(PlanError, match="written by both"):
        Plan("t", [Task("a", "inference", "ref", ONE, writes=("k",)),
                   Task("b", "inference", "reward", ONE, writes=("k",))]).validate(1)


# ---- JSON -----------------------------------------------------------------------------------------
def _rich_plan(tiny_ctx) -> Plan:
    return ppo_plan(tiny_ctx, {"gen": OTHER, "values": OTHER, "ref": OTHER, "reward": OTHER},
                    stream_inference=True, actor_sync=MovementKind.PARAM_SYNC,
                    generation=GenerationPolicy("continuous", 8, MigrationPolicy(0.25, 1, "tokens")),
                    training=[stage(("update_actor", "update_critic"))], offloaded=("reward",),
                    notes={"search/gen": "dp4tp1pp1"})


@pytest.mark.parametrize("rich", [False, True])
def test_json_round_trip(tiny_ctx, rich):
    plan = _rich_plan(tiny_ctx) if rich else ppo_plan(tiny_ctx, {"gen": OTHER})
    again = Plan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()
    assert again.to_json() == plan.to_json()
    assert again.features() == plan.features()
    assert again.stream_edges() == plan.stream_edges()
    assert again.dependencies() == plan.dependencies()
    assert [m.kind for m in again.weight_movements] == [m.kind for m in plan.weight_movements]
    assert all(isinstance(t.kind, TaskKind) and isinstance(t.model, ModelRole) for t in again.tasks)
    again.validate(4)


def test_dispatch_and_memory_frac_round_trip_and_are_written_only_when_set(tiny_ctx):
    policy = GenerationPolicy("continuous", 8, dispatch=LengthDispatch(1, 0.2, 0.87), memory_frac=0.6)
    plan = ppo_plan(tiny_ctx, {"gen": OTHER}, generation=policy)
    again = Plan.from_json(plan.to_json())
    assert again.generation == policy
    assert again.to_json() == plan.to_json()
    plain = ppo_plan(tiny_ctx, {"gen": OTHER}).to_dict()["generation"]
    assert "dispatch" not in plain and "memory_frac" not in plain


@pytest.mark.parametrize("frac", [0.0, -0.1, 1.5])
def test_memory_frac_is_a_share_of_the_device(frac):
    with pytest.raises(PlanError, match="memory_frac"):
        GenerationPolicy("continuous", 8, memory_frac=frac)


def test_to_dict_is_plain_json(tiny_ctx):
    d = _rich_plan(tiny_ctx).to_dict()
    assert json.loads(json.dumps(d)) == json.loads(_rich_plan(tiny_ctx).to_json())
    task = next(t for t in d["tasks"] if t["name"] == "ref")
    assert task["kind"] == "inference" and type(task["kind"]) is str and task["stream_from"] == "gen"
    assert {m["kind"] for m in d["weight_movements"]} == {"param_sync", "per_replica"}


def _legacy(d: dict) -> dict:
    """``d`` as plan.json was written before the explicit IR (see tests/golden)."""
    d = copy.deepcopy(d)
    streaming = any(t.get("stream_from") for t in d["tasks"])
    for t in d["tasks"]:
        del t["stream_from"]
    for w in d["weight_movements"]:
        del w["kind"]
    d["generation"]["stream_to_inference"] = streaming
    d["overlaps"] = [["gen", t["name"]] for t in d["tasks"] if streaming and t["kind"] == "inference"]
    return d


def test_legacy_plan_json_is_read_with_explicit_streams_and_movement_kinds(tiny_ctx):
    plan = ppo_plan(tiny_ctx, {"gen": OTHER, "values": OTHER}, stream_inference=True)
    legacy = _legacy(json.loads(plan.to_json()))
    assert legacy["generation"]["stream_to_inference"] is True and legacy["overlaps"]
    assert [w["task"] for w in legacy["weight_movements"]] == ["realloc_actor_gen", "values"]
    again = Plan.from_dict(legacy)
    assert again.to_dict() == plan.to_dict()
    for name in ("ref", "reward", "values"):
        assert again.task(name).stream_from == "gen"
    assert again.task("gen").stream_from is None
    assert {m.task: m.kind for m in again.weight_movements} == {
        "realloc_actor_gen": MovementKind.REALLOC, "values": MovementKind.PER_REPLICA}
    again.validate(4)


def test_legacy_param_sync_and_no_streaming(tiny_ctx):
    plan = ppo_plan(tiny_ctx, {"values": OTHER}, actor_sync=MovementKind.PARAM_SYNC)
    legacy = _legacy(json.loads(plan.to_json()))
    assert legacy["generation"]["stream_to_inference"] is False and legacy["overlaps"] == []
    again = Plan.from_json(json.dumps(legacy))
    assert again.stream_edges() == []
    assert {m.task: m.kind for m in again.weight_movements} == {
        "param_sync": MovementKind.PARAM_SYNC, "realloc_critic_values": MovementKind.REALLOC}
    assert again.to_dict() == plan.to_dict()


def test_legacy_hand_written_dict():
    mesh = {"mesh": [0, 1], "strategy": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0}}
    other = {"mesh": [0, 1], "strategy": {"dp": 1, "tp": 2, "pp": 1, "zero_stage": 0}}

    def task(name, kind, model, reads, writes, alloc=mesh):
        return {"name": name, "kind": kind, "model": model, "allocation": alloc, "reads": reads, "writes": writes}

    d = {
        "system": "legacy", "global_batch_size": 8, "mini_batch_size": 4, "offloaded": [],
        "generation": {"batching": "static", "max_batch_size": None, "migration": None, "stream_to_inference": True},
        "overlaps": [["gen", "ref"], ["gen", "values"]],
        "tasks": [
            task("param_sync", "weight_movement", "actor", ["actor_weights"], ["actor_weights@gen"], other),
            task("realloc_ref_ref", "weight_movement", "ref", ["ref_weights"], ["ref_weights@ref"]),
            task("gen", "generate", "actor", ["prompts", "actor_weights@gen"], ["responses"], other),
            task("ref", "inference", "ref", ["responses", "ref_weights@ref"], ["ref_logprobs"]),
            task("values", "inference", "critic", ["responses"], ["values"]),
        ],
        "training": [],
        "weight_movements": [
            {"task": "param_sync", "model": "actor", "source": mesh, "target": other},
            {"task": "realloc_ref_ref", "model": "ref", "source": other, "target": mesh},
            {"task": "values", "model": "critic", "source": other, "target": mesh},
        ],
        "resident": [{"model": "actor", "task": "gen", "what": "weights"}],
    }
    plan = Plan.from_dict(d)
    plan.validate(2)
    assert plan.stream_edges() == [("gen", "ref"), ("gen", "values")]
    assert [m.kind for m in plan.weight_movements] == [MovementKind.PARAM_SYNC, MovementKind.REALLOC,
                                                       MovementKind.PER_REPLICA]
    assert plan.generation == GenerationPolicy("static", None, None)
    assert plan.notes == {}
    assert set(plan.features()) == {Feature.STREAMING, Feature.PER_REPLICA_MOVEMENT}
    # written back in the current format and read again: unchanged
    assert Plan.from_json(plan.to_json()).to_dict() == plan.to_dict()
    assert "overlaps" not in plan.to_dict() and "stream_to_inference" not in plan.to_dict()["generation"]


def test_explicit_fields_win_over_legacy_inference():
    """A dict with both the new fields and a legacy flag: the explicit fields are kept as written."""
    alloc = {"mesh": [0], "strategy": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0}}
    d = {"system": "x", "global_batch_size": 1, "mini_batch_size": 1, "training": [], "resident": [],
         "generation": {"batching": "continuous", "max_batch_size": None, "migration": None,
                        "stream_to_inference": True},
         "tasks": [{"name": "gen", "kind": "generate", "model": "actor", "allocation": alloc, "reads": [],
                    "writes": ["r"], "stream_from": None},
                   {"name": "ref", "kind": "inference", "model": "ref", "allocation": alloc, "reads": ["r"],
                    "writes": [], "stream_from": None}],
         "weight_movements": [{"task": "gen", "model": "actor", "source": alloc, "target": alloc,
                               "kind": "per_replica"}]}
    plan = Plan.from_dict(d)
    assert plan.stream_edges() == []
    assert plan.weight_movements[0].kind is MovementKind.PER_REPLICA
