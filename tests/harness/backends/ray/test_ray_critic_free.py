"""backend=ray trains critic-free: real GRPO and DAPO iterations on CPU worker processes, through
``python -m harness`` (harness/core/algorithm.py; the math: harness/real/advantages.py).

Two sets of runs:

- **same seed, same weights across systems**: RLHFuse-Base (searched layouts), RLHFuse (streaming
  into the reference model's inference; its fused pipeline off for want of a critic) and verl (FSDP
  training, log-probs recomputed in the training layout, the refit into the generation layout)
  under ``algo=grpo``, and DeepSpeed-Chat (ZeRO-3 and hybrid-engine generation) and NeMo-RL
  (Megatron-style layout, recomputed log-probs, refit) under ``algo=dapo`` with its dynamic
  sampling (rounds of 3x the prompts, a pass/fail verifier, groups all alike dropped), each on 2
  devices, 2 prompts x 4 responses, 2 iterations, end with
  the same actor weights as the others of their algorithm (relative L2 distance below 1e-6 and
  below 1% of the update, the tolerance of test_ray_backend.py's PPO runs), and GRPO's weights are
  not DAPO's (the algorithm changes the math). Only the actor is trained: no critic, and the
  summary's final weights name the actor alone;
- **reward rises**: GRPO (RLHFuse, 4 prompts x 8 responses) and DAPO (RLHFuse-Base, 2 prompts x 16
  responses, without dynamic sampling: the fraction score, which rarely ties) for 20 iterations each on the token-range reward (the fraction of response tokens
  with id in [0, 32) of 256). The bar is the untrained policy's reward measured in-process on the
  same algorithm's batches (4 seeds x 2 iterations, :func:`~harness.backends.ray.driver.experience.policy_reward`:
  about 0.13): the mean over the last 3 iterations must exceed it by 0.3 and exceed the first 3
  iterations' by 0.3. Measured when this test was written: GRPO 0.12-0.16 over the first
  iterations and 0.88-0.90 over the last three, DAPO 0.12-0.14 and 0.57-0.66. The first
  iteration's reward equals the in-process measurement on seed 0's first batch, so the run's group
  prompts and verifier are the ones measured.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import algo, flat_weights, local_ray, run_folder, run_in_process

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.ray

BOOKKEEPING = ["logger=none", "logger.progress_bar=false", "backend.options.dump_weights_dir=w"]
VERIFIER = ["backend.options.reward.kind=token_range", "backend.options.reward.low=0",
            "backend.options.reward.high=32"]
# 2 prompts x 4 responses = 8 samples (the tiny workload's batch), mini-batches of 1 prompt
GROUPS = ["workload.global_batch_size=2", "workload.mini_batch_size=1", "algo.group_size=4",
          "backend.num_iterations=2", *VERIFIER, *BOOKKEEPING]


SAME_WEIGHTS = {"grpo": ("rlhfuse_base", "rlhfuse", "verl"), "dapo": ("deepspeed_chat", "nemo_rl")}
TWO_DEVICES = ["model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=1",
               "cluster.gpus_per_node=2"]
# DAPO's runs keep its dynamic sampling, with a pass/fail verdict (a response passes when a quarter
# of its tokens are in range) so that some groups pass or fail whole and are dropped
DYNAMIC = ["backend.options.reward.pass_at=0.25"]
EXTRA = {"grpo": [], "dapo": DYNAMIC}
RUNS = {f"{name}_{system}": [f"+system={system}", *TWO_DEVICES, f"algo={name}", *EXTRA[name], *GROUPS]
        for name, systems in SAME_WEIGHTS.items() for system in systems}

ITERATIONS = 20
MARGIN = 0.3
LEARN = ["model=tiny", "workload=learn", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=1",
         "cluster.gpus_per_node=2", "backend.options.actor_lr=0.003", f"backend.num_iterations={ITERATIONS}",
         "workload.mini_batch_size=1", *VERIFIER, "logger=none", "logger.progress_bar=false"]
LEARNING = {"grpo": ["+system=rlhfuse", "algo=grpo", "algo.kl_coef=0.01", "workload.global_batch_size=4",
                     "system.fused_search.max_steps=200", *LEARN],
            "dapo": ["+system=rlhfuse_base", "algo=dapo", "algo.dynamic_sampling=false", "workload.global_batch_size=2",
                     *LEARN]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic_free")
    out = {}
    with local_ray():
        for name, args in {**RUNS, **{f"learn_{a}": args for a, args in LEARNING.items()}}.items():
            proc = run_in_process(args, root / name)
            assert proc.returncode == 0, (name, proc.stderr[-3000:])
            out[name] = root / name
    return out


def _metrics(cwd: Path) -> list[dict]:
    return [json.loads(line) for line in (run_folder(cwd) / "metrics.jsonl").read_text().splitlines()]


def _summary(cwd: Path) -> dict:
    return json.loads((run_folder(cwd) / "summary.json").read_text())


def _actor(cwd: Path):
    """The actor's weights after the run's last iteration (``backend.options.dump_weights_dir=w``)."""
    return flat_weights(cwd / "w" / "actor.pt")


@pytest.mark.parametrize("name", list(RUNS))
def test_only_the_actor_trains(runs, name):
    summary = _summary(runs[name])
    assert set(summary["final_weights"]["models"]) == {"actor"}
    assert (runs[name] / "w" / "actor.pt").is_file() and not (runs[name] / "w" / "critic.pt").exists()
    tasks = {t["name"] for t in json.loads((run_folder(runs[name]) / "plan.json").read_text())["tasks"]
             if t["kind"] != "weight_movement"}
    expected = {"gen", "ref", "update_actor"} if name.startswith("grpo") else {"gen", "update_actor"}
    if name.endswith(("verl", "nemo_rl")):
        expected.add("logprobs")
    assert tasks == expected
    m = summary["metrics"]
    assert "rl/value_loss" not in m and "timing_s/update_critic" not in m
    assert m["gen/verify_tail_s"] >= 0 and 0 <= m["rl/reward_mean"] <= 1


@pytest.mark.parametrize("name", list(SAME_WEIGHTS))
def test_same_seed_same_weights_across_systems(runs, name):
    first, *others = SAME_WEIGHTS[name]
    ref = _actor(runs[f"{name}_{first}"])
    update = _summary(runs[f"{name}_{first}"])["final_weights"]["models"]["actor"]["update_l2"]
    assert update > 1e-3  # two iterations did move the weights
    for other in others:
        diff = float((_actor(runs[f"{name}_{other}"]) - ref).norm())
        assert diff < 1e-6 * float(ref.norm()), (name, other, diff)
        assert diff < 1e-2 * update, (name, other, diff, update)


@pytest.mark.parametrize("system", SAME_WEIGHTS["dapo"])
def test_dynamic_sampling_trains_only_groups_the_verifier_told_apart(runs, system):
    """DAPO's dynamic sampling for real: each iteration generated whole rounds of 3 x 2 prompts x 4
    responses, dropped the groups whose verdicts were all alike (some were, at this threshold), and
    trained on 2 prompts whose 4 responses did not all pass or all fail."""
    metrics = _metrics(runs[f"dapo_{system}"])
    for m in metrics:
        assert m["gen/rounds"] >= 1 and m["gen/generated_samples"] == m["gen/rounds"] * 3 * 2 * 4
        assert 0 < m["gen/mixed_group_frac"] <= 1
    assert min(m["gen/mixed_group_frac"] for m in metrics) < 1  # the filter dropped groups
    scores = np.load(runs[f"dapo_{system}"] / "w" / "experience.npz")["scores"].reshape(-1, 4)
    assert scores.shape == (2, 4) and set(np.unique(scores)) <= {0.0, 1.0}  # verdicts
    assert (scores.max(axis=1) > scores.min(axis=1)).all()


def test_the_algorithm_changes_the_math(runs):
    """GRPO and DAPO start from the same weights (DAPO's prompts drawn in its rounds), and end apart."""
    grpo, dapo = _actor(runs["grpo_rlhfuse_base"]), _actor(runs["dapo_deepspeed_chat"])
    update = _summary(runs["grpo_rlhfuse_base"])["final_weights"]["models"]["actor"]["update_l2"]
    assert float((grpo - dapo).norm()) > 0.1 * update


def test_rlhfuse_says_its_fused_pipeline_is_off(runs):
    assert "no critic" in _summary(runs["grpo_rlhfuse"])["info"]["notes/fused/off"]


@pytest.mark.parametrize("name", ["grpo_verl", "dapo_nemo_rl"])
def test_the_refit_systems_recompute_the_log_probs_in_the_training_layout(runs, name):
    """verl and NeMo-RL ran the logprobs task (the actor's forward pass after generation) and the
    refit every iteration; the same weights as the others show that the recomputed log-probs are the
    behaviour policy's. vLLM reloads its weights at each refit (``refit: reload``), so NeMo-RL, whose
    training layout on 2 GPUs is dp=2 as its engines', refits too, a movement of no bytes."""
    plan = json.loads((run_folder(runs[name]) / "plan.json").read_text())
    assert "realloc_actor_gen" in {t["name"] for t in plan["tasks"]}
    assert plan["engines"]["generation"]["refit"] == "reload"
    assert plan["notes"]["refit"].startswith("realloc_actor_gen")
    for m in _metrics(runs[name]):
        assert m["timing_s/logprobs"] > 0 and m["timing_s/realloc"] > 0


@pytest.fixture(scope="module")
def untrained():
    """The untrained policy's reward on each algorithm's batches (4 seeds x 2 iterations), in-process."""
    from harness.backends.ray.driver.experience import policy_reward
    from harness.testing import run_config

    out = {}
    for name, args in LEARNING.items():
        run = run_config(args)
        spec = {"kind": "token_range", "low": 0, "high": 32}
        out[name] = {(seed, it): policy_reward(run.model.actor, run.workload, seed, it, spec, algorithm=run.algo)
                     for seed in range(4) for it in range(2)}
    return out


@pytest.mark.parametrize("name", list(LEARNING))
def test_reward_rises_clearly_above_the_untrained_policy(runs, untrained, name):
    reward = np.array([m["rl/reward_mean"] for m in _metrics(runs[f"learn_{name}"])])
    assert len(reward) == ITERATIONS
    bar = np.array(list(untrained[name].values()))
    assert bar.std() < 0.05 and bar.mean() < 0.2, bar  # the baseline is what the docstring says
    first, last = reward[:3].mean(), reward[-3:].mean()
    assert last > bar.mean() + MARGIN, (name, last, bar.mean(), reward)
    assert last > first + MARGIN, (name, first, last, reward)


@pytest.mark.parametrize("name", list(LEARNING))
def test_first_iteration_is_the_untrained_policy(runs, untrained, name):
    first = _metrics(runs[f"learn_{name}"])[0]["rl/reward_mean"]
    assert math.isclose(first, untrained[name][(0, 0)], abs_tol=1e-6), (first, untrained[name][(0, 0)])


def test_dapo_filters_truncated_responses_and_grpo_does_not(runs):
    dapo = [m["rl/overlong_frac"] for m in _metrics(runs["learn_dapo"])]
    assert max(dapo) > 0  # workload=learn draws lengths up to its max_gen_len
    assert "rl/overlong_frac" not in _metrics(runs["learn_grpo"])[0]


def test_algo_is_the_same_as_the_config_files_say():
    """The learning runs' algorithms are conf/algo/'s, with the overrides named above only."""
    assert algo("dapo").clip_eps_high == 0.28 and algo("dapo").overlong_filter and not algo("dapo").has_reference
    assert algo("grpo").kl_penalty == "loss" and algo("grpo").has_reference
