"""The schedule experiments (Table 3, Figure 10) search with a step budget by default, so the same
config and seed give the same schedule; a wall-clock budget only when asked."""
from pathlib import Path

from omegaconf import OmegaConf

from harness.schedule import PipeSpec
from systems.rlhfuse.experiments import DEFAULT_SEARCH_ACTION_STEPS, search_budget

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
