"""Programmatic rewards: a learning task whose reward is computed from the response tokens, so
that a run shows whether PPO learns (``backend.options.reward``, docs/LEARNING.md).

With random tiny models and the default ``reward.kind=model`` the reward model's scores are noise
that no policy can improve, so a reward curve cannot tell a working pipeline from a broken one.
``token_range`` is a task with a known optimum and a dense signal: the score of a sample is the
fraction of its response tokens whose id lies in ``[low, high)``. A policy that ignores the task
scores about ``(high - low) / vocab_size`` (1/8 with the defaults and the 256-token tiny models);
one that emits only tokens of the range scores 1. It does not depend on the prompt.

The reward stage still runs the reward model's forward pass (its time is part of the plan's
reward stage); :func:`task_scores` replaces its output on the device that reports it.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor


def task_scores(tokens: Tensor, prompt_lens: Tensor, last_index: Tensor, spec: dict[str, Any]) -> Tensor:
    """Per-sample scores (B,) float32 of the task ``spec`` (a :class:`~.config.RewardOptions` as a
    dict) for rows of ``tokens`` (B, W) whose response occupies positions ``prompt_lens`` ..
    ``last_index`` (inclusive)."""
    if spec["kind"] != "token_range":
        raise ValueError(f"no programmatic reward {spec['kind']!r}")
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    response = (pos[None, :] >= prompt_lens[:, None]) & (pos[None, :] <= last_index[:, None])
    hit = (tokens >= int(spec["low"])) & (tokens < int(spec["high"])) & response
    return hit.sum(-1).float() / response.sum(-1).clamp(min=1).float()


def reward_fields(role: str, prompt_lens: np.ndarray, spec: dict[str, Any]) -> dict[str, Any]:
    """Extra payload of an inference pass: for the reward model under a programmatic reward, the
    task and the prompt lengths (to find each response); nothing otherwise."""
    if role != "reward" or spec["kind"] == "model":
        return {}
    return {"task_reward": dict(spec), "prompt_lens": np.asarray(prompt_lens).tolist()}


def policy_reward(actor_cfg, workload, seed: int, iteration: int, spec: dict[str, Any], *,
                  temperature: float = 1.0, state: dict[str, Tensor] | None = None) -> float:
    """Mean task score of one iteration's batch generated in-process (no Ray) by the actor a run
    with ``seed`` starts from (or by the weights ``state``): the same prompts, target lengths and
    sampling seeds as ``backend=ray``'s iteration ``iteration``, so with the initial weights it
    reproduces that run's first ``rl/reward_mean``. Measured over several seeds and iterations it
    gives the reward of the untrained policy, the bar a learning run has to clear."""
    from harness.backends.ray.experience import prompt_tokens, stable_seed
    from harness.real.engine import GenerationEngine, SamplingParams
    from harness.real.model import LlamaModel, ModelArgs
    from harness.core.workload import make_batch

    args = ModelArgs.from_llama_config(actor_cfg)
    model = LlamaModel(args, seed=stable_seed("init", seed, "actor"))
    if state is not None:
        model.load_state_dict(state)
    model.eval()
    batch = make_batch(workload, seed, iteration)
    prompts = prompt_tokens(seed, iteration, batch, args.vocab_size)
    engine = GenerationEngine(model, max_batch_size=batch.num_samples,
                              sampling=SamplingParams(temperature=temperature,
                                                      seed=stable_seed("sampling", seed, iteration)),
                              kv_capacity=int(batch.prompt_lens.max() + workload.max_gen_len))
    for i, p in enumerate(prompts):
        engine.submit(i, p, target_len=int(batch.output_lens[i]))
    scores = []
    for f in engine.run():
        toks = torch.tensor(f.tokens)
        scores.append(float(task_scores(toks[None], torch.tensor([0]), torch.tensor([len(toks) - 1]), spec)[0]))
    return float(np.mean(scores))
