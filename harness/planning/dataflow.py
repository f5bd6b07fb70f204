"""What the PPO training tasks consume, traced back to the data the earlier tasks write.

The one source of the training tasks' reads in :data:`harness.planning.workflow.PPO_TASKS`, hence
of the dependency edges the one scheduler (simulator and Ray driver alike) waits on
(:meth:`harness.core.plan.Plan.dependencies`).

Each training loss reads per-sample tensors (:data:`LOSS_INPUTS`, the payload the Ray backend ships
to its workers). Some are computed on the driver over the whole batch (:mod:`harness.real.ppo`):
the KL-penalised token rewards need the reward model's score, the actor's log-probs at generation
and the reference model's log-probs; GAE needs those rewards and the critic's values; returns are
advantages plus values (:data:`DERIVED_FROM`). Following the derivations down to the per-sample
data the workflow's earlier tasks write (:data:`SAMPLE_DATA`) gives each training task's reads
(:func:`training_reads`). Both losses therefore read all five: the critic's returns use the
KL-penalised rewards, so ``update_critic`` waits for ``ref`` (and for ``gen``'s log-probs).

:class:`TaskInputs` is one task's view of that data, holding only the keys it declares. The Ray
driver computes each training task's data through it, so a read missing from the declaration fails
on every run, naming the key, instead of depending on which inference task finished last;
``tests/harness/planning/test_dataflow.py`` runs the real math through it for every training task.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from harness.core.algorithm import PPO, AlgorithmConfig

# the per-sample data written before training, in workflow order: by gen (responses, its own
# log-probs), ref, reward (the reward model's score) and values (the critic's)
SAMPLE_DATA = ("responses", "old_logprobs", "ref_logprobs", "rewards", "values")

# what each training loss reads per sample (harness.real.ppo.policy_loss, value_loss)
LOSS_INPUTS = {
    "actor": ("tokens", "attn", "action_mask", "old_logprobs", "advantages"),
    "critic": ("tokens", "attn", "action_mask", "old_values", "returns"),
}

# what each derived tensor is computed from (names of SAMPLE_DATA or of other derived tensors)
DERIVED_FROM = {
    "tokens": ("responses",),
    "attn": ("responses",),
    "action_mask": ("responses",),
    "token_rewards": ("rewards", "old_logprobs", "ref_logprobs", "action_mask"),  # kl_penalized_rewards
    "old_values": ("values", "action_mask"),  # the critic's values on response tokens
    "advantages": ("token_rewards", "old_values", "action_mask"),  # gae_advantages, whitened over the batch
    "returns": ("token_rewards", "old_values", "action_mask"),  # advantages + old values
}


def sample_data_behind(name: str) -> set[str]:
    """The keys of :data:`SAMPLE_DATA` that the tensor ``name`` is computed from."""
    if name in SAMPLE_DATA:
        return {name}
    return set().union(*(sample_data_behind(source) for source in DERIVED_FROM[name]))


def loss_inputs(model: str, algorithm: AlgorithmConfig = PPO) -> tuple[str, ...]:
    """What the training loss of ``model`` reads per sample: :data:`LOSS_INPUTS`, and for the actor
    the reference log-probs when the KL term is a loss term (GRPO's ``algo.kl_penalty=loss``)."""
    extra = ("ref_logprobs",) if model == "actor" and algorithm.has_reference and algorithm.kl_penalty == "loss" else ()
    return LOSS_INPUTS[model] + extra


def training_reads(model: str, algorithm: AlgorithmConfig = PPO) -> tuple[str, ...]:
    """The data keys the training task of ``model`` (``actor`` or ``critic``) reads, in workflow
    order. The derivations above are PPO's; a critic-free estimator (GRPO's group normalisation,
    RLOO's leave-one-out baseline, REINFORCE++'s batch normalisation) computes the advantages from
    the rewards alone, so the actor does not read ``values``; without a KL term
    (``algorithm.kl_coef == 0``) nothing reads ``ref_logprobs``."""
    needed = set().union(*(sample_data_behind(name) for name in LOSS_INPUTS[model]))
    if not algorithm.has_critic:
        needed.discard("values")
    if not algorithm.has_reference:
        needed.discard("ref_logprobs")
    return tuple(key for key in SAMPLE_DATA if key in needed)


class UndeclaredRead(KeyError):
    """A task read data it does not declare: the plan would not make it wait for the data's writer."""

    def __str__(self) -> str:  # KeyError quotes its message; say it plainly
        return str(self.args[0])


class TaskInputs(Mapping):
    """The iteration's per-sample data as one task may read it: the keys of :data:`SAMPLE_DATA`
    among the task's declared ``reads``, taken from ``available`` (what finished tasks have written).

    Raises ``RuntimeError`` when a declared key is not available yet (the task was started before
    its writer finished) and :class:`UndeclaredRead` when the task reads a key it does not declare.
    """

    def __init__(self, task: str, reads: Iterable[str], available: Mapping[str, Any]):
        self.task = task
        self.declared = tuple(key for key in reads if key in SAMPLE_DATA)
        missing = [key for key in self.declared if key not in available]
        if missing:
            raise RuntimeError(f"{task} reads {missing}, which no finished task has written yet "
                               f"(it started before their writers finished)")
        self._data = {key: available[key] for key in self.declared}

    def __getitem__(self, key: str) -> Any:
        if key not in self._data:
            raise UndeclaredRead(f"{self.task} reads {key!r} without declaring it (declared: "
                                 f"{list(self.declared)}), so it would not wait for the task writing it; "
                                 f"the training tasks' reads come from harness.planning.dataflow")
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)
