"""Same config and seed => same numbers, by default (budgets in steps, not seconds): two runs of
the searching systems write identical summary metrics and plans (wall-clock planning time aside)."""
import json

import pytest

from harness.run.pipeline import compose
from harness.run.pipeline import execute


def _run(system: str, tmp_path, name: str) -> tuple[dict, dict]:
    outcome = execute(compose([f"+system={system}", "model=13b", "logger=none", "logger.progress_bar=false",
                               "backend.num_iterations=2", f"results_dir={tmp_path / name}"]), [])
    metrics = {k: v for k, v in outcome.summary.items() if k != "timing_s/plan"}
    plan = json.loads((outcome.path / "plan.json").read_text())
    plan["notes"] = {k: v for k, v in plan["notes"].items() if not k.endswith("search_s")}
    return metrics, plan


@pytest.mark.parametrize("system", ["rlhfuse", "realhf"])
def test_two_identical_runs_write_identical_summaries(system, tmp_path):
    first, second = _run(system, tmp_path, "a"), _run(system, tmp_path, "b")
    assert first[0] == second[0]
    assert first[1] == second[1]


@pytest.mark.parametrize("system", ["areal", "partial_rollout", "nemo_rl_async"])
def test_off_policy_systems_repeat_their_numbers(system, tmp_path):
    """Off-policy runs (several iterations on one timeline, the split searched) are as deterministic."""
    def run(name):
        outcome = execute(compose([f"+system={system}", "model=7b", "algo=grpo", "workload=long_reasoning",
                                   "workload.global_batch_size=16", "workload.mini_batch_size=8",
                                   "workload.max_gen_len=512", "cluster=h100_8x", "cluster.num_nodes=2",
                                   "logger=none", "logger.progress_bar=false", "backend.num_iterations=4",
                                   f"results_dir={tmp_path / name}"]), [])
        return {k: v for k, v in outcome.summary.items() if k != "timing_s/plan"}, \
            (outcome.path / "samples.csv").read_text()
    first, second = run("a"), run("b")
    assert first == second
    assert first[0]["staleness/max"] > 0
