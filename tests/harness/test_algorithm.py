"""RL algorithms as a config group (harness/core/algorithm.py, conf/algo/): the task graph and the
batch each one gives, every system planning the critic-free ones in the simulator, and what stays
as it was for PPO.

Oracles: the task sets follow from the papers' definitions (critic for GAE only, reference model
for a positive KL weight, reward model unless rule-based); batches of groups share their prompt
length and draw PPO's lengths when the group is one; the rule-based verifier's time is a
multi-server queue's closed form; PPO's plans and metrics are pinned by tests/test_golden.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.core.algorithm import AlgorithmConfig, sample_workload
from harness.core.workload import make_batch, sample_lengths
from harness.errors import ConfigError, HarnessError
from harness.planning.simulate import verified_s
from harness.planning.workflow import workflow_tasks
from harness.testing import context, plan_for, simulate_iterations
from tests.helpers import algo

PPO_TASK_SET = {"gen", "ref", "reward", "values", "update_actor", "update_critic"}
# the tasks each algorithm of conf/algo/ runs, from its definition (module docstring)
EXPECTED_TASKS = {
    "ppo": PPO_TASK_SET,
    "grpo": {"gen", "ref", "update_actor"},  # no critic; KL loss needs ref; rule-based reward
    "dapo": {"gen", "update_actor"},  # no KL term: no ref
    "rloo": {"gen", "ref", "reward", "update_actor"},
    "reinforce_pp": {"gen", "ref", "reward", "update_actor"},
}
SMALL = ["cluster.num_nodes=4", "workload.global_batch_size=64", "workload.mini_batch_size=16"]
FAST = {"realhf": ["system.max_steps=5"], "rlhfuse": ["system.fused_search.max_steps=50"],
        "disaggregated": ["system.gen_nodes=2"]}


BASE = ["+system=rlhfuse_base"]


@pytest.mark.parametrize("name", sorted(EXPECTED_TASKS))
def test_each_algorithm_runs_the_tasks_its_definition_needs(name):
    assert set(workflow_tasks(algo(name))) == EXPECTED_TASKS[name]


def test_a_zero_kl_weight_drops_the_reference_model_and_a_reward_model_adds_its_task():
    assert set(workflow_tasks(algo("ppo", "algo.kl_coef=0"))) == PPO_TASK_SET - {"ref"}
    assert set(workflow_tasks(algo("dapo", "algo.reward=model", "algo.dynamic_sampling=false"))) == {"gen", "reward",
                                                                                                    "update_actor"}


@pytest.mark.parametrize("override, key", [("algo.advantage=vtrace", "algo.advantage"),
                                           ("algo.reward=judge", "algo.reward"),
                                           ("algo.kl_coef=-0.1", "algo.kl_coef"),
                                           ("algo.group_size=0", "algo.group_size")])
def test_bad_algorithm_options_are_refused_naming_the_key(override, key):
    with pytest.raises(HarnessError, match=key.replace(".", r"\.")):
        context([*BASE, "algo=grpo", override])


def test_group_advantages_need_a_group():
    with pytest.raises(HarnessError, match="algo.group_size=1 must be at least 2"):
        context([*BASE, "algo=grpo", "algo.group_size=1"])


def test_the_context_counts_samples_and_groups_share_their_prompt():
    ctx = context([*BASE, "algo=grpo", "algo.group_size=4", *SMALL])
    assert (ctx.workload.global_batch_size, ctx.workload.mini_batch_size) == (256, 64)
    batch = make_batch(ctx.workload, 0, 3, group_size=4)
    assert batch.num_samples == 256
    groups = batch.prompt_lens.reshape(64, 4)
    assert (groups == groups[:, :1]).all()  # one prompt per group
    assert len({tuple(g) for g in batch.output_lens.reshape(64, 4)}) > 1  # responses draw their own lengths


def test_one_response_per_prompt_draws_what_ppo_drew():
    ctx = context([*BASE, *SMALL])
    assert sample_workload(ctx.workload, AlgorithmConfig()) is ctx.workload
    batch = make_batch(ctx.workload, 7, 2)
    rng = np.random.default_rng([7, 2])
    w = ctx.workload
    np.testing.assert_array_equal(batch.prompt_lens, sample_lengths(w.prompt_len, w.global_batch_size, rng))
    np.testing.assert_array_equal(batch.output_lens, sample_lengths(w.output_len, w.global_batch_size, rng,
                                                                    cap=w.max_gen_len))


def test_a_file_workload_with_groups_is_refused():
    with pytest.raises(ConfigError, match="one response length per prompt"):
        context([*BASE, "algo=grpo", "workload=jsonl", "workload.path=data/workloads/sample.jsonl"])


# ---- the rule-based verifier ---------------------------------------------------------------------
def test_the_verifier_is_a_queue_of_workers():
    # all returned at once: ceil(n / workers) rounds of the per-sample cost after the return
    assert verified_s([5.0] * 10, 0.5, 4) == pytest.approx(5.0 + 3 * 0.5)
    # spread out with a free worker each time: the last one's return plus one cost
    assert verified_s([0.0, 1.0, 2.0], 0.5, 1) == pytest.approx(2.5)
    # a queue: one worker, three at once
    assert verified_s([1.0, 1.0, 1.0], 2.0, 1) == pytest.approx(7.0)
    assert verified_s([3.0], 0.0, 8) == 3.0


def test_the_verifiers_time_lengthens_a_sequential_iteration_by_its_closed_form():
    base = ["+system=rlhfuse_base", "model=13b", "algo=grpo", *SMALL]
    (_, [(_, free)]), (_, [(_, costly)]) = (simulate_iterations(base + [f"algo.rule_reward_s_per_sample={c}",
                                                                       "algo.num_reward_workers=8"])
                                           for c in (0.0, 0.25))
    samples = 64 * 8
    assert costly["timing_s/step"] - free["timing_s/step"] == pytest.approx(math.ceil(samples / 8) * 0.25, rel=1e-9)


# ---- systems --------------------------------------------------------------------------------------
SYSTEMS = ["deepspeed_chat", "rlhfuse_base", "rlhfuse", "realhf", "realhf_heuristic", "disaggregated", "colocated"]


@pytest.mark.parametrize("name", ["grpo", "dapo"])
@pytest.mark.parametrize("system", SYSTEMS)
def test_every_system_plans_the_critic_free_algorithms(system, name):
    plan, ctx, _ = plan_for([f"+system={system}", "model=13b", f"algo={name}", *SMALL, *FAST.get(system, [])])
    assert {t.name for t in plan.tasks if t.kind.value != "weight_movement"} == EXPECTED_TASKS[name]
    assert plan.algorithm == name and plan.global_batch_size == 64 * ctx.algorithm.group_size
    assert {r.model.value for r in plan.resident} <= set(ctx.roles)
    assert [stage.tasks for stage in plan.training] == [("update_actor",)]


def test_openrlhf_plans_grpo_on_its_pools_and_names_the_pool_it_does_not_need():
    base = ["+system=openrlhf", "model=7b", "algo=grpo", "cluster.num_nodes=1", "workload.global_batch_size=64",
            "workload.mini_batch_size=16"]
    with pytest.raises(HarnessError, match=r"gives GPUs to the reward, critic model.*"
                                           r"system\.split\.reward=0 system\.split\.critic=0"):
        plan_for(base)
    plan, _, _ = plan_for(base + ["system.split.ref=2", "system.split.reward=0", "system.split.actor=4",
                                  "system.split.critic=0"])  # 2:0:4:0:2, 8 units on the node's 8 GPUs
    assert {t.name for t in plan.tasks if t.kind.value != "weight_movement"} == EXPECTED_TASKS["grpo"]


def test_interleaving_refuses_an_algorithm_without_its_two_models():
    with pytest.raises(HarnessError, match="interleaved splits the cluster between the reference and the reward "
                                           "model; algo=grpo has no reward model"):
        plan_for(["+system=interleaved", "model=13b", "algo=grpo", *SMALL])


def test_rlhfuse_without_a_critic_turns_its_fused_pipeline_off_and_keeps_inter_stage_fusion():
    plan, _, _ = plan_for(["+system=rlhfuse", "model=13b", "algo=rloo", *SMALL, *FAST["rlhfuse"]])
    assert "no critic" in plan.notes["fused/off"]
    assert {t.name for t in plan.tasks if t.stream_from == "gen"} == {"ref", "reward"}  # streamed inference
    dapo, _, _ = plan_for(["+system=rlhfuse", "model=13b", "algo=dapo", *SMALL, *FAST["rlhfuse"]])
    assert "runs no inference task" in dapo.notes["inter/off"]


def test_backend_ray_refuses_a_rule_reward_without_a_task_to_verify_with(refused_in_process):
    """A rule-based verifier on backend=ray scores with backend.options.reward's task; the default
    (kind=model) names a reward model the algorithm does not run."""
    line = refused_in_process("+system=rlhfuse_base", "model=tiny", "workload=tiny", "backend=ray", "algo=grpo",
                              "cluster=h100_8x", "cluster.gpus_per_node=2")
    assert "algo=grpo scores responses with a rule-based verifier" in line
    assert "backend.options.reward.kind=token_range" in line


def test_critic_options_are_refused_under_a_critic_free_algorithm(refused_in_process):
    line = refused_in_process("+system=rlhfuse_base", "model=tiny", "workload=tiny", "backend=ray", "algo=grpo",
                              "backend.options.reward.kind=token_range", "backend.options.critic_lr=0.001",
                              "cluster=h100_8x", "cluster.gpus_per_node=2")
    assert line.startswith("error: backend.options.critic_lr=0.001 has no effect with algo.advantage=group_norm")


def test_loss_options_are_refused_in_the_simulator(refused_in_process):
    line = refused_in_process("+system=rlhfuse_base", "model=13b", "algo=dapo", "algo.clip_eps_high=0.3")
    assert "algo.clip_eps_high=0.3 has no effect with backend=sim" in line


def test_micro_batches_count_samples_and_mini_batches_prompts(refused_in_process):
    """A mini-batch of 1 prompt holds group_size samples: micro-batches of 4 fit in groups of 4 and
    not in groups of 2 (the micro-batch must divide the mini-batch's samples)."""
    ok = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "workload.global_batch_size=2",
          "workload.mini_batch_size=1", "workload.micro_batch_size=4"]
    assert context([*ok, "algo=grpo", "algo.group_size=4"]).workload.mini_batch_size == 4
    line = refused_in_process(*ok, "algo=grpo", "algo.group_size=2")
    assert "workload.micro_batch_size=4 is larger than a mini-batch's 2 samples" in line


def test_rule_options_without_a_rule_reward_are_refused(refused_in_process):
    line = refused_in_process("+system=rlhfuse_base", "model=13b", "algo=ppo", "algo.num_reward_workers=4")
    assert "algo.num_reward_workers" in line and "algo.reward" in line


def test_a_sweep_over_algorithms_runs_each(run_harness, tmp_path):
    proc = run_harness(["-m", "+system=rlhfuse_base", "model=tiny", "workload=tiny", "algo=ppo,grpo",
                        "cluster=h100_8x", "cluster.num_nodes=1", "logger=none", "logger.progress_bar=false",
                        "backend.num_iterations=2", f"results_dir={tmp_path / 'results'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.parent.parent.parent.name for p in (tmp_path / "results").glob("**/summary.json"))
    assert runs == ["rlhfuse_base,algo=grpo,cluster.num_nodes=1,cluster=h100_8x,workload=tiny",
                    "rlhfuse_base,algo=ppo,cluster.num_nodes=1,cluster=h100_8x,workload=tiny"], runs
