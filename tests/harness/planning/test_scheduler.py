"""The list scheduler on hand-built tiny plans, against hand-computed start and end times."""
import pytest

from harness.interpreter import execution_units
from harness.plan import Allocation, ParallelStrategy, Plan, Task, TrainingStage
from harness.planning.scheduler import ListScheduler, schedule_durations
from harness.schedule import PipeSpec, build


def alloc(*devices: int) -> Allocation:
    return Allocation(tuple(devices), ParallelStrategy(dp=len(devices)))


def infer(name: str, devices, reads=(), writes=(), model="ref") -> Task:
    return Task(name, "inference", model, alloc(*devices), tuple(reads), tuple(writes))


def by_label(durations: dict[str, float]):
    """A duration callback that looks the unit up by its label and records every call."""
    calls = []

    def duration(unit):
        calls.append(unit.label)
        return durations[unit.label]

    return duration, calls


def starts(sched: ListScheduler, durations: dict[str, float], names: dict[str, str]) -> dict[str, float]:
    """Start of each task = its end minus the duration of the unit it ran in."""
    return {n: sched.end_s[n] - durations[label] for n, label in names.items()}


def test_independent_tasks_on_disjoint_meshes_overlap():
    plan = Plan("t", [infer("a", (0, 1)), infer("b", (2, 3))])
    dur = {"a": 3.0, "b": 5.0}
    fn, calls = by_label(dur)
    sched = schedule_durations(plan, 4, fn)
    assert sorted(calls) == ["a", "b"]
    assert sched.end_s == {"a": 3.0, "b": 5.0}
    assert starts(sched, dur, {"a": "a", "b": "b"}) == {"a": 0.0, "b": 0.0}
    assert sched.makespan_s == pytest.approx(max(dur.values()))
    assert list(sched.device_free_s) == [3.0, 3.0, 5.0, 5.0]


def test_independent_tasks_sharing_a_device_serialise():
    plan = Plan("t", [infer("a", (0, 1)), infer("b", (1, 2))])
    dur = {"a": 3.0, "b": 5.0}
    sched = schedule_durations(plan, 4, by_label(dur)[0])
    # b waits for device 1 although it reads nothing a writes
    assert plan.dependencies() == {"a": [], "b": []}
    assert sched.end_s == {"a": 3.0, "b": 8.0}
    assert sched.makespan_s == pytest.approx(sum(dur.values()))
    # device 3 was never used; device 0 released at a's end
    assert list(sched.device_free_s) == [3.0, 8.0, 8.0, 0.0]


def test_dependency_chain_on_disjoint_meshes_waits_for_data():
    plan = Plan("t", [infer("a", (0, 1), writes=("x",)), infer("b", (2, 3), reads=("x",))])
    dur = {"a": 3.0, "b": 5.0}
    sched = schedule_durations(plan, 4, by_label(dur)[0])
    assert plan.dependencies()["b"] == ["a"]
    assert starts(sched, dur, {"a": "a", "b": "b"}) == {"a": 0.0, "b": 3.0}
    assert sched.end_s["b"] == 8.0 and sched.makespan_s == 8.0
    # devices 2, 3 were idle until b started, busy until its end
    assert list(sched.device_free_s) == [3.0, 3.0, 8.0, 8.0]


def test_start_is_max_of_data_ready_and_devices_free():
    # c reads from a (ends 2) and runs on b's device (free at 6): it starts at 6
    plan = Plan("t", [infer("a", (0,), writes=("x",)), infer("b", (1,)), infer("c", (1,), reads=("x",))])
    dur = {"a": 2.0, "b": 6.0, "c": 1.0}
    sched = schedule_durations(plan, 2, by_label(dur)[0])
    assert sched.end_s == {"a": 2.0, "b": 6.0, "c": 7.0}
    # the other way round: data later than devices
    plan = Plan("t", [infer("a", (0,), writes=("x",)), infer("b", (1,)), infer("c", (1,), reads=("x",))])
    dur = {"a": 6.0, "b": 2.0, "c": 1.0}
    sched = schedule_durations(plan, 2, by_label(dur)[0])
    assert sched.end_s == {"a": 6.0, "b": 2.0, "c": 7.0}


