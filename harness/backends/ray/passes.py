"""The work one device does for a task: generation, an inference pass, a training stage.

Each function runs on every device of the task's mesh with that device's :class:`Replica` and
returns ``(spans, outputs)``: spans as ``(kind, start, end, flops, bytes)`` in ``time.time()``
seconds, outputs only on the device that reports for its dp replica (last pipeline stage, tp
rank 0). Samples are dealt to dp replicas round-robin (as the simulator deals them to generation
instances and inference replicas); a training mini-batch is cut into dp contiguous shares, each
share into micro-batches of ``micro_batch_size``.

Pipeline parallelism executes the plan's own action list for this device's stage (the schedule
``harness.schedule`` builds and the simulator times), lowered to sends and receives with the
receives in each sender's send order (``harness.schedule.p2p_order``): ``RF``/``RB`` receive an
activation/gradient, ``F`` runs the stage, ``SF`` sends its output on; ``B`` back-propagates and
``SB`` sends the input gradient back. Sends are asynchronous and receives block, so any schedule
that ``harness.schedule.validate`` accepts runs without deadlock, and messages match in posting
order per rank pair, as under NCCL (which ignores tags).
"""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from harness.backends.ray.comm import PipeChannel
from harness.backends.ray.replica import Replica
from harness.backends.ray.rewards import task_scores
from harness.costmodel.llama import forward_flops
from harness.real.engine import GenerationEngine, SamplingParams
from harness.real.ppo import policy_loss, value_loss
from harness.real.model import split_layers
from harness.schedule.ir import Action

SpanT = tuple[str, float, float, float, float]


def _flops(model_cfg: dict, replica: Replica, num_tokens: float, seq_len: float) -> float:
    s = replica.strategy
    lo, hi = split_layers(replica.args.num_layers, s.pp)[replica.coord[1]]
    return forward_flops(model_cfg, num_tokens, seq_len / 2, num_layers=hi - lo, include_head=replica.is_last) / s.tp


# ---- generation -------------------------------------------------------------------------

def make_engine(replica: Replica, *, max_batch_size: int, sampling: SamplingParams, kv_capacity: int):
    """The generation engine of one instance: ours over the replica's module, or -- with
    ``backend.options.generation_engine=vllm`` (``replica.engine_options``) -- a vLLM engine kept on
    the replica across calls, built once from the replica's weights written as a Hugging Face
    checkpoint and refreshed in place (``VllmEngine.load_state``) before each use."""
    opts = getattr(replica, "engine_options", None) or {}
    if opts.get("generation_engine", "ours") != "vllm":
        return GenerationEngine(replica.module, max_batch_size=max_batch_size, sampling=sampling,
                                kv_capacity=kv_capacity)
    import tempfile

    from harness.real.vllm_engine import VllmEngine, save_hf_llama

    v = opts.get("vllm") or {}
    state = {n: p.detach() for n, p in replica.module.named_parameters()}
    engine = getattr(replica, "vllm_engine", None)
    max_len = int(v.get("max_model_len") or kv_capacity)
    if engine is None or engine.max_batch_size < max_batch_size or replica.vllm_max_len < max_len:
        workdir = v.get("workdir") or tempfile.mkdtemp(prefix=f"vllm_{replica.role}_{replica.rank}_")
        dtype = replica.dtype
        path = save_hf_llama(state, replica.args, f"{workdir}/rank{replica.rank}", dtype=dtype)
        extra = {"kv_cache_memory_bytes": int(v["kv_cache_memory_bytes"])} if v.get("kv_cache_memory_bytes") else {}
        engine = VllmEngine(path, max_batch_size=max_batch_size, sampling=sampling,
                            dtype=str(dtype).removeprefix("torch."), max_model_len=max_len,
                            enforce_eager=bool(v.get("enforce_eager", True)),
                            gpu_memory_utilization=float(v.get("gpu_memory_utilization", 0.3)), **extra)
        replica.vllm_engine, replica.vllm_max_len = engine, max_len
    else:
        engine.load_state(state)
    engine.sampling = sampling
    return engine


