"""The training tasks' declared reads against the math that builds their training data.

The math is the Ray driver's own (``harness.backends.ray.driver.experience``: the data it has under the
workflow's keys, then KL-penalised rewards, GAE and returns from :mod:`harness.real.ppo`, or a
critic-free estimator of :mod:`harness.real.advantages`), run through :class:`TaskInputs`, which
holds only the keys a task declares and raises on any other.
"""
import dataclasses

import numpy as np
import pytest
import torch

from harness.backends.ray.driver import experience as ex
from harness.core.plan import Allocation, ParallelStrategy, Plan
from harness.core.algorithm import AlgorithmConfig
from harness.planning.dataflow import (LOSS_INPUTS, SAMPLE_DATA, TaskInputs, UndeclaredRead, loss_inputs,
                                       sample_data_behind, training_reads)
from harness.planning.scheduler import schedule_durations
from harness.planning.workflow import PPO_TASKS, ppo_tasks, single_pipe_stage
from harness.real.ppo import policy_loss, value_loss
from tests.helpers import algo

TRAINING_TASKS = [name for name, (kind, *_) in PPO_TASKS.items() if kind == "train"]
KL_COEF, GAMMA, LAM, MAX_GEN_LEN = 0.1, 1.0, 0.95, 6
PPO_KL = AlgorithmConfig(kl_coef=KL_COEF)
# every algorithm's config, in groups of 2 responses (the 6 samples below are 3 prompts)
ALGORITHMS = {name: dataclasses.replace(algo(name), group_size=1 if name in ("ppo", "reinforce_pp") else 2)
              for name in ("ppo", "grpo", "dapo", "rloo", "reinforce_pp")}


