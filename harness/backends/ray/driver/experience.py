"""The driver's side of a PPO iteration's data (single-controller, as in verl / HybridFlow).

Owns what is the same for every system: prompt tokens (the workload file's, or drawn from (seed,
iteration, sample id)); the rollout as right-padded tensors; the KL-penalised rewards, GAE
advantages (the matrix form, RLHFuse section 6) and returns, computed once over the whole batch in
float32 from the data under the workflow's keys (:func:`sample_data`, :func:`training_data`);
whitening over the whole batch; the mini-batch partition, a permutation drawn from (seed,
iteration); and which generation instance generates which samples under a length dispatch
(:func:`instance_assignment`, the simulator's rule). None of it depends on layouts, so every
system trains on identical numbers.
It also measures the reward of the untrained policy on a run's batches in-process
(:func:`policy_reward`), the bar a learning run must clear (docs/LEARNING.md).

Token positions: for a sequence of ``P`` prompt and ``R`` response tokens, the "action" at index
``j`` of a (B, W-1) tensor is the prediction of token ``j + 1``; response actions are indices
``P-1 .. P+R-2``. Values use the critic's output at those indices, the reward model scores the
last token ``P+R-1``.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from harness.backends.ray.protocol import TaskReward
from harness.backends.ray.replies import Inferred
from harness.backends.ray.rewards import task_scores
from harness.core.algorithm import PPO, AlgorithmConfig, sample_workload
from harness.core.plan import GenerationPolicy, Task
from harness.core.workload import Batch, make_batch
from harness.errors import ConfigError
from harness.planning.taskmodels.generation import dispatch_samples
from harness.real.advantages import (batch_norm_advantages, group_norm_advantages, leave_one_out_advantages,
                                     sequence_kl)
from harness.real.engine import SamplingParams, TorchGenerator
from harness.real.model import LlamaModel, ModelArgs
from harness.real.ppo import gae_advantages, kl_penalized_rewards, masked_mean, masked_whiten


# what each inference model's pass produces, and the workflow data key it is written under
# (the actor's: its log-probs recomputed in its training layout, replacing generation's)
INFERENCE_OUTPUT = {"actor": "logprobs", "ref": "logprobs", "reward": "score", "critic": "values"}
OUTPUT_KEY = {"actor": "old_logprobs", "ref": "ref_logprobs", "reward": "rewards", "critic": "values"}


def stable_seed(*parts) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def prompt_tokens(seed: int, iteration: int, batch: Batch, vocab_size: int, group_size: int = 1,
                  round_index: int | None = None) -> list[list[int]]:
    """The prompt of sample ``i`` of iteration ``iteration``: the workload file's token ids when the
    batch carries them (``workload.path``; ``batch.prompt_ids[i]``), else ``prompt_lens[i]`` tokens
    uniform over the vocabulary, drawn from (seed, iteration, i // group_size): the ``group_size``
    consecutive samples of a group answer one prompt (:func:`harness.core.workload.make_batch`).
    ``round_index``: the prompts of that generation round of dynamic sampling
    (:func:`harness.core.workload.draw_round`), drawn from a stream of their own."""
    stream = () if round_index is None else (f"round{round_index}",)
    out = []
    for i, n in enumerate(batch.prompt_lens.tolist()):
        ids = None if batch.prompt_ids is None else batch.prompt_ids[i]
        if ids is not None:
            if int(ids.max()) >= vocab_size:  # resolve_workload checks this at build time too
                line = "" if batch.source_lines is None else f" (workload file line {int(batch.source_lines[i])})"
                raise ConfigError(f"prompt of sample {i}{line} has token id {int(ids.max())}, outside the "
                                  f"actor's vocabulary (vocab_size={vocab_size})")
            out.append(ids.tolist())
            continue
        gen = torch.Generator().manual_seed(stable_seed("prompt", seed, iteration, *stream, i // group_size))
        out.append(torch.randint(0, vocab_size, (int(n),), generator=gen).tolist())
    return out


@dataclass
class Rollout:
    tokens: np.ndarray  # (B, W) int64, right-padded with 0
    attn: np.ndarray  # (B, W) int64
    action_mask: np.ndarray  # (B, W-1) float32
    old_logprobs: np.ndarray  # (B, W-1) float32
    prompt_lens: np.ndarray
    response_lens: np.ndarray

    @property
    def last_index(self) -> np.ndarray:
        return self.prompt_lens + self.response_lens - 1

    def new_rows(self) -> np.ndarray:
        return np.zeros(self.action_mask.shape, dtype=np.float32)


def build_rollout(prompts: list[list[int]], responses: dict[int, tuple[list[int], list[float]]]) -> Rollout:
    b = len(prompts)
    p_len = np.array([len(p) for p in prompts])
    r_len = np.array([len(responses[i][0]) for i in range(b)])
    width = int((p_len + r_len).max())
    tokens = np.zeros((b, width), dtype=np.int64)
    attn = np.zeros((b, width), dtype=np.int64)
    mask = np.zeros((b, width - 1), dtype=np.float32)
    old = np.zeros((b, width - 1), dtype=np.float32)
    for i in range(b):
        toks, lps = responses[i]
        seq = prompts[i] + list(toks)
        tokens[i, :len(seq)] = seq
        attn[i, :len(seq)] = 1
        lo = p_len[i] - 1
        mask[i, lo:lo + len(toks)] = 1.0
        old[i, lo:lo + len(toks)] = lps
    return Rollout(tokens, attn, mask, old, p_len, r_len)


def rule_scores(rollout: Rollout, reward: TaskReward) -> np.ndarray:
    """(B,) float32 scores of a rule-based verifier (``algo.reward=rule``) on every response."""
    return task_scores(torch.as_tensor(rollout.tokens), torch.as_tensor(rollout.prompt_lens),
                       torch.as_tensor(rollout.last_index), reward).numpy()


def scatter_rows(parts: list[Inferred], shape: tuple[int, ...]) -> np.ndarray:
    """Put each replica's outputs back in batch order."""
    full = np.zeros(shape, dtype=np.float32)
    for part in parts:
        if len(part.rows):
            full[part.rows] = part.values
    return full


def sample_data(rollout: Rollout | None, outputs: dict[str, np.ndarray],
                recomputed_logprobs: bool = False) -> dict[str, Any]:
    """What the iteration has produced so far, under the workflow's data keys
    (:data:`harness.planning.dataflow.SAMPLE_DATA`): the rollout once generation has finished (with
    generation's log-probs, unless the plan recomputes them: ``recomputed_logprobs``), each
    inference model's output (keyed by its role in ``outputs``) once its task has."""
    data: dict[str, Any] = {}
    if rollout is not None:
        data["responses"] = {"tokens": rollout.tokens, "attn": rollout.attn, "action_mask": rollout.action_mask}
        if not recomputed_logprobs:
            data["old_logprobs"] = rollout.old_logprobs
    for role, key in OUTPUT_KEY.items():
        if role in outputs:
            data[key] = outputs[role]
    return data


def training_data(inputs: Mapping[str, Any], algorithm: AlgorithmConfig, gamma: float, lam: float,
                  whiten: bool, max_gen_len: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every training loss's inputs (:func:`harness.planning.dataflow.loss_inputs`) and the batch's
    RL statistics, from the workflow data in ``inputs`` (:func:`sample_data`'s keys), read by key
    only: the driver passes a training task's :class:`~harness.planning.dataflow.TaskInputs`, so
    reading data the task does not declare fails.

    The advantages are ``algorithm.advantage``'s: GAE over the critic's values with the KL penalty
    in the token rewards (PPO; whitened over the batch when ``whiten``), or a critic-free estimator
    of :mod:`harness.real.advantages` over the group layout of the batch. The KL term goes into the
    reward (``algo.kl_penalty=reward``) or, as the reference log-probs, into the actor's loss
    (``loss``, GRPO). With ``algo.overlong_filter`` a response that reached ``max_gen_len`` tokens
    leaves the loss (its ``action_mask`` row in the loss inputs is 0; DAPO section 3.4)."""
    responses = inputs["responses"]
    mask = torch.as_tensor(responses["action_mask"])
    logp = torch.as_tensor(inputs["old_logprobs"])
    scores = torch.as_tensor(inputs["rewards"])
    ref = torch.as_tensor(inputs["ref_logprobs"]) if algorithm.has_reference else logp
    penalty = algorithm.kl_coef if algorithm.kl_penalty == "reward" else 0.0
    data = {"tokens": responses["tokens"], "attn": responses["attn"], "action_mask": responses["action_mask"],
            "old_logprobs": inputs["old_logprobs"]}
    stats = {"reward_mean": float(scores.mean())}
    if algorithm.has_reference:
        stats["kl"] = float(masked_mean(logp - ref, mask))
    g, kind = algorithm.group_size, algorithm.advantage
    if kind == "gae":
        vals = torch.as_tensor(inputs["values"]) * mask
        rewards = kl_penalized_rewards(scores, logp, ref, mask, penalty)
        adv, ret = gae_advantages(rewards, vals, mask, gamma, lam)
        stats.update(token_reward_mean=float(masked_mean(rewards, mask)), advantage_mean=float(masked_mean(adv, mask)),
                     return_mean=float(masked_mean(ret, mask)), value_mean=float(masked_mean(vals, mask)))
        if whiten:
            adv = masked_whiten(adv, mask)
        data.update(returns=ret.numpy(), old_values=vals.numpy())
    elif kind == "group_norm":
        adv = group_norm_advantages(scores.float() - penalty * sequence_kl(logp, ref, mask), mask, g)
    elif kind == "leave_one_out":
        adv = leave_one_out_advantages(scores, logp, ref, mask, g, penalty)
    elif kind == "batch_norm":
        adv, ret = batch_norm_advantages(scores, logp, ref, mask, penalty)
        stats["return_mean"] = float(masked_mean(ret, mask))
    else:
        raise ValueError(f"no advantage estimator {kind!r}")
    if kind != "gae":
        stats["advantage_mean"] = float(masked_mean(adv, mask))
    data["advantages"] = adv.numpy().astype(np.float32)
    if algorithm.has_reference and algorithm.kl_penalty == "loss":
        data["ref_logprobs"] = inputs["ref_logprobs"]
    if algorithm.overlong_filter:
        kept = (mask.sum(-1) < max_gen_len).to(mask.dtype)
        data["action_mask"] = (mask * kept[:, None]).numpy()
        stats["overlong_frac"] = float(1.0 - kept.mean())
    return data, stats


def minibatch_indices(num_samples: int, mini_batch_size: int, seed: int, iteration: int) -> list[np.ndarray]:
    """The batch's samples in mini-batches, shuffled by (seed, iteration)."""
    order = np.random.default_rng([seed, iteration, 0x5EED]).permutation(num_samples)
    return [order[i:i + mini_batch_size] for i in range(0, num_samples, mini_batch_size)]


def policy_reward(actor_cfg, workload, seed: int, iteration: int, spec: Mapping[str, Any], *,
                  temperature: float = 1.0, state: dict[str, Tensor] | None = None,
                  algorithm: AlgorithmConfig = PPO) -> float:
    """Mean task score of one iteration's batch generated in-process (no Ray) by the actor a run
    with ``seed`` starts from (or by the weights ``state``): the same prompts, target lengths and
    sampling seeds as ``backend=ray``'s iteration ``iteration``, so with the initial weights it
    reproduces that run's first ``rl/reward_mean``. Measured over several seeds and iterations it
    gives the reward of the untrained policy, the bar a learning run has to clear. ``spec``: a run's
    ``backend.options.reward`` as a mapping (as its saved config holds it); ``workload`` counts
    prompts, each answered ``algorithm.group_size`` times."""
    reward = TaskReward(spec["kind"], int(spec["low"]), int(spec["high"]), spec.get("pass_at"))
    args = ModelArgs.from_llama_config(actor_cfg)
    model = LlamaModel(args, seed=stable_seed("init", seed, "actor"))
    if state is not None:
        model.load_state_dict(state)
    model.eval()
    workload, g = sample_workload(workload, algorithm), algorithm.group_size
    batch = make_batch(workload, seed, iteration, g)
    prompts = prompt_tokens(seed, iteration, batch, args.vocab_size, g)
    engine = TorchGenerator(model, max_batch_size=batch.num_samples,
                            sampling=SamplingParams(temperature=temperature,
                                                    seed=stable_seed("sampling", seed, iteration)),
                            kv_capacity=int(batch.prompt_lens.max() + workload.max_gen_len))
    for i, p in enumerate(prompts):
        engine.submit(i, p, target_len=int(batch.output_lens[i]))
    scores = []
    for f in engine.run():
        toks = torch.tensor(f.tokens)
        scores.append(float(task_scores(toks[None], torch.tensor([0]), torch.tensor([len(toks) - 1]), reward)[0]))
    return float(np.mean(scores))


def instance_assignment(policy: GenerationPolicy, task: Task, output_lens: np.ndarray) -> tuple | None:
    """The sample ids each generation instance of ``task`` generates, in admission order, under the
    plan's length dispatch (the simulator's :func:`dispatch_samples`, the same for any backend); None
    without one (round-robin, which the workers deal themselves)."""
    if policy.dispatch is None:
        return None
    return tuple(tuple(int(i) for i in ids)
                 for ids in dispatch_samples(policy, task.allocation.strategy.dp, np.asarray(output_lens)))