def test_early_release_frees_devices_before_the_unit_ends():
    plan = Plan("t", [
        Task("gen", "generate", "actor", alloc(0, 1, 2, 3), writes=("responses",)),
        infer("tail_free", (2, 3)),  # no data dependency: waits for devices only
        infer("needs_dev1", (1, 2)),
    ])
    units = {u.label: u for u in execution_units(plan)}
    sched = ListScheduler(plan, 4)
    gen = units["gen"]
    assert sched.start_s(gen) == 0.0
    # generation ends at 10, but its instances on devices 2 and 3 finished (were migrated away) at 4
    sched.finish({"gen": 10.0}, gen.devices, 10.0, early_release_s={2: 4.0, 3: 4.0})
    assert list(sched.device_free_s) == [10.0, 10.0, 4.0, 4.0]
    assert sched.start_s(units["tail_free"]) == 4.0
    sched.finish({"tail_free": 5.0}, units["tail_free"].devices, 5.0)
    # device 1 is held until generation's end, so this unit waits for it
    assert sched.start_s(units["needs_dev1"]) == 10.0
    assert sched.makespan_s == 10.0


def test_without_early_release_every_device_is_held_to_the_end():
    plan = Plan("t", [Task("gen", "generate", "actor", alloc(0, 1, 2, 3)), infer("x", (2, 3))])
    units = {u.label: u for u in execution_units(plan)}
    sched = ListScheduler(plan, 4)
    sched.finish({"gen": 10.0}, units["gen"].devices, 10.0)
    assert sched.start_s(units["x"]) == 10.0


def test_empty_scheduler_and_no_devices():
    plan = Plan("t", [infer("a", (0,))])
    sched = ListScheduler(plan, 2)
    assert sched.makespan_s == 0.0
    assert sched.free_s([]) == 0.0


def _fused_stage_plan() -> Plan:
    pipes = [PipeSpec("A", 1, 2, (0,), "actor"), PipeSpec("C", 1, 2, (0,), "critic")]
    stage = TrainingStage(("update_actor", "update_critic"), build("1f1b", pipes), num_minibatches=1,
                          micro_batch_size=1)
    return Plan("t", [
        Task("gen", "generate", "actor", alloc(0, 1, 2, 3), writes=("responses",)),
        infer("ref", (0, 1), reads=("responses",), writes=("ref_logprobs",)),
        infer("values", (2, 3), reads=("responses",), writes=("values",), model="critic"),
        Task("update_actor", "train", "actor", alloc(0, 1), ("responses", "ref_logprobs"), ("w_actor",)),
        Task("update_critic", "train", "critic", alloc(2, 3), ("responses", "values"), ("w_critic",)),
    ], training=[stage])


def test_training_stage_with_two_tasks_is_one_unit():
    plan = _fused_stage_plan()
    dur = {"gen": 4.0, "ref": 1.0, "values": 3.0, "update_actor+update_critic": 2.0}
    fn, calls = by_label(dur)
    sched = schedule_durations(plan, 4, fn)
    # one duration per unit: the stage is asked once, for both tasks
    assert calls == ["gen", "ref", "values", "update_actor+update_critic"]
    # ref and values overlap on disjoint halves after gen; the stage waits for both (values ends 7),
    # although update_actor alone only reads ref's output (ends 5), and starts both tasks together
    assert sched.end_s == {"gen": 4.0, "ref": 5.0, "values": 7.0, "update_actor": 9.0, "update_critic": 9.0}
    assert sched.makespan_s == 9.0
    assert list(sched.device_free_s) == [9.0] * 4


