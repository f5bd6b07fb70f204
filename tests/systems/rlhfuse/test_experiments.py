"""The schedule experiments (Table 3, Figure 10) search with a step budget by default, so the same
config and seed give the same schedule; a wall-clock budget only when asked. They plan in the
context the harness hands them and write where it says. FlexFusion's integer instances of the same
shapes are its own problems, and its published schedules check our bound."""
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from harness.run.pipeline import ExperimentTools
from harness.schedule import PipeSpec
from systems.rlhfuse.experiments import (DEFAULT_SEARCH_ACTION_STEPS, flexfusion_layout_costs, fused_layout_costs,
                                         search_budget, table3_schedules)
from systems.rlhfuse.intra.bounds import lower_bound_terms
from systems.rlhfuse.intra.search import paper_serial

PIPES = {"A0": PipeSpec("A0", num_stages=4, num_mbs=8, stage_to_rank=(0, 1, 2, 3), model="actor"),
         "C0": PipeSpec("C0", num_stages=2, num_mbs=8, stage_to_rank=(3, 2), model="critic")}
CONF = Path(__file__).resolve().parents[3] / "conf" / "experiment"
ACTIONS = 2 * (4 * 8 + 2 * 8)  # a forward and a backward per stage and micro-batch


def test_steps_by_default_scaled_by_the_schedule_size():
    assert search_budget(OmegaConf.create({}), PIPES) == {"max_steps": round(DEFAULT_SEARCH_ACTION_STEPS / ACTIONS)}
    params = OmegaConf.create({"search_action_steps": 9600, "search_time_s": None})
    assert search_budget(params, PIPES) == {"max_steps": 100}


def test_wall_clock_only_when_set():
    assert search_budget(OmegaConf.create({"search_time_s": 2}), PIPES) == {"time_limit_s": 2.0}


def test_shipped_experiment_configs_are_step_budgeted():
    for name in ("table3_schedules", "fig10_schedule"):
        params = OmegaConf.load(CONF / f"{name}.yaml").experiment_params
        assert "max_steps" in search_budget(params, PIPES), name


def test_table3_plans_in_the_harness_context_and_writes_its_table_there(tmp_path):
    cfg = OmegaConf.create({"experiment_params": {
        "tp": 8, "seed": 0, "memory_cap_vs_serial": 1.0, "search_action_steps": 1e4, "search_time_s": None,
        "microbatches": [4, 8], "cases": [{"actor": "33b", "critic": "13b", "pp_actor": 4, "pp_critic": 2}]}})
    tools = ExperimentTools(tmp_path / "table3_schedules")
    path = table3_schedules(cfg, tools)
    assert path == tools.folder / "table3.csv"
    table = pd.read_csv(path)
    assert table["microbatches_actor"].tolist() == [4, 8]
    ctx = tools.context(["model=33b_13b", "+system=rlhfuse_base"])
    for row in table.itertuples():
        pipes, costs, m_c = fused_layout_costs(ctx, "33b", "13b", 4, 2, row.microbatches_actor, 8)
        serial_s, _ = paper_serial(pipes, costs)
        assert row.microbatches_critic == m_c
        assert row.serial_s == pytest.approx(serial_s, rel=1e-12)
        assert row.lower_bound_s <= row.fused_s * (1 + 1e-12)
        assert row.fused_speedup == pytest.approx(row.serial_s / row.fused_s, rel=1e-12)


# Makespans of the schedules FlexFusion (the paper authors' solver) published for its own instances
# of the Table 3 shapes (github.com/FlexFusion/FlexFusion, results/trace_exp*.txt at commit 212c257,
# the largest end time in each trace), per (actor pp, critic pp, actor micro-batches).
FLEXFUSION_PUBLISHED_MAKESPAN = {
    (8, 4, 8): 225, (8, 4, 16): 372, (8, 4, 32): 708,
    (8, 8, 8): 225, (8, 8, 16): 366, (8, 8, 32): 702,
    (16, 8, 16): 186, (16, 8, 32): 330, (16, 8, 64): 618,
    (16, 16, 16): 186, (16, 16, 32): 318, (16, 16, 64): 613,
}


def test_flexfusion_instances_are_its_problems():
    pipes, costs, m_c = flexfusion_layout_costs(8, 4, 16)
    assert m_c == 8  # two critic pipes share the global batch
    actor = [n for n, p in pipes.items() if p.model == "actor"]
    critic = [n for n, p in pipes.items() if p.model == "critic"]
    assert len(actor) == 1 and len(critic) == 2
    assert costs[actor[0]].fwd == (5,) * 8 and costs[actor[0]].bwd == (10,) * 8
    assert costs[actor[0]].activation == (1.95,) * 8
    assert all(costs[n].fwd == (4,) * 4 and costs[n].bwd == (8,) * 4 for n in critic)
    assert sorted(r for n in critic for r in pipes[n].stage_to_rank) == list(range(8))


def test_lower_bound_holds_and_is_tight_on_flexfusion_published_schedules():
    """A lower bound above a schedule someone ran would be wrong; FlexFusion reached it on every
    instance but 16/16 with 64 micro-batches, so there it is also tight."""
    for (pp_a, pp_c, m), published in FLEXFUSION_PUBLISHED_MAKESPAN.items():
        bound = lower_bound_terms(*flexfusion_layout_costs(pp_a, pp_c, m)[:2]).value
        assert bound <= published + 1e-9, (pp_a, pp_c, m)
        if (pp_a, pp_c, m) != (16, 16, 64):
            assert bound == pytest.approx(published), (pp_a, pp_c, m)
        else:
            assert bound == pytest.approx(606)


def test_flexfusion_has_no_other_shapes():
    with pytest.raises(ValueError, match="no instance for pp 4/2"):
        flexfusion_layout_costs(4, 2, 8)