def generate(replica: Replica, p: dict[str, Any]) -> tuple[list[SpanT], Any]:
    """Length-controlled generation of this replica's samples (continuous batching, or static
    rounds of ``max_batch_size`` that each wait for their longest sample)."""
    k, dp = replica.coord[0], replica.strategy.dp
    ids = [i for i in range(len(p["prompts"])) if i % dp == k]
    max_batch = max(1, min(p["max_batch_size"] or len(ids), len(ids)))
    sampling = SamplingParams(temperature=p["temperature"], seed=p["sampling_seed"])
    rounds = [ids[i:i + max_batch] for i in range(0, len(ids), max_batch)] if p["batching"] == "static" else [ids]
    spans, finished = [], []

    def on_finish(f):
        finished.append((f.sample_id, f.tokens, f.logprobs, time.time()))

    with torch.no_grad(), replica.compute():
        replica.set_train(False)
        for chunk in rounds:
            engine = make_engine(replica, max_batch_size=max_batch, sampling=sampling,
                                 kv_capacity=int(p["kv_capacity"]))
            for i in chunk:
                engine.submit(i, p["prompts"][i], target_len=int(p["target_lens"][i]))
            t0 = time.time()
            engine.run(on_finish)
            spans.append(("decode", t0, time.time(), 0.0, 0.0))
    return spans, (finished if replica.coord[2] == 0 else None)


# ---- inference --------------------------------------------------------------------------

def _head_output(out: Tensor, tokens: Tensor, what: str, temperature: float, last_index: Tensor) -> Tensor:
    if what == "logprobs":
        logp = torch.log_softmax(out[:, :-1].float() / temperature, dim=-1)
        return logp.gather(-1, tokens[:, 1:, None])[..., 0]
    if what == "values":
        return out[:, :-1].float()
    return out[torch.arange(out.shape[0]), last_index].float()  # score of the last token


def infer(replica: Replica, p: dict[str, Any], model_cfg: dict) -> tuple[list[SpanT], Any]:
    tokens, attn = torch.tensor(p["tokens"]), torch.tensor(p["attn"])
    last_index = torch.tensor(p["last_index"])
    prompt_lens = torch.tensor(p["prompt_lens"]) if p.get("task_reward") else None
    k, dp = replica.coord[0], replica.strategy.dp
    mbs = p["micro_batch_size"]
    # samples are dealt to dp replicas round-robin, unless the driver gives one replica its rows
    # (streamed inference: one replica takes a micro-batch of finished samples)
    mine = np.asarray(p["rows"], dtype=np.int64) if p.get("rows") is not None else np.arange(tokens.shape[0])[k::dp]
    num_mbs = math.ceil(len(mine) / mbs)
    if getattr(replica, "lockstep", False):  # DeepSpeed gathers inside forward: equal pass counts
        num_mbs = math.ceil(math.ceil(tokens.shape[0] / dp) / mbs)
    chan, spans, outputs = PipeChannel(replica.device, in_order=p.get("p2p_in_order", True)), [], []
    hidden = replica.args.hidden_size
    dev = replica.device
    with torch.no_grad(), replica.compute():
        replica.set_train(False)
        for m in range(num_mbs):
            rows = torch.as_tensor(mine[m * mbs:(m + 1) * mbs], dtype=torch.long)
            dummy = len(rows) == 0
            x_tok = tokens[rows] if not dummy else tokens[:1]
            x_attn = attn[rows] if not dummy else attn[:1]
            x = x_tok.to(dev) if replica.is_first else chan.recv((len(x_tok), x_tok.shape[1], hidden),
                                                                  replica.neighbour(-1), tag=m, dtype=replica.dtype)
            chan.post()
            t0 = time.time()
            out = replica(x, attention_mask=x_attn.to(dev))
            t1 = time.time()
            spans.append(("forward", t0, t1, _flops(model_cfg, replica, float(x_attn.sum()), x_attn.shape[1]), 0.0))
            if not replica.is_last:
                chan.send(out, replica.neighbour(1), tag=m)
            elif not dummy and p.get("task_reward"):  # a programmatic reward replaces the model's score
                outputs.append(task_scores(x_tok, prompt_lens[rows], last_index[rows], p["task_reward"]))
            elif not dummy:
                outputs.append(_head_output(out, x_tok.to(dev), p["what"], p["temperature"],
                                            last_index[rows].to(dev)).cpu())
        chan.flush()
    if not replica.reports:
        return spans, None
    out = torch.cat(outputs).numpy() if outputs else np.zeros((0,), dtype=np.float32)
    return spans, {"index": mine, "out": out}


# ---- training ---------------------------------------------------------------------------