def _stream_member_depends_on_a_later_task() -> Plan:
    """Streaming ``values`` waits for a critic realloc task listed (and so topologically ordered)
    after ``ref``, the first member of the streaming group."""
    return Plan("t", [
        Task("gen", "generate", "actor", alloc(0, 1), ("prompts",), ("responses",)),
        Task("ref", "inference", "ref", alloc(0, 1), ("responses",), ("ref_logprobs",), "gen"),
        Task("realloc_critic_values", "weight_movement", "critic", alloc(2, 3), ("critic_weights",),
             ("critic_weights@values",)),
        Task("values", "inference", "critic", alloc(2, 3), ("responses", "critic_weights@values"), ("values",),
             "gen"),
    ])


def test_grouped_unit_waits_for_a_dependency_of_a_later_member():
    plan = _stream_member_depends_on_a_later_task()
    plan.validate(4)
    sched = schedule_durations(plan, 4, lambda unit: 1.0)
    # gen and the realloc run at once on disjoint meshes; the stream unit (devices 0..3) waits for both
    assert sched.end_s == {"gen": 1.0, "realloc_critic_values": 1.0, "ref": 2.0, "values": 2.0}


# ---- the event-driven queue (backend=ray's driver) against the timed scheduler ------------------
def _list_starts(plan: Plan, num_devices: int, duration) -> dict[str, float]:
    sched, out = ListScheduler(plan, num_devices), {}
    for unit in execution_units(plan):
        start = out[unit.label] = sched.start_s(unit)
        end = start + duration(unit)
        sched.finish({n: end for n in unit.names}, unit.devices, end)
    return out


def _queue_starts(plan: Plan, duration) -> dict[str, float]:
    """Drive the UnitQueue with completion events at start + duration, as a real driver would."""
    import heapq

    from harness.planning.scheduler import UnitQueue
    queue = UnitQueue(plan, execution_units(plan), lambda u: u.devices)
    now, events, out, seq = 0.0, [], {}, 0
    while queue.waiting or events:
        unit = queue.next_startable()
        while unit is not None:
            devices = queue.start(unit)
            out[unit.label] = now
            heapq.heappush(events, (now + duration(unit), seq, unit.names, devices))
            seq += 1
            unit = queue.next_startable()
        assert events, f"units {[u.label for u in queue.waiting]} can never start"
        now, _, names, devices = heapq.heappop(events)
        queue.finish(names, devices)
    return out


@pytest.mark.parametrize("system", ["deepspeed_chat", "realhf", "rlhfuse_base", "rlhfuse", "interleaved",
                                    "disaggregated", "colocated"])
def test_event_driven_queue_starts_units_when_the_timed_scheduler_does(system):
    """The one readiness rule, driven two ways: by events (backend=ray's dispatcher) and by the
    clock (the simulator and the planners). With the same durations every unit starts at the
    same time, on every system's plan, for many random duration sets (ties and zeros included)."""
    import random

    from harness.testing import plan_for
    plan, ctx, _ = plan_for([f"+system={system}", "model=tiny", "workload=tiny", "cluster=h100_8x", "logger=none",
                             "system.fuse_max_steps=50" if system == "rlhfuse" else "seed=0"])
    labels = [u.label for u in execution_units(plan)]
    rng = random.Random(system)
    for trial in range(30):
        table = {label: rng.choice([0.0, 1.0, 2.0, rng.random() * 3]) for label in labels}
        duration = lambda unit: table[unit.label]  # noqa: E731
        assert _queue_starts(plan, duration) == _list_starts(plan, ctx.num_devices, duration), (system, trial)


def test_a_waiting_unit_keeps_its_devices_from_later_units_in_both_drivers():
    """b waits for a's data; c, later in plan order and free to run, may not take b's device
    before b has run (no jumping): c starts when b ends, not at 0, under both drivers."""
    plan = Plan("t", [infer("a", (0,), writes=("x",)), infer("b", (1,), reads=("x",)), infer("c", (1,))])
    table = {"a": 10.0, "b": 1.0, "c": 1.0}
    duration = lambda unit: table[unit.label]  # noqa: E731
    expected = {"a": 0.0, "b": 10.0, "c": 11.0}
    assert _list_starts(plan, 2, duration) == expected
    assert _queue_starts(plan, duration) == expected
