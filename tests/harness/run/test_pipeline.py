"""The run pipeline (harness.run.pipeline): every tool composes, checks, plans and iterates through it.

Checked: ``prepare`` refuses exactly what a run refuses, with the same error, before anything is
written; ``plan`` applies the plan checks (tensor parallelism, device memory) and so does
``harness.testing.plan_for``, which wraps it; a recorded run's metrics are the pipeline's simulated
iterations, row for row; the experiment tools plan in the context a run would and write where the
figures read.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest
from omegaconf import DictConfig

from harness.core import metrics as mk
from harness.core.workload import make_batch
from harness.errors import ConfigError, HarnessError, OverrideError, PlanError, PlanMemoryError
from harness.planning.estimate import simulate_plan
from harness.run import pipeline, results
from harness.testing import plan_for, simulate_plan_metrics

TINY = ["model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=4",
        "logger=none", "logger.progress_bar=false", "backend.num_iterations=3", "backend.num_warmup_iterations=1"]


def composed(*overrides: str) -> tuple[list[str], DictConfig]:
    """The command line ``overrides`` on the tiny setting, and its config."""
    args = [*overrides, *TINY]
    return args, pipeline.compose(args)


REFUSED = {
    # id: (overrides, error type, message pattern)
    "no_system": ([], ConfigError, r"no system chosen: add \+system=<name>"),
    "batch_size_below_one": (["+system=deepspeed_chat", "system.mini_batch_size=0"], ConfigError,
                             r"system\.mini_batch_size=0 must be a positive number"),
    "option_without_effect": (["+system=rlhfuse", "system.inter_stage=false", "system.migration_frac=0.1"],
                              OverrideError, r"system\.migration_frac.* has no effect with system\.inter_stage=false"),
    "unknown_cost_model": (["+system=rlhfuse_base", "cluster.cost_model=guess"], ConfigError,
                           r"cluster\.cost_model.*'guess'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_prepare_refuses_what_a_run_refuses_before_writing_anything(case, tmp_path):
    overrides, error, pattern = REFUSED[case]
    args, cfg = composed(*overrides, f"results_dir={tmp_path}")
    with pytest.raises(error, match=pattern) as prepared:
        pipeline.prepare(cfg, args)
    with pytest.raises(HarnessError) as executed:
        pipeline.execute(cfg, args)
    assert type(executed.value) is type(prepared.value)
    assert str(executed.value) == str(prepared.value)
    assert list(tmp_path.rglob("*")) == []


def test_prepare_reads_the_option_rule_from_the_command_line_only():
    """The same config is accepted when the option comes from elsewhere than the command line."""
    args, cfg = composed("+system=rlhfuse", "system.inter_stage=false", "system.migration_frac=0.1")
    with pytest.raises(OverrideError):
        pipeline.prepare(cfg, args)
    prepared = pipeline.prepare(cfg)
    assert prepared.system.name == "rlhfuse"
    assert prepared.ctx.num_devices == 4
    assert prepared.new_backend().ctx is prepared.ctx


def test_plan_refuses_a_pinned_layout_that_cannot_shard_the_heads():
    overrides = ["+system=rlhfuse_base", "model=13b_33b", "cluster.num_nodes=2",
                 "system.layouts.update_critic=dp2tp8pp1"]
    prepared = pipeline.prepare(pipeline.compose(overrides), overrides)
    with pytest.raises(PlanError, match=r"33b \(52 heads, 52 KV heads\) at tp=8"):
        pipeline.plan(prepared)
    with pytest.raises(PlanError, match=r"33b \(52 heads, 52 KV heads\) at tp=8"):
        plan_for(overrides)  # the test helper plans through the same checks


def test_plan_refuses_a_plan_that_does_not_fit_in_device_memory():
    overrides = ["+system=deepspeed_chat", "model=65b", "cluster.num_nodes=1"]
    prepared = pipeline.prepare(pipeline.compose(overrides), overrides)
    with pytest.raises(PlanMemoryError, match="does not fit"):
        pipeline.plan(prepared)
    with pytest.raises(PlanMemoryError, match="does not fit"):
        plan_for(overrides)


def test_a_recorded_run_is_the_pipelines_simulated_iterations(tmp_path):
    args, cfg = composed("+system=rlhfuse_base", f"results_dir={tmp_path}")
    outcome = pipeline.execute(cfg, args)
    simulated = pipeline.simulate(pipeline.plan(pipeline.prepare(cfg, args)))
    assert len(simulated) == 3  # backend.num_iterations

    recorded = [json.loads(line) for line in (outcome.path / results.METRICS_FILE).read_text().splitlines()]
    plan_times = {row.pop(mk.PLAN_TIME) for row in recorded}
    assert len(plan_times) == 1  # one plan per run
    assert recorded == [json.loads(json.dumps(row)) for _, row in simulated]

    summary = dict(outcome.summary)
    assert summary.pop(mk.PLAN_TIME) == plan_times.pop()
    assert summary == pipeline.simulate_summary(cfg)
    assert json.loads((outcome.path / results.SUMMARY_FILE).read_text())["metrics"] == outcome.summary
    samples = pd.read_csv(outcome.path / results.SAMPLES_FILE)
    assert samples["response_len"].tolist() == [s.response_len for s in simulated[-1][0].samples]


def test_an_iteration_on_the_simulator_is_the_planners_whole_plan_simulation():
    """``harness.testing.simulate_plan_metrics`` (the pipeline's simulator) and the planning
    library's ``simulate_plan`` are one simulation: the same trace."""
    plan, ctx, _ = plan_for(["+system=rlhfuse_base", *TINY])
    for iteration in (0, 2):
        trace, row = simulate_plan_metrics(plan, ctx, iteration)
        expected = simulate_plan(ctx, plan, make_batch(ctx.workload, ctx.seed, iteration), iteration)
        assert trace.makespan_s == expected.makespan_s
        assert trace.spans == expected.spans
        assert row[mk.STEP_TIME] == trace.makespan_s


def test_experiment_tools_plan_as_a_run_and_write_into_the_experiment_folder(tmp_path):
    tools = pipeline.ExperimentTools(tmp_path / "table3_schedules")
    overrides = ["model=33b_13b", "+system=rlhfuse_base"]
    ctx = tools.context(overrides)
    expected = pipeline.prepare(pipeline.compose(overrides), overrides).ctx
    assert (ctx.models, ctx.cluster, ctx.workload, ctx.seed) == \
        (expected.models, expected.cluster, expected.workload, expected.seed)
    assert ctx.model("actor").name == "33b" and ctx.model("critic").name == "13b"
    with pytest.raises(OverrideError):
        tools.context(["+system=rlhfuse", "system.inter_stage=false", "system.migration_frac=0.1"])

    path = tools.write_table("table.csv", [{"a": 1, "b": 0.5}, {"a": 2, "b": 1.5}])
    assert path == tmp_path / "table3_schedules" / "table.csv"
    assert path.read_text() == "a,b\n1,0.5\n2,1.5\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["table.csv"]  # no temporary file left