def _loss(out: Tensor, mb: dict[str, Tensor], p: dict[str, Any], num_tokens: float) -> tuple[Tensor, dict]:
    """The micro-batch's loss and stats, each divided by the mini-batch's ``num_tokens`` (so the
    micro-batches of a mini-batch, on every dp replica, add up to the mini-batch's value). The
    clip fractions are :mod:`harness.real.ppo`'s: tokens whose clipped term the loss takes."""
    mask = mb["action_mask"]
    if p["loss"] == "actor":
        logp = _head_output(out, mb["tokens"], "logprobs", p["temperature"], None)
        loss, s = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mask, p["clip_eps"], num_tokens)
        return loss, {"loss": s["actor/pg_loss"], "clipfrac": s["actor/pg_clipfrac"], "approx_kl": s["actor/ppo_kl"]}
    values = out[:, :-1].float()
    loss, s = value_loss(values, mb["old_values"], mb["returns"], mask, p["value_clip_eps"], num_tokens)
    return loss, {"loss": s["critic/vf_loss"], "clipfrac": s["critic/vf_clipfrac"]}


def _micro_batches(data: dict[str, Tensor], index: np.ndarray, k: int, dp: int, mbs: int) -> list[dict[str, Tensor]]:
    share = len(index) // dp
    rows = index[k * share:(k + 1) * share]
    return [{name: v[torch.as_tensor(rows[i:i + mbs], dtype=torch.long)] for name, v in data.items()}
            for i in range(0, len(rows), mbs)]


def train(replica: Replica, p: dict[str, Any], model_cfg: dict) -> tuple[list[SpanT], Any]:
    """One PPO epoch of one model over the batch: one optimizer step per mini-batch, the plan's
    action list for this device's pipeline stage."""
    part = {k: p[k] for k in ("data", "loss", "micro_batch_size")}
    fused = {**p, "parts": {replica.role: part}, "actions": p["actions_by_stage"][replica.coord[1]],
             "pipe_role": None}
    spans, outs = train_fused({replica.role: replica}, fused, {replica.role: model_cfg})
    return spans[replica.role], outs[replica.role]


def _message_tag(tag_base: dict[str, int], act: Action) -> int:
    """A message's tag (used only when the channel matches by tag): its pipe, micro-batch and
    direction (a forward activation and the gradient coming back)."""
    return tag_base[act.pipe] + 2 * act.mb + (act.kind in ("SB", "RB"))


