"""RLHFuse system: ablations, fused stage placement, streaming and migration in the simulator."""
import math

import pytest

from harness.core import metrics as mk
from harness.planning.taskmodels.passes import pipe_stage_devices
from harness.testing import simulate_iterations

SMALL = ["model=7b", "cluster.num_nodes=2"]
SHORT = [*SMALL, "system.fused_search.max_steps=300"]  # with the fused search: a short one (refused without it)


def _simulate(overrides, iterations=1):
    return simulate_iterations(overrides, iterations)


def test_both_fusions_off_is_rlhfuse_base():
    """With both switches off RLHFuse must plan and run exactly like RLHFuse-Base."""
    base_plan, base = _simulate(["+system=rlhfuse_base", *SMALL])
    plan, ours = _simulate(["+system=rlhfuse", *SMALL, "system.inter_stage=false", "system.intra_stage=false"])
    assert {t.name: str(t.allocation.strategy) for t in plan.tasks} == \
        {t.name: str(t.allocation.strategy) for t in base_plan.tasks}
    assert ours[0][1][mk.STEP_TIME] == pytest.approx(base[0][1][mk.STEP_TIME], rel=1e-12)


def test_fused_stage_puts_both_models_on_the_same_ranks():
    plan, _ = _simulate(["+system=rlhfuse", *SHORT, "system.inter_stage=false"])
    (stage,) = plan.training
    assert stage.tasks == ("update_actor", "update_critic")
    devices = pipe_stage_devices(plan, stage)
    by_rank: dict[int, list[tuple[int, ...]]] = {}
    for (pipe, st), devs in devices.items():
        by_rank.setdefault(stage.schedule.pipes[pipe].stage_to_rank[st], []).append(tuple(sorted(devs)))
    for rank, sets in by_rank.items():
        assert len(set(sets)) == 1, f"logical rank {rank} maps to different devices per model: {sets}"
    actor, critic = plan.task("update_actor").allocation, plan.task("update_critic").allocation
    assert sorted(actor.mesh) == sorted(critic.mesh)
    num_ranks = math.lcm(actor.strategy.pp, critic.strategy.pp)
    assert len(by_rank) == num_ranks


def test_fused_training_is_not_slower_than_serial_stages():
    _, serial = _simulate(["+system=rlhfuse", *SMALL, "system.inter_stage=false", "system.intra_stage=false"])
    plan, fused = _simulate(["+system=rlhfuse", *SHORT, "system.inter_stage=false"])
    assert plan.notes["fused/makespan_s"] <= plan.notes["fused/serial_makespan_s"] + 1e-12
    assert plan.notes["fused/lower_bound_s"] <= plan.notes["fused/makespan_s"] + 1e-12
    label = "update_actor+update_critic"
    assert mk.bubble_key(label) in fused[0][1]


@pytest.mark.parametrize("frac", [0.1, 0.3])
def test_streaming_inference_only_runs_on_released_devices(frac):
    plan, runs = _simulate(["+system=rlhfuse", *SMALL, "system.intra_stage=false", f"system.migration_frac={frac}"])
    trace, metrics = runs[0]
    assert plan.stream_edges() == [("gen", "ref"), ("gen", "reward"), ("gen", "values")]
    assert plan.generation.migration.threshold_frac == frac
    released = {}
    for span in trace.spans:
        if span.task == "gen":
            for d in span.devices:
                released[d] = max(released.get(d, 0.0), span.end_s)
    inference = [s for s in trace.spans if s.task in ("ref", "reward", "values")]
    assert inference
    for span in inference:
        assert span.start_s >= max(released.get(d, 0.0) for d in span.devices) - 1e-12
    assert metrics[mk.MIGRATION_THRESHOLD_FRAC] == frac
    assert 0 < metrics[mk.TAIL_INSTANCES] <= plan.task("gen").allocation.strategy.dp
    # only samples still unfinished when fewer than R_t remained can move
    assert metrics[mk.MIGRATED_SAMPLES] < math.ceil(frac * len(trace.samples))


def test_inference_needs_each_sample_finished():
    """Every sample's inference ends after the sample was generated (streaming respects data)."""
    _, runs = _simulate(["+system=rlhfuse", *SMALL, "system.intra_stage=false", "system.migration_frac=0.2"])
    trace, metrics = runs[0]
    first_finish = min(s.finish_s for s in trace.samples)
    first_inference = min(s.start_s for s in trace.spans if s.task in ("ref", "reward", "values"))
    assert first_inference >= first_finish
    assert metrics[mk.STEP_TIME] > 0


def test_makespan_slack_reaches_the_search_and_is_checked():
    from harness.errors import ConfigError
    from harness.testing import plan_for

    with pytest.raises(ConfigError, match=r"system\.fused_search\.makespan_slack_frac=-0\.1: must be a finite number >= 0"):
        plan_for(["+system=rlhfuse", *SHORT, "system.fused_search.makespan_slack_frac=-0.1"])
    plan, _, _ = plan_for(["+system=rlhfuse", *SHORT, "system.inter_stage=false",
                           "system.fused_search.makespan_slack_frac=0.05"])
    notes = plan.notes
    assert notes["fused/makespan_slack_frac"] == 0.05
    assert notes["fused/lower_bound_s"] <= notes["fused/phase1_makespan_s"] + 1e-12
    assert notes["fused/makespan_s"] <= notes["fused/phase1_makespan_s"] * 1.05 + 2e-6  # notes are rounded
    plain, _, _ = plan_for(["+system=rlhfuse", *SHORT, "system.inter_stage=false"])
    assert "fused/makespan_slack_frac" not in plain.notes  # the default plan's notes are unchanged


@pytest.mark.parametrize("option,message", [
    ("memory_move_reach=0", r"system\.fused_search\.memory_move_reach must be an integer >= 1, got 0"),
    ("exact_workers=0", r"system\.fused_search\.exact_workers must be an integer >= 1, got 0"),
    ("exact_max_microbatches=-8", r"system\.fused_search\.exact_max_microbatches must be an integer >= 0, got -8"),
    ("memory_cap_steps=[0.1,0]", r"system\.fused_search\.memory_cap_steps must be one or more numbers > 0, "
                                 r"got \[0\.1, 0\.0\]"),
    ("memory_makespan_weights=[]", r"system\.fused_search\.memory_makespan_weights must be one or more numbers > 0, "
                                   r"got \[\]"),
    ("grow_makespan_weights=[0]", r"system\.fused_search\.grow_makespan_weights must be one or more numbers > 0, "
                                  r"got \[0\.0\]"),
])
def test_fused_search_options_out_of_range_are_refused_before_planning(option, message):
    """``system.fused_search`` is one typed config (systems/rlhfuse/intra/config.py), checked by the
    system before any planning, each refusal naming its key."""
    from harness.errors import ConfigError
    from harness.testing import plan_for

    with pytest.raises(ConfigError, match=message):
        plan_for(["+system=rlhfuse", *SHORT, f"system.fused_search.{option}"])
