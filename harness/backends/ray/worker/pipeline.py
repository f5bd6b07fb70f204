"""Training on one device: the plan's pipeline schedule, run verbatim, and the PPO losses.

Pipeline parallelism executes the plan's own action list for this device's stage (the schedule
``harness.schedule`` builds and the simulator times), lowered to sends and receives with the
receives in each sender's send order (``harness.schedule.p2p_order``): ``RF``/``RB`` receive an
activation/gradient, ``F`` runs the stage, ``SF`` sends its output on; ``B`` back-propagates and
``SB`` sends the input gradient back, one handler per action type (:class:`_ScheduleRun`). Sends
are asynchronous and receives block, so any schedule that ``harness.schedule.checks`` accepts
runs without deadlock, and messages match in posting order per rank pair, as under NCCL (which
ignores tags). A training mini-batch is cut into dp contiguous shares, each share into
micro-batches of ``micro_batch_size`` samples, or, under sequence packing (``TrainPart.micro_batch_tokens``),
into the schedule's micro-batch count of nearly equal tokens
(:func:`harness.planning.packing.balanced_bins`), each one packed row (:mod:`harness.real.packing`;
every stage of a replica packs alike, so the activations it exchanges have the shapes its
neighbour expects). :func:`train` returns the device's
:class:`~harness.backends.ray.replies.Trained`: per model, its spans, the start and end of its part
of each mini-batch's schedule, and its loss statistics where it computes the loss.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from harness.backends.ray.protocol import Train
from harness.backends.ray.replies import ModelTrained, PpoStats, SpanT, Trained
from harness.backends.ray.worker.passes import _head_output, micro_batch_flops, model_inputs
from harness.costmodel.llama import ModelDims
from harness.planning.packing import balanced_bins
from harness.real import packing
from harness.real.parallel.comm import PipeChannel
from harness.real.parallel.replica import Replica
from harness.real.advantages import kl_loss_k3
from harness.real.ppo import policy_loss, value_loss
from harness.schedule.ir import Action


def _loss(out: Tensor, mb: dict[str, Tensor], role: str, p: Train, num_tokens: float) -> tuple[Tensor, dict]:
    """The micro-batch's loss and stats, each divided by the mini-batch's ``num_tokens`` (so the
    micro-batches of a mini-batch, on every dp replica, add up to the mini-batch's value). The
    clip fractions are :mod:`harness.real.ppo`'s: tokens whose clipped term the loss takes."""
    mask = mb["action_mask"]
    if role == "actor":
        logp = _head_output(out, mb["tokens"], "logprobs", p.temperature, None)
        loss, s = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mask, p.clip_eps, num_tokens,
                              p.clip_eps_high)
        if p.kl_loss_coef:  # GRPO's KL term in the loss (harness.real.advantages.kl_loss_k3)
            loss = loss + p.kl_loss_coef * kl_loss_k3(logp, mb["ref_logprobs"], mask, num_tokens)
        return loss, {"loss": s["actor/pg_loss"], "clipfrac": s["actor/pg_clipfrac"], "approx_kl": s["actor/ppo_kl"]}
    values = out[:, :-1].float()
    loss, s = value_loss(values, mb["old_values"], mb["returns"], mask, p.value_clip_eps, num_tokens)
    return loss, {"loss": s["critic/vf_loss"], "clipfrac": s["critic/vf_clipfrac"]}


def _micro_batches(data: dict[str, Tensor], index: np.ndarray, k: int, dp: int, part) -> list[dict[str, Tensor]]:
    """Replica ``k``'s micro-batches of the mini-batch ``index`` (its ``k``-th contiguous share):
    ``part.micro_batch_size`` rows each, or under sequence packing ``part.num_micro_batches``
    packed rows of nearly equal tokens."""
    share = len(index) // dp
    rows = index[k * share:(k + 1) * share]
    if part.micro_batch_tokens is None:
        mbs = part.micro_batch_size
        return [{name: v[torch.as_tensor(rows[i:i + mbs], dtype=torch.long)] for name, v in data.items()}
                for i in range(0, len(rows), mbs)]
    lengths = packing.row_lengths(data["attn"][torch.as_tensor(rows, dtype=torch.long)]).tolist()
    return [packing.pack(data, [int(rows[i]) for i in group])
            for group in balanced_bins(lengths, part.num_micro_batches)]


