"""vLLM (Kwon et al. 2023, PagedAttention) behind the :class:`~harness.real.engine.GenerationEngine`
interface (DESIGN section 6: "vLLM as an optional engine").

Owns the mapping of submit / step / run / export_unfinished / import_samples onto vLLM's
step-level ``LLMEngine`` (``add_request``, ``step``, ``abort_request``). vLLM is imported when an
engine is built, never at module import, and needs CUDA: it is not installed on CPU machines or
in CI, where building one raises :class:`EngineUnavailableError`. This adapter is not exercised
by the CPU test suite.

Differences from the torch engine: migration is tokens-only (vLLM's paged KV blocks and its
per-request generators are not exported), so a sampled sample continues with a fresh generator
seeded from (seed, sample id, tokens so far) and its tokens differ from an unmigrated run.
"""
from __future__ import annotations

from typing import Callable, Hashable

from harness.real.engine import EngineLoop, FinishedSample, MigratedSample, SamplingParams, sample_seed


class EngineUnavailableError(ImportError):
    """The optional engine's package is not installed."""


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise EngineUnavailableError(
            "VllmEngine needs vLLM, which is not installed: it runs on CUDA machines only "
            "(pip install 'rlhf-fusion-harness[gpu]'); use harness.real.engine.GenerationEngine on CPU") from exc
    return vllm


class VllmEngine(EngineLoop):
    """Continuous batching by vLLM over a local checkpoint directory (Hugging Face format)."""

    def __init__(self, model_path: str, *, max_batch_size: int = 256,
                 sampling: SamplingParams = SamplingParams(), **engine_kwargs):
        vllm = _import_vllm()
        self._vllm, self.sampling, self.max_batch_size = vllm, sampling, max_batch_size
        args = vllm.EngineArgs(model=str(model_path), max_num_seqs=max_batch_size, seed=sampling.seed,
                               **engine_kwargs)
        self._engine = vllm.LLMEngine.from_engine_args(args)
        self._requests: dict[str, dict] = {}  # request id -> sample state
        self.num_steps = 0

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
        self._requests[rid] = dict(sample_id=sample_id, prompt=list(prompt), done=list(done), done_lp=list(done_lp),
                                   target_len=target_len, max_new=max_new, tokens=[], logprobs=[])
        self._engine.add_request(rid, {"prompt_token_ids": list(prompt) + list(done)},
                                 self._params(sample_id, done, target_len, max_new))

    def submit(self, sample_id: Hashable, prompt_tokens: list[int], target_len: int | None = None) -> None:
        self._add(sample_id, prompt_tokens, [], [], target_len, self.sampling.max_new_tokens)

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

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
            state["logprobs"] = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs or [])]
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
