"""The scheduler on hand-built tiny plans, against hand-computed start and end times, and driven
by predicted times against the closed form of its rule on every system's plan."""
import pytest

from harness.core.units import execution_units
from harness.core.plan import Allocation, ParallelStrategy, Plan, Task, TrainingStage
from harness.planning.scheduler import StreamFeed, Timeline, Timing, run_timed, schedule_durations
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


def starts(sched: Timeline, durations: dict[str, float], names: dict[str, str]) -> dict[str, float]:
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


def _timed(plan: Plan, num_devices: int, timings: dict[str, Timing]) -> Timeline:
    """Run the plan with each unit's Timing given relative to its start."""
    def start(unit, now, queue):
        t = timings[unit.label]
        return Timing({n: now + e for n, e in t.end_s.items()}, {d: now + r for d, r in t.release_s.items()})
    return run_timed(plan, num_devices, start)


def test_early_release_frees_devices_before_the_unit_ends():
    plan = Plan("t", [
        Task("gen", "generate", "actor", alloc(0, 1, 2, 3), writes=("responses",)),
        infer("tail_free", (2, 3)),  # no data dependency: waits for devices only
        infer("needs_dev1", (1, 2)),
    ])
    # generation ends at 10, but its instances on devices 2 and 3 finished (were migrated away) at 4
    timeline = _timed(plan, 4, {"gen": Timing({"gen": 10.0}, {0: 10.0, 1: 10.0, 2: 4.0, 3: 4.0}),
                                "tail_free": Timing({"tail_free": 1.0}, {2: 1.0, 3: 1.0}),
                                "needs_dev1": Timing({"needs_dev1": 1.0}, {1: 1.0, 2: 1.0})})
    assert timeline.start_s == {"gen": 0.0, "tail_free": 4.0, "needs_dev1": 10.0}
    # device 1 is held until generation's end, so needs_dev1 waits for it
    assert list(timeline.device_free_s) == [10.0, 11.0, 11.0, 5.0]
    assert timeline.makespan_s == 11.0


def test_without_early_release_every_device_is_held_to_the_end():
    plan = Plan("t", [Task("gen", "generate", "actor", alloc(0, 1, 2, 3)), infer("x", (2, 3))])
    timeline = _timed(plan, 4, {"gen": Timing({"gen": 10.0}, {d: 10.0 for d in range(4)}),
                                "x": Timing({"x": 1.0}, {2: 1.0, 3: 1.0})})
    assert timeline.start_s["x"] == 10.0


def test_a_unit_must_release_exactly_the_devices_it_holds():
    from harness.errors import PlanError
    plan = Plan("t", [infer("a", (0, 1))])
    with pytest.raises(PlanError, match="holds devices"):
        _timed(plan, 2, {"a": Timing({"a": 1.0}, {0: 1.0})})


def test_empty_plan_section_and_no_devices():
    plan = Plan("t", [infer("a", (0,))])
    assert Timeline(2).makespan_s == 0.0
    assert schedule_durations(plan, 2, lambda unit: 0.0).makespan_s == 0.0


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


def test_a_stream_starts_with_its_generator_once_every_member_can():
    plan = _stream_member_depends_on_a_later_task()
    plan.validate(4)
    calls = []
    sched = schedule_durations(plan, 4, lambda unit: calls.append(unit.label) or 1.0)
    # the consumers ride with gen (one duration asked, for gen) in their place in the order: after the
    # critic realloc that values reads, so gen waits for it though it runs on other devices
    assert calls == ["realloc_critic_values", "gen"]
    assert sched.start_s == {"realloc_critic_values": 0.0, "gen": 1.0}
    assert sched.end_s == {"realloc_critic_values": 1.0, "gen": 2.0, "ref": 2.0, "values": 2.0}


# ---- the event-driven scheduler driven by predicted times, against the closed form of its rule --
def _closed_form_starts(plan: Plan, num_devices: int, duration) -> dict[str, float]:
    """The rule in closed form: entries in unit order (a stream's generator in its consumer's place,
    with the consumer's inputs and devices; a weight movement on its target and source devices),
    each starting at max(inputs ended, devices free)."""
    units = execution_units(plan)
    gens = {u.names[0]: u for u in units if len(u.names) == 1}
    deps, end, free, out = plan.dependencies(), {}, [0.0] * num_devices, {}
    for unit in units:
        if unit.stream_from is None and any(c.stream_from == unit.names[0] for c in units):
            continue  # a generator waits in its consumer's place
        head = gens[unit.stream_from] if unit.stream_from is not None else unit
        names = head.names + (unit.names if head is not unit else ())
        devices = set(head.devices) | set(unit.devices)
        devices |= {d for n in names if plan.movement_of(n) for d in plan.movement_of(n).source.mesh}  # senders
        ready = max((end[d] for n in names for d in deps[n] if d not in names), default=0.0)
        start = out[head.label] = max([ready] + [free[d] for d in devices])
        for n in names:
            end[n] = start + duration(head)
        for d in devices:
            free[d] = start + duration(head)
    return out


