"""The work one device does for generation and inference tasks.

Each function runs on every device of the task's mesh with that device's :class:`Replica` and
returns ``(spans, output)``: spans as ``(kind, start, end, flops, bytes)`` in ``time.time()``
seconds, the output (:mod:`harness.backends.ray.replies`) only on the device that reports for its
dp replica (last pipeline stage, tp rank 0). Samples are dealt to dp replicas round-robin (as the
simulator deals them to generation instances and inference replicas).

Training (pipeline schedules, PPO losses, optimizer steps) is in :mod:`harness.backends.ray.worker.pipeline`.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
from torch import Tensor

from harness.backends.ray.protocol import Generate, Infer
from harness.backends.ray.replies import FinishedSample, Generated, Inferred, SpanT
from harness.backends.ray.rewards import task_scores
from harness.backends.ray.settings import EngineOptions
from harness.costmodel.llama import ModelDims, forward_flops
from harness.planning.packing import pack_bins
from harness.real import packing
from harness.real.engine import SamplingParams, TorchGenerator
from harness.real.model import split_layers
from harness.real.parallel.comm import PipeChannel
from harness.real.parallel.replica import Replica


def _flops(dims: ModelDims, replica: Replica, num_tokens: float, seq_len: float) -> float:
    s = replica.strategy
    lo, hi = split_layers(replica.args.num_layers, s.pp)[replica.coord[1]]
    return forward_flops(dims, num_tokens, seq_len / 2, num_layers=hi - lo, include_head=replica.is_last) / s.tp


def model_inputs(mb: dict[str, Tensor]) -> dict[str, Tensor]:
    """The keyword arguments of a micro-batch's forward pass: its packing, else its padding mask."""
    return {"segment_ids": mb["segment_ids"]} if "segment_ids" in mb else {"attention_mask": mb["attn"]}


def micro_batch_flops(dims: ModelDims, replica: Replica, mb: dict[str, Tensor]) -> float:
    """A forward pass's FLOPs on this device: a packed micro-batch's samples each at its own length
    (attention stays inside a sample), else the padded batch's real tokens at its width."""
    if "lengths" in mb:
        return sum(_flops(dims, replica, float(n), float(n)) for n in mb["lengths"].tolist())
    return _flops(dims, replica, float(mb["attn"].sum()), mb["attn"].shape[1])


# ---- generation -------------------------------------------------------------------------

def make_engine(replica: Replica, *, max_batch_size: int, sampling: SamplingParams, kv_capacity: int):
    """The generation engine of one instance: ours over the replica's module, or -- with
    ``backend.options.generation_engine=vllm`` (``replica.engine_options``, an
    :class:`~harness.backends.ray.settings.EngineOptions`) -- a vLLM engine kept on the replica across
    calls, built once from the replica's weights written as a Hugging Face checkpoint and refreshed
    in place (``VllmEngine.load_state``) before each use."""
    opts: EngineOptions = getattr(replica, "engine_options", None) or EngineOptions()
    if opts.name != "vllm":
        return TorchGenerator(replica.module, max_batch_size=max_batch_size, sampling=sampling,
                              kv_capacity=kv_capacity)
    import tempfile

    from harness.real.vllm_engine import VllmEngine, save_hf_llama

    v = opts.vllm
    state = {n: p.detach() for n, p in replica.module.named_parameters()}
    engine = getattr(replica, "vllm_engine", None)
    max_len = int(v.max_model_len or kv_capacity)
    if engine is None or engine.max_batch_size < max_batch_size or replica.vllm_max_len < max_len:
        workdir = v.workdir or tempfile.mkdtemp(prefix=f"vllm_{replica.role}_{replica.rank}_")
        dtype = replica.dtype
        path = save_hf_llama(state, replica.args, f"{workdir}/rank{replica.rank}", dtype=dtype)
        extra = {"kv_cache_memory_bytes": int(v.kv_cache_memory_bytes)} if v.kv_cache_memory_bytes else {}
        engine = VllmEngine(path, max_batch_size=max_batch_size, sampling=sampling,
                            dtype=str(dtype).removeprefix("torch."), max_model_len=max_len,
                            enforce_eager=bool(v.enforce_eager),
                            gpu_memory_utilization=float(v.gpu_memory_utilization), **extra)
        replica.vllm_engine, replica.vllm_max_len = engine, max_len
    else:
        engine.load_state(state)
    engine.sampling = sampling
    return engine


def generate(replica: Replica, p: Generate) -> tuple[list[SpanT], Generated | None]:
    """Length-controlled generation of this replica's samples (``p.assignment``'s, else dealt
    round-robin), admitted in that order (continuous batching, or static rounds of
    ``max_batch_size`` that each wait for their longest sample)."""
    k, dp = replica.coord[0], replica.strategy.dp
    ids = [int(i) for i in p.assignment[k]] if p.assignment is not None else list(range(k, len(p.prompts), dp))
    max_batch = max(1, min(p.max_batch_size or len(ids), len(ids)))
    sampling = SamplingParams(temperature=p.temperature, seed=p.sampling_seed)
    rounds = [ids[i:i + max_batch] for i in range(0, len(ids), max_batch)] if p.batching == "static" else [ids]
    spans, finished = [], []

    def on_finish(f):
        finished.append(FinishedSample(f.sample_id, f.tokens, f.logprobs, time.time()))

    with torch.no_grad(), replica.compute():
        replica.set_train(False)
        for chunk in rounds:
            engine = make_engine(replica, max_batch_size=max_batch, sampling=sampling,
                                 kv_capacity=int(p.kv_capacity))
            for i in chunk:
                engine.submit(i, p.prompts[i], target_len=int(p.target_lens[i]))
            t0 = time.time()
            engine.run(on_finish)
            spans.append(("decode", t0, time.time(), 0.0, 0.0))
    return spans, (Generated(finished) if replica.coord[2] == 0 else None)