def _message_tag(tag_base: dict[str, int], act: Action) -> int:
    """A message's tag (used only when the channel matches by tag): its pipe, micro-batch and
    direction (a forward activation and the gradient coming back)."""
    return tag_base[act.pipe] + 2 * act.mb + (act.kind in ("SB", "RB"))


def train(replicas: dict[str, Replica], p: Train, model_dims: dict[str, ModelDims], in_order: bool = True
          ) -> Trained:
    """One PPO epoch of every model in ``replicas`` (role -> this device's replica: one model, or two
    in a fused stage) through one pipeline schedule: this device's logical rank runs ``p.actions`` in
    order, each action of the pipe ``p.pipe_role`` maps to a model (RLHFuse section 5: actor and
    critic share ranks and fill each other's bubbles). Per mini-batch, after the schedule, each model
    steps its optimizer (in ``replicas`` order, the same on every device). Returns what each model
    did here. ``in_order``: pipeline messages matched in posting order per rank pair, as NCCL does.

    ``p.actions`` is the *lowered* list (``harness.schedule.lower``) with its receives in the
    senders' order (``harness.schedule.p2p_order.order_receives``), executed verbatim by
    :class:`_ScheduleRun`, one handler per action type."""
    roles = list(replicas)
    any_replica = replicas[roles[0]]
    dev = any_replica.device
    actions = [Action.parse(a) for a in p.actions]
    if any_replica.strategy.pp > 1 and all(a.is_compute for a in actions):
        raise ValueError("train needs the lowered action list (sends and receives), got compute actions only")
    pipes = sorted({a.pipe for a in actions})
    tag_base = {name: i * 8192 for i, name in enumerate(pipes)}  # keeps every pipe's messages apart (tag mode)
    data = {r: {n: torch.tensor(v, device=dev) for n, v in p.parts[r].inputs.arrays().items()} for r in roles}
    spans: dict[str, list[SpanT]] = {r: [] for r in roles}
    totals: dict[str, dict[str, float]] = {r: {} for r in roles}
    runs: dict[str, list] = {r: [] for r in roles}
    contexts = [replicas[r].compute() for r in roles]
    for c in contexts:
        c.__enter__()
    try:
        for r in roles:
            replicas[r].set_train(True)
        for index in p.minibatches:
            run = _ScheduleRun(replicas, p, model_dims, data, np.array(index), tag_base, spans, totals, in_order)
            for act in actions:
                run.handlers[act.kind](act)
            end = run.end()
            for r in roles:
                runs[r].append((run.first_start[r] if run.first_start[r] is not None else end, end))
            for r in roles:  # gradient sync and optimizer step, model by model in the same order everywhere
                spans[r] += [(kd, a, b, 0.0, 0.0) for kd, a, b in replicas[r].optimizer_step()]
    finally:
        for c in reversed(contexts):
            c.__exit__(None, None, None)
    return Trained({r: ModelTrained(spans[r], runs[r], _stats(totals[r]) if replicas[r].reports else None)
                    for r in roles})


def _stats(totals: dict[str, float]) -> PpoStats | None:
    """A model's summed loss statistics (None when it computed no loss here)."""
    if not totals:
        return None
    return PpoStats(totals["loss"], totals["clipfrac"], totals.get("approx_kl"))