@pytest.fixture(scope="module")
def produced():
    """Everything the tasks before training write, for 6 samples of uneven lengths, under the
    workflow's keys, as the Ray driver holds it (``experience.sample_data``)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50, int(n)).tolist() for n in rng.integers(2, 6, 6)]
    responses = {i: (rng.integers(0, 50, int(n)).tolist(), (-rng.random(int(n))).tolist())
                 for i, n in enumerate(rng.integers(1, 8, 6))}
    rollout = ex.build_rollout(prompts, responses)
    shape = rollout.action_mask.shape
    outputs = {"ref": (-rng.random(shape)).astype(np.float32), "critic": rng.normal(size=shape).astype(np.float32),
               "reward": rng.normal(size=len(prompts)).astype(np.float32)}
    data = ex.sample_data(rollout, outputs)
    assert set(data) == set(SAMPLE_DATA)
    return data


def declared(task: str) -> tuple[str, ...]:
    return PPO_TASKS[task][2]


def build_training_data(inputs, algorithm: AlgorithmConfig = PPO_KL):
    return ex.training_data(inputs, algorithm, GAMMA, LAM, whiten=True, max_gen_len=MAX_GEN_LEN)


@pytest.mark.parametrize("task", TRAINING_TASKS)
def test_training_data_needs_only_the_declared_reads(task, produced):
    """The real math, given only what the task declares, yields its loss inputs, identical to
    the ones computed with everything available, and its loss runs on them."""
    model = PPO_TASKS[task][1]
    data, stats = build_training_data(TaskInputs(task, declared(task), produced))
    unrestricted, _ = build_training_data(produced)
    assert set(LOSS_INPUTS[model]) <= set(data)
    for key in LOSS_INPUTS[model]:
        np.testing.assert_array_equal(data[key], unrestricted[key])
    batch = {k: torch.as_tensor(data[k]) for k in LOSS_INPUTS[model]}
    if model == "actor":
        loss, _ = policy_loss(batch["old_logprobs"] + 0.01, batch["old_logprobs"], batch["advantages"],
                              batch["action_mask"])
    else:
        loss, _ = value_loss(batch["old_values"] + 0.01, batch["old_values"], batch["returns"], batch["action_mask"])
    assert torch.isfinite(loss)
    assert all(np.isfinite(v) for v in stats.values())


class Recording(dict):
    """The produced data, remembering which keys were read."""

    def __init__(self, data):
        super().__init__(data)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


@pytest.mark.parametrize("task", TRAINING_TASKS)
def test_declared_reads_are_exactly_what_the_math_reads(task, produced):
    """No read missing (the test above) and none extra: an extra one would delay the task for nothing."""
    recording = Recording(produced)
    build_training_data(recording)
    assert recording.read == set(declared(task)) & set(SAMPLE_DATA)


def test_critic_returns_use_the_kl_penalised_rewards():
    """A past bug: update_critic declared (responses, rewards, values) and was started before ref."""
    assert {"old_logprobs", "ref_logprobs"} <= sample_data_behind("returns")
    assert training_reads("critic") == SAMPLE_DATA
    for task in TRAINING_TASKS:
        assert declared(task) == training_reads(PPO_TASKS[task][1])


def test_sample_data_is_what_the_earlier_tasks_write():
    written = {key for kind, _, _, writes in PPO_TASKS.values() if kind != "train" for key in writes}
    assert set(SAMPLE_DATA) == written


def test_an_undeclared_read_fails_whatever_has_finished(produced):
    """The old declaration of update_critic fails with everything available, not only when ref is late."""
    inputs = TaskInputs("update_critic", ("responses", "rewards", "values"), produced)
    with pytest.raises(UndeclaredRead, match="update_critic reads 'old_logprobs' without declaring it"):
        build_training_data(inputs)


def test_a_declared_input_not_written_yet_fails(produced):
    early = {k: v for k, v in produced.items() if k != "ref_logprobs"}
    with pytest.raises(RuntimeError, match=r"update_critic reads \['ref_logprobs'\], which no finished task"):
        TaskInputs("update_critic", declared("update_critic"), early)


def test_weight_reads_are_not_sample_data(produced):
    inputs = TaskInputs("update_critic", declared("update_critic") + ("critic_weights@update_critic",), produced)
    assert set(inputs) == set(SAMPLE_DATA)


def test_update_critic_waits_for_ref_in_the_list_scheduler():
    """The simulator's scheduler: with ref on devices of its own and slow, update_critic (on
    other devices) starts only when ref has ended."""
    def on(*devices):
        return Allocation(devices, ParallelStrategy(dp=len(devices)))
    allocations = {"gen": on(0, 1, 2, 3), "ref": on(0, 1), "reward": on(2, 3), "values": on(2, 3),
                   "update_actor": on(0, 1), "update_critic": on(2, 3)}
    stages = [single_pipe_stage(task, PPO_TASKS[task][1], allocations[task].strategy, 4, 2, 4)
              for task in TRAINING_TASKS]
    plan = Plan("t", ppo_tasks(allocations), training=stages)
    assert plan.dependencies()["update_critic"] == ["gen", "ref", "reward", "values"]
    durations = {"gen": 1.0, "ref": 10.0, "reward": 1.0, "values": 1.0, "update_actor": 1.0, "update_critic": 1.0}
    sched = schedule_durations(plan, 4, lambda unit: durations[unit.label])
    assert sched.end_s["ref"] == 11.0
    assert sched.end_s["update_critic"] - durations["update_critic"] == 11.0


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_reads_exactly_its_declared_reads(name, produced):
    """Each algorithm's actor loss inputs come from exactly the data its training task declares
    (:func:`training_reads` with the algorithm), and its loss runs on them."""
    algorithm = ALGORITHMS[name]
    recording = Recording(produced)
    data, stats = build_training_data(TaskInputs("update_actor", training_reads("actor", algorithm), recording),
                                      algorithm)
    assert recording.read == set(training_reads("actor", algorithm))
    assert set(loss_inputs("actor", algorithm)) <= set(data)
    batch = {k: torch.as_tensor(data[k]) for k in loss_inputs("actor", algorithm)}
    loss, _ = policy_loss(batch["old_logprobs"] + 0.01, batch["old_logprobs"], batch["advantages"],
                          batch["action_mask"], clip_eps_high=algorithm.clip_eps_high)
    assert torch.isfinite(loss) and all(np.isfinite(v) for v in stats.values())
    assert ("ref_logprobs" in loss_inputs("actor", algorithm)) == (name == "grpo")  # GRPO's KL is a loss term
    assert ("values" in training_reads("actor", algorithm)) == (name == "ppo")
    assert ("ref_logprobs" in training_reads("actor", algorithm)) == (name != "dapo")  # DAPO has no KL term


def test_overlong_filtering_leaves_truncated_responses_out_of_the_loss(produced):
    """DAPO: a response of max_gen_len tokens gets an all-zero loss mask; the others keep theirs."""
    data, stats = build_training_data(produced, ALGORITHMS["dapo"])
    lengths = produced["responses"]["action_mask"].sum(-1)
    truncated = lengths >= MAX_GEN_LEN
    assert 0 < truncated.sum() < len(lengths), lengths  # the fixture has both kinds
    np.testing.assert_array_equal(data["action_mask"].sum(-1), np.where(truncated, 0, lengths))
    assert stats["overlong_frac"] == pytest.approx(truncated.mean())
    unfiltered, _ = build_training_data(produced, dataclasses.replace(ALGORITHMS["dapo"], overlong_filter=False))
    np.testing.assert_array_equal(unfiltered["action_mask"], produced["responses"]["action_mask"])