# ---- inference --------------------------------------------------------------------------

def _head_output(out: Tensor, tokens: Tensor, what: str, temperature: float, last_index: Tensor) -> Tensor:
    if what == "logprobs":
        logp = torch.log_softmax(out[:, :-1].float() / temperature, dim=-1)
        return logp.gather(-1, tokens[:, 1:, None])[..., 0]
    if what == "values":
        return out[:, :-1].float()
    return out[torch.arange(out.shape[0]), last_index].float()  # score of the last token


def _pass_micro_batches(p: Infer, tokens: Tensor, attn: Tensor, mine: np.ndarray, dp: int,
                        lockstep: bool) -> list[list[int]]:
    """This replica's micro-batches of a forward pass, as lists of rows: ``micro_batch_size`` rows
    each, or under sequence packing its rows packed first-fit decreasing to ``micro_batch_tokens``
    (:func:`harness.planning.packing.pack_bins`). ``lockstep`` (DeepSpeed's ZeRO-3 gathers inside
    forward: every replica runs as many passes) pads with empty micro-batches to the most any
    replica of a round-robin deal runs."""
    mbs = p.micro_batch_size
    if p.micro_batch_tokens is None:
        groups = [[int(r) for r in mine[i:i + mbs]] for i in range(0, len(mine), mbs)]
        if lockstep:
            most = math.ceil(math.ceil(tokens.shape[0] / dp) / mbs)
    else:
        lengths = packing.row_lengths(attn)
        groups = [[int(mine[i]) for i in b] for b in pack_bins(lengths[mine].tolist(), p.micro_batch_tokens)]
        if lockstep:
            most = max(len(pack_bins(lengths[k::dp].tolist(), p.micro_batch_tokens)) for k in range(dp))
    return groups + [[] for _ in range(most - len(groups))] if lockstep else groups


def infer(replica: Replica, p: Infer, dims: ModelDims, in_order: bool = True) -> tuple[list[SpanT], Inferred | None]:
    """Forward passes over this replica's rows, micro-batch by micro-batch through its pipeline
    stages (packed micro-batches under sequence packing, their outputs put back per sample);
    ``in_order``: pipeline messages matched in posting order, as NCCL does."""
    tokens, attn = torch.tensor(p.tokens), torch.tensor(p.attn)
    last_index = torch.tensor(p.last_index)
    prompt_lens = torch.tensor(p.prompt_lens) if p.task_reward else None
    k, dp = replica.coord[0], replica.strategy.dp
    # samples are dealt to dp replicas round-robin, unless the driver gives one replica its rows
    # (streamed inference: one replica takes a micro-batch of finished samples)
    mine = np.asarray(p.rows, dtype=np.int64) if p.rows is not None else np.arange(tokens.shape[0])[k::dp]
    groups = _pass_micro_batches(p, tokens, attn, mine, dp, getattr(replica, "lockstep", False))
    chan, spans, outputs = PipeChannel(replica.device, in_order=in_order), [], []
    hidden = replica.args.hidden_size
    dev = replica.device
    width = tokens.shape[1]
    with torch.no_grad(), replica.compute():
        replica.set_train(False)
        for m, group in enumerate(groups):
            rows = torch.as_tensor(group, dtype=torch.long)
            dummy = len(rows) == 0
            x_tok = tokens[rows] if not dummy else tokens[:1]
            x_attn = attn[rows] if not dummy else attn[:1]
            packed = p.micro_batch_tokens is not None and not dummy
            mb = packing.pack({"tokens": x_tok, "attn": x_attn}, range(len(group))) if packed else \
                {"tokens": x_tok, "attn": x_attn}
            inputs = {name: v.to(dev) for name, v in model_inputs(mb).items()}
            lengths, x_in = mb.get("lengths"), mb["tokens"]
            flops = micro_batch_flops(dims, replica, mb)
            x = x_in.to(dev) if replica.is_first else chan.recv((len(x_in), x_in.shape[1], hidden),
                                                                 replica.neighbour(-1), tag=m, dtype=replica.dtype)
            chan.post()
            t0 = time.time()
            out = replica(x, **inputs)
            t1 = time.time()
            spans.append(("forward", t0, t1, flops, 0.0))
            if not replica.is_last:
                chan.send(out, replica.neighbour(1), tag=m)
            elif not dummy and p.task_reward:  # a programmatic reward replaces the model's score
                outputs.append(task_scores(x_tok, prompt_lens[rows], last_index[rows], p.task_reward))
            elif not dummy and lengths is None:
                outputs.append(_head_output(out, x_tok.to(dev), p.what, p.temperature,
                                            last_index[rows].to(dev)).cpu())
            elif not dummy and p.what == "score":  # the score of each sample's last token
                outputs.append(out[0, packing.last_positions(lengths).to(dev)].float().cpu())
            elif not dummy:
                outputs.append(packing.unpack(_head_output(out, x_in.to(dev), p.what, p.temperature, None).cpu(),
                                              lengths.tolist(), width))
        chan.flush()
    if not replica.reports:
        return spans, None
    rows_out = np.asarray([r for g in groups for r in g], dtype=np.int64)
    out = torch.cat(outputs).numpy() if outputs else np.zeros((0,), dtype=np.float32)
    return spans, Inferred(rows_out, out)