class _ScheduleRun:
    """One mini-batch of a (lowered) pipeline schedule on this device: one handler per action type.

    - ``RF``/``RB`` (receive an activation / a gradient): queued; consecutive receives are posted
      together, with the sends queued so far, right before the next computation, and kept until
      their computation runs;
    - ``SF``/``SB`` (send the output / the input gradient): queued on the channel for the
      neighbouring stage;
    - ``F``/``B``: post what is pending, then compute; the last stage's forward computes the loss.

    Posting follows the list, so messages match in posting order per rank pair, as under NCCL
    (which ignores tags). The optimizer steps after the schedule (:func:`train`)."""

    def __init__(self, replicas: dict[str, Replica], p: Train, model_dims: dict[str, ModelDims],
                 data: dict[str, dict[str, Tensor]], index: np.ndarray, tag_base: dict[str, int],
                 spans: dict[str, list[SpanT]], totals: dict[str, dict[str, float]], in_order: bool):
        self.replicas, self.p, self.model_dims, self.tag_base = replicas, p, model_dims, tag_base
        self.spans, self.totals = spans, totals
        self.roles = list(replicas)
        self.pipe_role = p.pipe_role or {}
        self.mbs, self.num_tokens, self.saved = {}, {}, {}
        for r in self.roles:
            rep = replicas[r]
            # at least 1: a mini-batch whose responses were all filtered out (algo.overlong_filter) has loss 0
            self.num_tokens[r] = max(float(data[r]["action_mask"][torch.tensor(index)].sum()), 1.0)
            self.mbs[r] = _micro_batches(data[r], index, rep.coord[0], rep.strategy.dp, p.parts[r])
            self.saved[r] = {}
        self.chan = PipeChannel(replicas[self.roles[0]].device, in_order=in_order)
        self.received: dict[tuple[str, str, int], Tensor] = {}  # (pipe, RF/RB, mb) -> payload
        self.to_send: dict[tuple[str, str, int], Tensor] = {}  # (pipe, SF/SB, mb) -> tensor computed
        self.pending: list[Action] = []  # receives to post before the next computation
        self.first_start: dict[str, float | None] = {r: None for r in self.roles}
        self.handlers = {"RF": self.receive, "RB": self.receive, "SF": self.send, "SB": self.send,
                         "F": self.forward, "B": self.backward}

    def _role(self, act: Action) -> str:
        return self.pipe_role.get(act.pipe, self.roles[0])

    # ---- communication ------------------------------------------------------------------------
    def receive(self, act: Action) -> None:
        self.pending.append(act)

    def send(self, act: Action) -> None:
        rep = self.replicas[self._role(act)]
        self.chan.send(self.to_send.pop((act.pipe, act.kind, act.mb)), rep.neighbour(1 if act.kind == "SF" else -1),
                       _message_tag(self.tag_base, act))

    def _post(self) -> None:
        """Post the pending receives (with the queued sends) before a computation."""
        if self.pending:
            specs = []
            for q in self.pending:
                qr = self.replicas[self._role(q)]
                qmb = self.mbs[self._role(q)][q.mb]["tokens"]
                specs.append(((qmb.shape[0], qmb.shape[1], qr.args.hidden_size),
                              qr.neighbour(-1 if q.kind == "RF" else 1), _message_tag(self.tag_base, q), qr.dtype))
            for q, buf in zip(self.pending, self.chan.recv_all(specs)):
                self.received[(q.pipe, q.kind, q.mb)] = buf
            self.pending = []
        self.chan.post()

    # ---- computation --------------------------------------------------------------------------
    def forward(self, act: Action) -> None:
        self._post()
        r = self._role(act)
        rep, mb, t0 = self.replicas[r], self.mbs[r][act.mb], time.time()
        x = mb["tokens"] if rep.is_first else self.received.pop((act.pipe, "RF", act.mb))
        if not rep.is_first:
            x.requires_grad_(True)
        out = rep(x, **model_inputs(mb))
        if rep.is_last:
            loss, stats = _loss(out, mb, r, self.p, self.num_tokens[r])
            for key, v in stats.items():
                self.totals[r][key] = self.totals[r].get(key, 0.0) + v
            self.saved[r][act.mb] = (x, loss, None)
        else:
            self.to_send[(act.pipe, "SF", act.mb)] = out
            self.saved[r][act.mb] = (x, None, out)
        self._span(r, "forward", 1.0, t0, mb)

    def backward(self, act: Action) -> None:
        self._post()
        r = self._role(act)
        rep, mb, t0 = self.replicas[r], self.mbs[r][act.mb], time.time()
        x, loss, out = self.saved[r].pop(act.mb)
        if rep.is_last:
            rep.backward(loss)
        else:
            rep.backward(None, output=out, grad=self.received.pop((act.pipe, "RB", act.mb)))
        if not rep.is_first:
            self.to_send[(act.pipe, "SB", act.mb)] = x.grad
        self._span(r, "backward", 2.0, t0, mb)
        self.spans[r] += [(kd, a, b, 0.0, 0.0) for kd, a, b in rep.micro_step()]

    def _span(self, r: str, kind: str, factor: float, t0: float, mb: dict[str, Tensor]) -> None:
        t1 = time.time()
        self.first_start[r] = t0 if self.first_start[r] is None else self.first_start[r]
        flops = factor * micro_batch_flops(self.model_dims[r], self.replicas[r], mb)
        self.spans[r].append((kind, t0, t1, flops, 0.0))

    def end(self) -> float:
        """Check every message was matched, flush the channel; returns the end time."""
        if self.pending or self.received or self.to_send:
            raise RuntimeError(f"train: the action list left messages unmatched (receives not "
                               f"consumed: {sorted(self.received)}, sends not posted: {sorted(self.to_send)})")
        self.chan.flush()
        return time.time()
