"""What the driver of ``backend=ray`` sends its device workers: one frozen request per worker
method, and how a request reaches the devices of a call. What the workers answer is
:mod:`harness.backends.ray.replies`; what they are started with, :mod:`harness.backends.ray.settings`.

Every request names its task (for spans and errors), its model role and the layout it computes in
(``allocation``); its class says which :class:`~harness.backends.ray.worker.device.DeviceWorker`
method runs it (``Request.method``). Everything in a request is a typed value (no string-keyed
records), so both sides read the same fields and Ray pickles it as it is.

How a call reaches its devices is explicit (:class:`Dispatch`, as the dispatch modes of verl's and
OpenRLHF's worker groups):

- ``ONE_TO_ALL``: the same request to every device; each worker computes its own share from its
  place in the layout (generation rows by dp replica, tensor and pipeline shards, a weight
  movement's sends and receives);
- ``BY_DP_RANK``: one request per data-parallel replica, every device of replica ``k`` receiving
  the rows the driver gave it (``Infer.rows``);
- ``BY_DEVICE``: one request per device (a fused pipeline stage: each device's logical rank runs
  its own lowered action list, RLHFuse section 5).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Optional

import numpy as np

from harness.core.plan import Allocation


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    BY_DP_RANK = "by_dp_rank"
    BY_DEVICE = "by_device"


@dataclass(frozen=True)
class Request:
    task: str
    role: str
    allocation: Allocation
    method: ClassVar[str] = ""

    def replace(self, **changes) -> "Request":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TaskReward:
    """A programmatic reward (:mod:`harness.backends.ray.rewards`): the score of a sample is the
    fraction of its response tokens whose id lies in ``[low, high)``; with ``pass_at`` set, 1 when
    that fraction reaches it and 0 otherwise (a pass/fail verdict)."""
    kind: str
    low: int
    high: int
    pass_at: Optional[float] = None


@dataclass(frozen=True)
class Sampling(Request):
    """What generating needs: the batch's prompts and target lengths (length-controlled samples),
    the sampling parameters, slots per instance and the KV capacity per sample."""
    prompts: list = field(default_factory=list)
    target_lens: list = field(default_factory=list)
    max_batch_size: Optional[int] = None
    temperature: float = 1.0
    sampling_seed: int = 0
    kv_capacity: int = 0


@dataclass(frozen=True)
class Generate(Sampling):
    """Generate every sample of the batch dealt to this device's dp replica, with continuous
    batching or in static rounds (``batching``): ``assignment[k]``, the sample ids replica ``k``
    generates in the order it admits them (StreamRL's length dispatch:
    :func:`harness.planning.taskmodels.generation.dispatch_samples`), or round-robin when None."""
    batching: str = "continuous"
    assignment: Optional[tuple] = None
    method: ClassVar[str] = "generate"


@dataclass(frozen=True)
class Infer(Request):
    """Forward passes of the rollout: log-probs, values or scores (``what``). ``rows``: the samples
    of this replica (None: dealt round-robin by dp replica on the worker)."""
    tokens: Optional[np.ndarray] = None
    attn: Optional[np.ndarray] = None
    last_index: Optional[np.ndarray] = None
    what: str = "logprobs"
    micro_batch_size: int = 1
    temperature: float = 1.0
    rows: Optional[list] = None
    task_reward: Optional[TaskReward] = None  # a programmatic reward replaces the reward model's score
    # sequence packing: each replica's rows packed first-fit decreasing into micro-batches of at
    # most this many tokens (harness.planning.packing.pack_bins); None: micro_batch_size rows each
    micro_batch_tokens: Optional[int] = None
    prompt_lens: Optional[list] = None
    method: ClassVar[str] = "infer"


@dataclass(frozen=True)
class LossInputs:
    """One training loss's per-sample inputs over the whole batch, under the workflow's names
    (:func:`harness.planning.dataflow.loss_inputs`): the actor's loss reads ``old_logprobs`` and
    ``advantages`` (and ``ref_logprobs`` with the KL as a loss term), the critic's ``old_values`` and
    ``returns``; the others stay None."""
    tokens: np.ndarray
    attn: np.ndarray
    action_mask: np.ndarray
    old_logprobs: Optional[np.ndarray] = None
    advantages: Optional[np.ndarray] = None
    old_values: Optional[np.ndarray] = None
    returns: Optional[np.ndarray] = None
    ref_logprobs: Optional[np.ndarray] = None

    def arrays(self) -> dict[str, np.ndarray]:
        """The inputs present, by name (the worker's micro-batches are cut from them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class TrainPart:
    """One model's share of a training stage: its loss inputs and micro-batch size; under sequence
    packing (``micro_batch_tokens``, the stage's budget) each replica's share of a mini-batch runs
    as ``num_micro_batches`` packed micro-batches, its pipe's count in the schedule."""
    inputs: LossInputs
    micro_batch_size: int
    micro_batch_tokens: Optional[int] = None
    num_micro_batches: Optional[int] = None

    def __post_init__(self) -> None:
        if self.micro_batch_tokens is not None and not self.num_micro_batches:
            raise ValueError("a packed training part needs its schedule's micro-batch count")


@dataclass(frozen=True)
class Train(Request):
    """One PPO epoch of the models of a training stage on this device: ``actions``, its logical
    rank's lowered action list, in order (one optimizer step per mini-batch). ``parts`` and
    ``allocations`` by model role; ``pipe_role`` maps each pipe of the schedule to its role."""
    parts: dict[str, TrainPart] = field(default_factory=dict)
    allocations: dict[str, Allocation] = field(default_factory=dict)
    pipe_role: dict[str, str] = field(default_factory=dict)
    actions: tuple[str, ...] = ()
    minibatches: list = field(default_factory=list)
    temperature: float = 1.0
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None  # upper clip bound 1 + clip_eps_high (DAPO); None: symmetric
    kl_loss_coef: float = 0.0  # weight of the k3 KL term in the actor's loss (GRPO); 0: none
    value_clip_eps: float = 0.2
    method: ClassVar[str] = "train"


@dataclass(frozen=True)
class Move(Request):
    """Move ``role``'s weights from the ``source`` layout to ``allocation`` (sends and receives)."""
    source: Optional[Allocation] = None
    method: ClassVar[str] = "move"


@dataclass(frozen=True)
class State(Request):
    """This device's piece of the weights (the driver's digest)."""
    method: ClassVar[str] = "state"


@dataclass(frozen=True)
class Release(Request):
    """Free this device's copy of ``role`` in ``allocation``."""
    method: ClassVar[str] = "release"


@dataclass(frozen=True)
class OpenSession(Sampling):
    """Streamed generation (RLHFuse section 4): open this instance's session on ``sample_ids``."""
    sample_ids: list = field(default_factory=list)
    method: ClassVar[str] = "open_session"


@dataclass(frozen=True)
class Submit(Request):
    """Add samples to this instance's open session (continuous rollout: groups launched while
    others generate): ``prompts[j]`` generated to ``target_lens[j]`` tokens as sample
    ``sample_ids[j]``, its sampler seeded with ``generator_seeds[j]``."""
    sample_ids: tuple = ()
    prompts: tuple = ()
    target_lens: tuple = ()
    generator_seeds: tuple = ()
    method: ClassVar[str] = "submit"


@dataclass(frozen=True)
class Steps(Request):
    """Advance the session by up to ``max_steps`` engine steps."""
    max_steps: int = 1
    method: ClassVar[str] = "steps"


@dataclass(frozen=True)
class Export(Request):
    """Take the session's unfinished samples out (with their KV caches when ``with_kv``)."""
    with_kv: bool = True
    method: ClassVar[str] = "export"


@dataclass(frozen=True)
class ExportedSample:
    """An unfinished sample taken out of a generation session: everything but its KV cache, which
    stays on the devices of its instance until :class:`Migrate` sends it."""
    sample_id: int
    prompt: list
    tokens: list
    logprobs: list
    target_len: Optional[int]
    max_new_tokens: int
    rng_state: Optional[list]  # the sampler's generator state (bytes as ints)


@dataclass(frozen=True)
class KvMove:
    """One sample's KV shard from device ``src`` (tp rank t of its instance) to ``dst`` (tp rank t of
    the destination); ``kv_shapes``: the shard's key (and value) shape per layer."""
    src: int
    dst: int
    sample: ExportedSample
    kv_shapes: dict[int, list]


@dataclass(frozen=True)
class Migrate(Request):
    """Send the exported samples' KV shards and import the samples moved here (``moves``)."""
    moves: tuple[KvMove, ...] = ()
    with_kv: bool = True
    method: ClassVar[str] = "migrate"


@dataclass(frozen=True)
class CloseSession(Request):
    method: ClassVar[str] = "close_session"