def train_fused(replicas: dict[str, Replica], p: dict[str, Any], model_cfgs: dict[str, dict]
                ) -> tuple[dict[str, list[SpanT]], dict[str, Any]]:
    """One PPO epoch of every model in ``replicas`` (role -> this device's replica) through one
    pipeline schedule: this device's logical rank runs ``p["actions"]`` in order, each action of
    the pipe ``p["pipe_role"]`` maps to a model (RLHFuse section 5: actor and critic share ranks
    and fill each other's bubbles). Per mini-batch, after the schedule, each model steps its
    optimizer (in ``replicas`` order, the same on every device). Returns spans and outputs per role.

    ``p["actions"]`` is the *lowered* list (``harness.schedule.lower``) with its receives in the
    senders' order (``harness.schedule.p2p_order.order_receives``), executed verbatim: ``RF``/``RB``
    receive an activation/gradient (consecutive receives are posted together, with the sends
    queued so far, right before the next computation, and kept until their computation runs);
    ``F``/``B`` compute; ``SF``/``SB`` queue the output/input gradient for the neighbouring stage.
    Posting follows the list, so messages match in posting order per rank pair, as under NCCL."""
    roles = list(replicas)
    any_replica = replicas[roles[0]]
    dev = any_replica.device
    actions = [Action.parse(a) for a in p["actions"]]
    if any_replica.strategy.pp > 1 and all(a.is_compute for a in actions):
        raise ValueError("train_fused needs the lowered action list (sends and receives), got compute actions only")
    pipe_role = p.get("pipe_role") or {}
    pipes = sorted({a.pipe for a in actions})
    tag_base = {name: i * 8192 for i, name in enumerate(pipes)}  # keeps every pipe's messages apart (tag mode)
    data = {r: {n: torch.tensor(v, device=dev) for n, v in p["parts"][r]["data"].items()} for r in roles}
    spans: dict[str, list[SpanT]] = {r: [] for r in roles}
    totals: dict[str, dict[str, float]] = {r: {} for r in roles}
    runs: dict[str, list] = {r: [] for r in roles}
    contexts = [replicas[r].compute() for r in roles]
    for c in contexts:
        c.__enter__()
    try:
        for r in roles:
            replicas[r].set_train(True)
        for index in p["minibatches"]:
            index = np.array(index)
            mbs, num_tokens, saved = {}, {}, {}
            for r in roles:
                rep = replicas[r]
                num_tokens[r] = float(data[r]["action_mask"][torch.tensor(index)].sum())
                mbs[r] = _micro_batches(data[r], index, rep.coord[0], rep.strategy.dp, p["parts"][r]["micro_batch_size"])
                saved[r] = {}
            chan = PipeChannel(dev, in_order=p.get("p2p_in_order", True))
            received: dict[tuple[str, str, int], Tensor] = {}  # (pipe, RF/RB, mb) -> payload
            to_send: dict[tuple[str, str, int], Tensor] = {}  # (pipe, SF/SB, mb) -> tensor computed
            pending: list[Action] = []  # receives to post before the next computation
            first_start = {r: None for r in roles}
            for act in actions:
                r = pipe_role.get(act.pipe, roles[0])
                rep, loss_p = replicas[r], {**p, **p["parts"][r]}
                mb = mbs[r][act.mb]
                if act.kind in ("RF", "RB"):
                    pending.append(act)
                    continue
                if act.kind in ("SF", "SB"):
                    chan.send(to_send.pop((act.pipe, act.kind, act.mb)), rep.neighbour(1 if act.kind == "SF" else -1),
                              _message_tag(tag_base, act))
                    continue
                if pending:
                    specs = []
                    for q in pending:
                        qr = replicas[pipe_role.get(q.pipe, roles[0])]
                        qmb = mbs[pipe_role.get(q.pipe, roles[0])][q.mb]["tokens"]
                        specs.append(((qmb.shape[0], qmb.shape[1], qr.args.hidden_size),
                                      qr.neighbour(-1 if q.kind == "RF" else 1), _message_tag(tag_base, q), qr.dtype))
                    for q, buf in zip(pending, chan.recv_all(specs)):
                        received[(q.pipe, q.kind, q.mb)] = buf
                    pending = []
                chan.post()
                t0 = time.time()
                if act.kind == "F":
                    x = mb["tokens"] if rep.is_first else received.pop((act.pipe, "RF", act.mb))
                    if not rep.is_first:
                        x.requires_grad_(True)
                    out = rep(x, attention_mask=mb["attn"])
                    if rep.is_last:
                        loss, stats = _loss(out, mb, loss_p, num_tokens[r])
                        for key, v in stats.items():
                            totals[r][key] = totals[r].get(key, 0.0) + v
                        saved[r][act.mb] = (x, loss, None)
                    else:
                        to_send[(act.pipe, "SF", act.mb)] = out
                        saved[r][act.mb] = (x, None, out)
                    kind, factor = "forward", 1.0
                else:
                    x, loss, out = saved[r].pop(act.mb)
                    if rep.is_last:
                        rep.backward(loss)
                    else:
                        rep.backward(None, output=out, grad=received.pop((act.pipe, "RB", act.mb)))
                    if not rep.is_first:
                        to_send[(act.pipe, "SB", act.mb)] = x.grad
                    kind, factor = "backward", 2.0
                t1 = time.time()
                first_start[r] = t0 if first_start[r] is None else first_start[r]
                flops = factor * _flops(model_cfgs[r], rep, float(mb["attn"].sum()), mb["attn"].shape[1])
                spans[r].append((kind, t0, t1, flops, 0.0))
                if act.kind == "B":
                    spans[r] += [(kd, a, b, 0.0, 0.0) for kd, a, b in rep.micro_step()]
            if pending or received or to_send:
                raise RuntimeError(f"train_fused: the action list left messages unmatched (receives not "
                                   f"consumed: {sorted(received)}, sends not posted: {sorted(to_send)})")
            chan.flush()
            end = time.time()
            for r in roles:
                runs[r].append((first_start[r] if first_start[r] is not None else end, end))
            for r in roles:  # gradient sync and optimizer step, model by model in the same order everywhere
                spans[r] += [(kd, a, b, 0.0, 0.0) for kd, a, b in replicas[r].optimizer_step()]
    finally:
        for c in reversed(contexts):
            c.__exit__(None, None, None)
    outs = {r: ({"stats": totals[r], "runs": runs[r]} if replicas[r].reports else {"runs": runs[r]}) for r in roles}
    return spans, outs
