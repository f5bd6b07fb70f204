"""Pipeline schedule IR (docs/DESIGN.md section 3): schedules as data.

Modelled on torch.distributed.pipelining's action lists, with one addition: every action names
its ``pipe``, because a fused schedule (RLHFuse section 5) interleaves two different models whose
stages run in opposite directions over the same ranks.

- :class:`Action` ``(pipe, stage, kind, mb)`` prints as a short token: ``A2F0`` is pipe ``A``,
  stage 2, forward, micro-batch 0. Kinds: ``F``, ``B`` (and ``W`` reserved for split backward);
  after lowering also ``SF``/``RF`` (send/recv of forward activations) and ``SB``/``RB`` (send/recv
  of gradients), printed with the peer rank: ``A2SF0>3``.
- :class:`PipeSpec` says how many stages and micro-batches one pipe has and which rank holds each
  stage; :class:`PipeCosts` gives per-stage times and activation memory (used by ``simulate``).
- :class:`Schedule` is ``pipes`` plus ``order``: rank -> ordered list of actions.

All passes over this IR are pure functions in sibling modules (builders, validate, lower,
simulate, io).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SF", "RF", "SB", "RB")
_TOKEN_RE = re.compile(r"^([A-Za-z]+?)(\d+)(SF|RF|SB|RB|F|B|W)(\d+)(?:>(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    pipe: str
    stage: int
    kind: str
    mb: int
    peer: int | None = None  # only for lowered send/recv actions

    def __post_init__(self) -> None:
        if not self.pipe.isalpha():
            raise ValueError(f"pipe name must be letters only, got {self.pipe!r}")
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def token(self) -> str:
        base = f"{self.pipe}{self.stage}{self.kind}{self.mb}"
        return base if self.peer is None else f"{base}>{self.peer}"

    def __str__(self) -> str:
        return self.token()

    @staticmethod
    def parse(token: str) -> "Action":
        m = _TOKEN_RE.match(token.strip())
        if not m:
            raise ValueError(f"cannot parse action token {token!r} (expected e.g. 'A2F0')")
        pipe, stage, kind, mb, peer = m.groups()
        return Action(pipe, int(stage), kind, int(mb), None if peer is None else int(peer))


@dataclass(frozen=True)
class PipeSpec:
    """One pipeline: ``num_stages`` stages, ``num_mbs`` micro-batches, stage s on rank
    ``stage_to_rank[s]``. ``model`` labels the model the pipe trains (e.g. ``actor``)."""

    name: str
    num_stages: int
    num_mbs: int
    stage_to_rank: tuple[int, ...]
    model: str = ""

    def __post_init__(self) -> None:
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"pipe {self.name}: stage_to_rank has {len(self.stage_to_rank)} entries "
                f"for {self.num_stages} stages"
            )
        if self.num_stages < 1 or self.num_mbs < 1:
            raise ValueError(f"pipe {self.name}: needs >= 1 stage and >= 1 micro-batch")


@dataclass(frozen=True)
class PipeCosts:
    """Per-stage costs of one micro-batch on one pipe: seconds (or abstract units) for forward and
    backward, activation memory held from F until B (GB or abstract units), and the time to move
    one micro-batch's activations/gradients to the neighbouring stage when it is on another rank."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    activation: tuple[float, ...]
    p2p: float = 0.0

    @staticmethod
    def uniform(num_stages: int, fwd: float, bwd: float | None = None,
                activation: float = 1.0, p2p: float = 0.0) -> "PipeCosts":
        bwd = 2.0 * fwd if bwd is None else bwd
        return PipeCosts((fwd,) * num_stages, (bwd,) * num_stages, (activation,) * num_stages, p2p)


@dataclass
class Schedule:
    pipes: dict[str, PipeSpec]
    order: dict[int, list[Action]] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        ranks = {r for p in self.pipes.values() for r in p.stage_to_rank}
        return sorted(ranks | set(self.order))

    def actions(self) -> list[Action]:
        return [a for r in sorted(self.order) for a in self.order[r]]
