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
from harness.real.engine import SamplingParams, TorchGenerator
from harness.real.model import split_layers
from harness.real.parallel.comm import PipeChannel
from harness.real.parallel.replica import Replica


def _flops(dims: ModelDims, replica: Replica, num_tokens: float, seq_len: float) -> float:
    s = replica.strategy
    lo, hi = split_layers(replica.args.num_layers, s.pp)[replica.coord[1]]
    return forward_flops(dims, num_tokens, seq_len / 2, num_layers=hi - lo, include_head=replica.is_last) / s.tp


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


def infer(replica: Replica, p: Infer, dims: ModelDims, in_order: bool = True) -> tuple[list[SpanT], Inferred | None]:
    """Forward passes over this replica's rows, micro-batch by micro-batch through its pipeline
    stages; ``in_order``: pipeline messages matched in posting order, as NCCL does."""
    tokens, attn = torch.tensor(p.tokens), torch.tensor(p.attn)
    last_index = torch.tensor(p.last_index)
    prompt_lens = torch.tensor(p.prompt_lens) if p.task_reward else None
    k, dp = replica.coord[0], replica.strategy.dp
    mbs = p.micro_batch_size
    # samples are dealt to dp replicas round-robin, unless the driver gives one replica its rows
    # (streamed inference: one replica takes a micro-batch of finished samples)
    mine = np.asarray(p.rows, dtype=np.int64) if p.rows is not None else np.arange(tokens.shape[0])[k::dp]
    num_mbs = math.ceil(len(mine) / mbs)
    if getattr(replica, "lockstep", False):  # DeepSpeed gathers inside forward: equal pass counts
        num_mbs = math.ceil(math.ceil(tokens.shape[0] / dp) / mbs)
    chan, spans, outputs = PipeChannel(replica.device, in_order=in_order), [], []
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
            spans.append(("forward", t0, t1, _flops(dims, replica, float(x_attn.sum()), x_attn.shape[1]), 0.0))
            if not replica.is_last:
                chan.send(out, replica.neighbour(1), tag=m)
            elif not dummy and p.task_reward:  # a programmatic reward replaces the model's score
                outputs.append(task_scores(x_tok, prompt_lens[rows], last_index[rows], p.task_reward))
            elif not dummy:
                outputs.append(_head_output(out, x_tok.to(dev), p.what, p.temperature,
                                            last_index[rows].to(dev)).cpu())
        chan.flush()
    if not replica.reports:
        return spans, None
    out = torch.cat(outputs).numpy() if outputs else np.zeros((0,), dtype=np.float32)
    return spans, Inferred(mine, out)