@pytest.mark.parametrize("system", ["deepspeed_chat", "realhf", "rlhfuse_base", "rlhfuse", "interleaved",
                                    "disaggregated", "colocated"])
def test_the_scheduler_driven_by_predicted_times_follows_its_rule(system):
    """The event-driven scheduler (UnitQueue, as backend=ray drives it with completions), driven by
    predicted durations (as the simulator and the planners drive it), starts every unit when the
    closed form of the rule says, on every system's plan, for many random duration sets (ties and
    zeros included)."""
    import random

    from harness.testing import plan_for
    plan, ctx, _ = plan_for([f"+system={system}", "model=tiny", "workload=tiny", "cluster=h100_8x", "logger=none",
                             "system.fused_search.max_steps=50" if system == "rlhfuse" else "seed=0"])
    labels = [u.label for u in execution_units(plan)]
    rng = random.Random(system)
    for trial in range(30):
        table = {label: rng.choice([0.0, 1.0, 2.0, rng.random() * 3]) for label in labels}
        duration = lambda unit: table[unit.label]  # noqa: E731
        timeline = schedule_durations(plan, ctx.num_devices, duration)
        assert timeline.start_s == _closed_form_starts(plan, ctx.num_devices, duration), (system, trial)


def test_a_waiting_unit_keeps_its_devices_from_later_units():
    """b waits for a's data; c, later in plan order and free to run, may not take b's device
    before b has run (no jumping): c starts when b ends, not at 0. Without the claim rule c would
    start at 0 (the closed form below shows the rule, the queue must follow it)."""
    plan = Plan("t", [infer("a", (0,), writes=("x",)), infer("b", (1,), reads=("x",)), infer("c", (1,))])
    table = {"a": 10.0, "b": 1.0, "c": 1.0}
    duration = lambda unit: table[unit.label]  # noqa: E731
    expected = {"a": 0.0, "b": 10.0, "c": 11.0}
    assert _closed_form_starts(plan, 2, duration) == expected
    assert schedule_durations(plan, 2, duration).start_s == expected


def test_a_weight_movement_occupies_the_devices_it_sends_from():
    """A movement's source devices send the weights: it waits for them, and later units on them
    wait for it, as on backend=ray (one device set for both drivers)."""
    from harness.core.plan import WeightMovement
    plan = Plan("t", [infer("busy", (0,)),
                      Task("move", "weight_movement", "actor", alloc(1), writes=("actor_weights@gen",)),
                      infer("after", (0,))],
                weight_movements=[WeightMovement("move", "actor", alloc(0), alloc(1))])
    table = {"busy": 5.0, "move": 1.0, "after": 1.0}
    timeline = schedule_durations(plan, 2, lambda unit: table[unit.label])
    assert timeline.start_s == {"busy": 0.0, "move": 5.0, "after": 6.0}


# ---- StreamFeed: which inference replica takes which finished samples ---------------------------
def test_stream_feed_gives_the_longest_idle_replica_the_next_samples_in_finish_order():
    feed = StreamFeed(num_replicas=3, micro_batch_size=2)
    assert feed.take() == [] and feed.drained
    feed.finished([7, 3, 5])
    assert feed.take() == [] and not feed.drained  # no replica available yet
    feed.available(2)
    feed.available(0)
    feed.available(2)  # idempotent: devices released twice
    assert feed.take() == [(2, [7, 3]), (0, [5])]  # the replica available first goes first
    assert feed.take() == [] and not feed.drained  # both compute
    feed.finished([1])
    feed.available(1)
    assert feed.take() == [(1, [1])]
    feed.done(0)
    feed.done(2)
    feed.finished([4, 6, 8])
    assert feed.take() == [(0, [4, 6]), (2, [8])]  # idle longest: 0 finished before 2
    for replica in (1, 0, 2):
        feed.done(replica)
    assert feed.drained and list(feed.idle) == [1, 0, 2]


def test_stream_feed_needs_a_positive_micro_batch():
    with pytest.raises(ValueError, match="micro_batch_size"):
        StreamFeed(2, 0)
