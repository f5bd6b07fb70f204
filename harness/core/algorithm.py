"""The RL algorithm of a run (``algo=ppo|grpo|dapo|rloo|reinforce_pp``, ``conf/algo/``): which models
an iteration runs and how many samples it draws.

An algorithm decides the iteration's task graph and its batch; the systems decide where and when the
tasks run. What each algorithm needs, from its paper:

- **PPO** (Ouyang et al. 2022, arXiv 2203.02155; the RLHF setup of the RLHFuse paper): a critic
  (value inference and critic training; GAE advantages), a reference model (a KL penalty in the
  reward), a reward model, one response per prompt.
- **GRPO** (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300 section 4.1): no critic; the advantage
  of a response is its reward normalised by the mean and standard deviation of its group of ``G``
  responses to the same prompt; the KL to the reference model is a loss term (beta 0.04 in the
  paper).
- **DAPO** (Yu et al. 2025, arXiv 2503.14476): GRPO's group advantages without the KL term, so no
  reference model (section 2.3: "we exclude the KL term"), rule-based reward, 16 responses per
  prompt (section 4.1).
- **RLOO** (Ahmadian et al. 2024, arXiv 2402.14740): no critic; the baseline of a response is the mean
  reward of the other ``k - 1`` responses to its prompt; KL penalty in the reward.
- **REINFORCE++** (Hu 2025, arXiv 2501.03262): no critic; advantages normalised over the whole batch;
  KL penalty in the reward, against a reference model.

The counts are **prompts**: ``workload.global_batch_size`` prompts per iteration and
``workload.mini_batch_size`` prompts per gradient step, as verl's ``data.train_batch_size`` and
``ppo_mini_batch_size`` count them; each prompt gets ``group_size`` responses, so an iteration trains
on ``global_batch_size x group_size`` samples (:func:`sample_workload`: what systems plan and
backends run). ``micro_batch_size`` counts samples. With one response per prompt (PPO) the two
counts agree and nothing changes.

The reward is a reward model (an inference task on GPUs) or a **rule-based verifier** (``reward:
rule``: a program that checks each response, e.g. a math answer against the reference), which runs
on the driver's CPUs after generation, ``rule_reward_s_per_sample`` seconds per sample over
``num_reward_workers`` processes, as verl's trainer calls its reward function on the generated
batch. No model, no GPU.

Three fields act on the loss only, so they apply on ``backend=ray`` (the simulator computes no
loss): where the KL term goes (``kl_penalty``: the reward, or GRPO's loss term), DAPO's
clip-higher (``clip_eps_high``) and its overlong filtering (``overlong_filter``); the advantage
estimators and the KL loss are :mod:`harness.real.advantages`.

**Dynamic sampling** (DAPO section 3.2; ``dynamic_sampling: true``): a group whose responses all
score alike (accuracy 0 or 1) has zero advantage and no gradient, so the iteration over-samples
and drops such groups until the batch is full of groups that teach. As verl's DAPO recipe runs it
(``gen_prompt_bsz = 3 x train_prompt_bsz``, ``max_num_gen_batches``): generation runs in rounds
of ``oversample_factor x global_batch_size`` prompts, each round's rewards are verified, the groups
with mixed outcomes are kept, and rounds continue until ``global_batch_size`` prompts are kept (at
most ``max_gen_rounds``); the first ``global_batch_size`` kept groups train, the rest of the last
round is dropped. What decides how many groups are kept is each prompt's pass rate under the
current policy, which a synthetic workload draws (:func:`harness.core.workload.draw_batch`,
``workload.pass_rate``). The
rounds' generation is what the iteration pays for (the simulator's generate task runs them one
after the other); inference and training see the kept samples only. It needs a rule-based reward
(the filter reads the verifier's verdicts). ``backend=ray`` runs the same rounds for real, its
verifier deciding which groups are kept (a group is kept when its responses' scores are not all
equal), without a stream into inference.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from harness.core.option_effects import ON_REAL_BACKEND, effective_when
from harness.errors import ConfigError

# advantage estimator -> the algorithm it comes from (a critic is needed for GAE only)
ADVANTAGE_ESTIMATORS = ("gae", "group_norm", "leave_one_out", "batch_norm")
REWARD_KINDS = ("model", "rule")
KL_PENALTIES = ("reward", "loss")
LOSS_ONLY = effective_when(ON_REAL_BACKEND, why="the simulator computes no loss")
RULE_ONLY = effective_when(("algo.reward", "==", "rule"), why="a reward model's cost is its inference task's")
DYNAMIC_ONLY = effective_when(("algo.dynamic_sampling", "==", True), why="only dynamic sampling over-samples")


@dataclass
class AlgorithmConfig:
    """One RL algorithm (module docstring); ``conf/algo/<name>.yaml`` sets these."""

    name: str = "ppo"
    # gae (needs a critic: value inference and critic training) | group_norm (GRPO, DAPO) |
    # leave_one_out (RLOO) | batch_norm (REINFORCE++)
    advantage: str = "gae"
    # Weight of the KL divergence to the reference model; 0 drops the reference model and its
    # inference (DAPO).
    kl_coef: float = 0.05
    # Where the KL term goes: reward (subtracted from the reward per token: PPO, RLOO, REINFORCE++)
    # or loss (a k3 estimate added to the policy loss: GRPO, DeepSeekMath eq. 3-4)
    kl_penalty: str = field(default="reward", metadata=LOSS_ONLY)
    # Upper clip bound of the policy ratio, 1 + clip_eps_high, when set (DAPO's clip-higher, 0.28 in
    # arXiv 2503.14476 section 3.1); None: symmetric, backend.options.clip_eps
    clip_eps_high: Optional[float] = field(default=None, metadata=LOSS_ONLY)
    # Leave responses cut at workload.max_gen_len out of the loss (DAPO's overlong filtering,
    # section 3.4): a truncated response's reward says nothing about its answer
    overlong_filter: bool = field(default=False, metadata=LOSS_ONLY)
    group_size: int = 1  # responses per prompt
    reward: str = "model"  # model (an inference task) | rule (a verifier on the driver's CPUs)
    # reward: rule only. CPU seconds to verify one response: an assumed cost, not a measurement (a
    # regular-expression answer check takes well under a millisecond, a symbolic comparison more)
    rule_reward_s_per_sample: float = field(default=0.002, metadata=RULE_ONLY)
    num_reward_workers: int = field(default=8, metadata=RULE_ONLY)  # processes verifying responses in parallel
    # DAPO's dynamic sampling (module docstring): over-sample, drop groups whose responses all score
    # alike, generate again until global_batch_size prompts with mixed outcomes are kept
    dynamic_sampling: bool = False
    # prompts generated per round, as a multiple of global_batch_size (verl's DAPO recipe: 3)
    oversample_factor: float = field(default=3.0, metadata=DYNAMIC_ONLY)
    # most generation rounds per iteration; more needed is an error (verl: max_num_gen_batches)
    max_gen_rounds: int = field(default=10, metadata=DYNAMIC_ONLY)

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"algo.advantage={self.advantage!r}: expected one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.reward not in REWARD_KINDS:
            raise ConfigError(f"algo.reward={self.reward!r}: expected one of {', '.join(REWARD_KINDS)}")
        if self.kl_penalty not in KL_PENALTIES:
            raise ConfigError(f"algo.kl_penalty={self.kl_penalty!r}: expected one of {', '.join(KL_PENALTIES)}")
        if self.clip_eps_high is not None and not (self.clip_eps_high > 0):
            raise ConfigError(f"algo.clip_eps_high={self.clip_eps_high}: must be > 0 (or null: symmetric clipping)")
        if not (self.kl_coef >= 0):
            raise ConfigError(f"algo.kl_coef={self.kl_coef}: must be >= 0 (0 drops the reference model)")
        if self.group_size < 1:
            raise ConfigError(f"algo.group_size={self.group_size}: must be at least 1 response per prompt")
        if self.advantage in ("group_norm", "leave_one_out") and self.group_size < 2:
            raise ConfigError(f"algo.advantage={self.advantage} compares the responses to one prompt: "
                              f"algo.group_size={self.group_size} must be at least 2")
        if not (self.rule_reward_s_per_sample >= 0):
            raise ConfigError(f"algo.rule_reward_s_per_sample={self.rule_reward_s_per_sample}: must be >= 0")
        if self.num_reward_workers < 1:
            raise ConfigError(f"algo.num_reward_workers={self.num_reward_workers}: must be at least 1")
        if self.dynamic_sampling:
            if self.group_size < 2:
                raise ConfigError(f"algo.dynamic_sampling drops groups whose responses all score alike: "
                                  f"algo.group_size={self.group_size} must be at least 2")
            if self.reward != "rule":
                raise ConfigError("algo.dynamic_sampling filters groups on the rule-based verifier's accuracy: "
                                  f"set algo.reward=rule (not {self.reward!r}) or algo.dynamic_sampling=false")
            if not (self.oversample_factor >= 1):
                raise ConfigError(f"algo.oversample_factor={self.oversample_factor}: a round generates at least "
                                  f"the prompts it trains on (>= 1)")
            if self.max_gen_rounds < 1:
                raise ConfigError(f"algo.max_gen_rounds={self.max_gen_rounds}: must be at least 1")

    @property
    def has_critic(self) -> bool:
        """Value inference and critic training run (GAE)."""
        return self.advantage == "gae"

    @property
    def has_reference(self) -> bool:
        """The reference model's inference runs (a KL term with a positive weight)."""
        return self.kl_coef > 0

    @property
    def has_reward_model(self) -> bool:
        return self.reward == "model"

    @property
    def roles(self) -> tuple[str, ...]:
        """The models an iteration runs, in workflow order."""
        return tuple(r for r, present in (("actor", True), ("critic", self.has_critic),
                                          ("ref", self.has_reference), ("reward", self.has_reward_model)) if present)


PPO = AlgorithmConfig()


def sample_workload(workload, algorithm: AlgorithmConfig):
    """``workload`` (batch sizes in prompts) as the samples it puts through an iteration: the global
    and mini-batch sizes times the group size (the same object for one response per prompt)."""
    g = algorithm.group_size
    if g == 1:
        return workload
    if workload.path is not None:
        raise ConfigError(f"algo.group_size={g} with a JSON-lines workload (workload.path): its records give one "
                          f"response length per prompt, not {g}; use a synthetic workload (workload=hh_rlhf)")
    return dataclasses.replace(workload, global_batch_size=workload.global_batch_size * g,
                               mini_batch_size=workload.mini_batch_size * g)


def samples_per_round(workload, algorithm: AlgorithmConfig) -> int:
    """Samples one generation round holds: the batch (``workload`` counting samples, as
    :func:`sample_workload` makes it), or under dynamic sampling its over-sampled rounds'
    (:func:`~harness.core.workload.make_sampled_batch`)."""
    if not algorithm.dynamic_sampling:
        return workload.global_batch_size
    g = algorithm.group_size
    return math.ceil(algorithm.oversample_factor * (workload.global_batch_size // g)) * g

