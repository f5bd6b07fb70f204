"""Every impossible input refused before any work (harness/checks/consistency.py).

Each input the issue lists under "Why" ends ``python -m harness`` with exit code 2, exactly one line
``error: ...`` on stderr naming the cause (the key to change), nothing on stdout and nothing under
results_dir (the ``refused_in_process`` fixture: the command's entry point in this process; the
interpreter's start is tests/harness/test_entrypoint.py's). The rules themselves are checked in-process
around their boundaries, and nodes whose GPU count does not divide a model's heads now plan with a
tensor-parallel degree that does (a legal configuration: planned, not refused).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.checks import consistency as cons
from harness.run.pipeline import compose
from harness.errors import ConfigError
from harness.planning.strategies import check_tensor_parallel
from harness.planning.strategies import largest_tp, tp_splits_heads
from harness.testing import plan_for

FAST = ["logger=none", "logger.progress_bar=false", "backend.num_iterations=1", "backend.num_warmup_iterations=0"]
BASE = ["+system=rlhfuse", "model=13b", "cluster.num_nodes=1"]


def constant_prompt(tokens: int) -> list[str]:
    return ["workload.prompt_len.kind=constant", f"workload.prompt_len.min={tokens}",
            f"workload.prompt_len.median={tokens}", f"workload.prompt_len.max={tokens}"]


def key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def command(extra: list[str]) -> list[str]:
    """BASE + FAST, each key of ``extra`` replacing the same key there (no key given twice)."""
    own = {key(o) for o in extra}
    return [o for o in BASE + FAST if key(o) not in own] + extra


# name -> (overrides, text the one line must contain). The cases in the order the checks run.
REFUSED = {
    "gen_over_context": (["workload.max_gen_len=8192"], "model.actor.max_seq_len=4096"),
    "prompt_over_context": (constant_prompt(6000), "workload.prompt_len.max=6000"),
    "infinite_tflops": (["cluster.gpu.peak_bf16_tflops=inf"], "cluster.gpu.peak_bf16_tflops=inf"),
    "negative_budget": (["planning_budget_s=-1"], "planning_budget_s=-1"),
    "negative_steps": (["system.fused_search.max_steps=-1"], "system.fused_search.max_steps=-1"),
    "option_without_effect": (["system.migration_frac=0.3", "system.inter_stage=false", "system.intra_stage=false"],
                              "system.migration_frac=0.3 has no effect with system.inter_stage=false"),
    "warmup_not_below_iterations": (["backend.num_iterations=2", "backend.num_warmup_iterations=2"],
                                    "backend.num_warmup_iterations=2"),
    "escaping_name": (["experiment_name=../../escaped"], "experiment_name='../../escaped'"),
    "unwritable_results_dir": (["results_dir=/proc/harness-results"], "results_dir='/proc/harness-results'"),
    "zero_bandwidth": (["cluster.inter_node.bandwidth_gbps=0"], "cluster.inter_node.bandwidth_gbps=0"),
    "negative_sigma": (["workload.output_len.sigma=-1"], "workload.output_len.sigma=-1"),
    "negative_seed": (["seed=-1"], "seed=-1"),
    "online_without_credentials": (["logger=wandb", "logger.mode=online"], "logger.mode=online"),
    "huge_batch": (["workload.global_batch_size=10000000"], "allow_large=true"),
    "nan_memory": (["cluster.gpu.hbm_gb=nan"], "cluster.gpu.hbm_gb=nan"),
    "negative_memory": (["cluster.gpu.hbm_gb=-80"], "cluster.gpu.hbm_gb=-80"),
    "zero_layers": (["model.actor.num_layers=0"], "model.actor.num_layers=0"),
    "million_token_prompt": (constant_prompt(1_000_000), "exceeds the actor model's context"),
}


def escaped(tmp_path: Path) -> Path:
    """Where ``experiment_name=../../escaped`` would lead from the results_dir the checks use."""
    return (tmp_path / "results" / ".." / ".." / "escaped").resolve()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_impossible_input_is_one_line_and_exit_2(name, refused_in_process, tmp_path):
    overrides, text = REFUSED[name]
    line = refused_in_process(*command(overrides))
    assert text in line, line
    assert not escaped(tmp_path).exists()


def test_a_key_given_twice_is_refused(refused_in_process):
    line = refused_in_process(*BASE, *FAST, "seed=1", "seed=2")
    assert "seed is given twice on the command line (seed=1 and seed=2)" in line


def test_a_file_record_over_the_context_is_refused_naming_its_line(refused_in_process, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt_len": 10, "response_len": 10}) + "\n"
                    + json.dumps({"prompt_len": 4000, "response_len": 1000}) + "\n")
    line = refused_in_process(*command(["workload=jsonl", f"workload.path={path}", "workload.max_gen_len=2048"]))
    assert f"{path}:2: prompt of 4000 + response of 1000 tokens exceeds the models' context of 4096" in line


# ---- the rules, in-process ------------------------------------------------------------------------

def run_config(extra: list[str]):
    return OmegaConf.to_object(compose(command(extra)))


def test_the_defaults_and_the_paper_setting_pass():
    cons.check_run(run_config([]))
    cons.check_run(run_config(["model=65b_33b", "workload.max_gen_len=2048", "cluster.num_nodes=32"]))


def test_context_boundary():
    cons.check_run(run_config(["workload.max_gen_len=3584"]))  # 512 + 3584 = 4096: fits exactly
    with pytest.raises(ConfigError, match="= 4097 tokens exceeds"):
        cons.check_run(run_config(["workload.max_gen_len=3585"]))


@pytest.mark.parametrize("value,ok", [(0, True), (2.5, True), (-0.001, False), (math.inf, False), (math.nan, False)])
def test_amounts_by_name(value, ok):
    run = run_config([])
    run.system.fused_search.makespan_slack_frac = value
    if ok:
        cons.check_option_ranges(run.system, "system")
    else:
        with pytest.raises(ConfigError, match="system.fused_search.makespan_slack_frac"):
            cons.check_option_ranges(run.system, "system")


def test_large_sizes_need_allow_large():
    cons.check_run(run_config([f"workload.global_batch_size={cons.MAX_SAMPLES_PER_ITERATION}"]))
    with pytest.raises(ConfigError, match="allow_large=true"):
        cons.check_run(run_config([f"workload.global_batch_size={2 * cons.MAX_SAMPLES_PER_ITERATION}"]))
    cons.check_run(run_config([f"workload.global_batch_size={2 * cons.MAX_SAMPLES_PER_ITERATION}", "allow_large=true"]))


@pytest.mark.parametrize("name", ["a", "fig7/variant", "./x"])
def test_names_inside_results_dir_pass(name, tmp_path):
    cons.check_experiment_name(name, str(tmp_path))


@pytest.mark.parametrize("name", ["../x", "/abs", "a/../../b", ""])
def test_names_escaping_results_dir_are_refused(name, tmp_path):
    with pytest.raises(ConfigError, match="experiment_name"):
        cons.check_experiment_name(name, str(tmp_path))


def test_results_dir_check_leaves_nothing(tmp_path):
    cons.check_results_dir_writable(str(tmp_path / "new" / "deeper"))
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot be written"):
        cons.check_results_dir_writable(str(blocker / "results"))


# ---- tensor parallelism and heads -----------------------------------------------------------------

class Heads:
    def __init__(self, num_heads: int, num_kv_heads: int):
        self.num_heads, self.num_kv_heads, self.name = num_heads, num_kv_heads, f"{num_heads}/{num_kv_heads}"


@pytest.mark.parametrize("heads,kv,tp,ok", [(40, 40, 8, True), (52, 52, 8, False), (52, 52, 4, True),
                                            (64, 8, 8, True), (64, 8, 16, True), (64, 8, 3, False),
                                            (4, 2, 4, True), (4, 2, 8, False), (40, 40, 3, False)])
def test_tp_splits_heads(heads, kv, tp, ok):
    assert tp_splits_heads(tp, [Heads(heads, kv)]) == ok


def test_largest_tp_in_a_node():
    assert largest_tp(8, [Heads(52, 52)]) == 4 and largest_tp(8, [Heads(40, 40)]) == 8
    assert largest_tp(3, [Heads(40, 40)]) == 1 and largest_tp(8, [Heads(40, 40), Heads(52, 52)]) == 4


@pytest.mark.parametrize("system", ["rlhfuse_base", "realhf_heuristic", "deepspeed_chat"])
def test_three_gpu_nodes_plan_only_tensor_parallelism_that_shards_the_heads(system):
    """The issue's cluster.gpus_per_node=3 ran 13B (40 heads) at tp = 3; it now plans tp = 1."""
    plan, ctx, _ = plan_for([f"+system={system}", "model=13b", "cluster.num_nodes=4", "cluster.gpus_per_node=3",
                             "workload.global_batch_size=96", "workload.mini_batch_size=48",
                             "seed=0"])
    assert {t.allocation.strategy.tp for t in plan.tasks} == {1}
    check_tensor_parallel(plan, ctx.models)


def test_a_pinned_layout_that_cannot_shard_the_heads_is_refused():
    """A layout the user pins is not searched; the runner's plan check (make_plan) refuses it."""
    from hydra.utils import get_class

    from harness.errors import PlanError
    from harness.run.pipeline import build_context, make_plan

    run = run_config(["+system=rlhfuse_base", "model=13b_33b", "cluster.num_nodes=2",
                      "system.layouts.update_critic=dp2tp8pp1"])
    with pytest.raises(PlanError, match=r"33b \(52 heads, 52 KV heads\) at tp=8"):
        make_plan(get_class(run.system.impl)(run.system), build_context(run))
