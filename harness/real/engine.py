"""Continuous-batching generation with a KV cache and sample migration (docs/DESIGN.md section 6).

Owns the real generation stage of a PPO iteration: iteration-level scheduling as in Orca (Yu et
al. 2022, section 3.1) -- every :meth:`TorchGenerator.step` admits waiting samples into free
batch slots (up to ``max_batch_size``), prefills them, and advances every running sample by one
token; a sample leaves the batch and is reported the moment it finishes, which is the hook
RLHFuse's inter-stage fusion (section 4) streams finished samples through, and
:meth:`~TorchGenerator.export_unfinished` / :meth:`~TorchGenerator.import_samples` move the
long-tail samples to another engine (RLHFuse section 4.1), with their KV cache or as tokens that
the receiver prefills again.

Output lengths: a sample submitted with ``target_len`` generates exactly that many tokens and
ignores EOS (length-controlled, the usual systems-benchmark practice); otherwise it stops at
``eos_token_id`` (kept in the output) or after ``max_new_tokens``.

Decoding is greedy (``temperature=0``) or sampled at a temperature with optional nucleus (top-p,
Holtzman et al. 2020) truncation. Each sample owns a ``torch.Generator`` seeded from (seed,
sample id) and draws one uniform number per token, so its tokens do not depend on batching,
admission order or migration. Reported log-probs are those of the tempered distribution
(``log_softmax(logits / temperature)``; plain ``log_softmax`` when greedy), before top-p.

The cache (:class:`~harness.real.model.KVCache`) has one slot per batch place and holds keys after
rotary embedding; each step runs at most two forwards, one for decoding samples (one new token
each) and one for samples being prefilled (right-padded). Tiny models on a small shared CPU run
far faster with ``torch.set_num_threads(1)``.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch
from torch import Tensor

from harness.real.model import KVCache, PipelineStage


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128  # EOS mode only
    eos_token_id: int | None = None


@dataclass
class FinishedSample:
    sample_id: Hashable
    prompt_tokens: list[int]
    tokens: list[int]  # generated tokens
    logprobs: list[float]  # one per generated token
    finish_reason: str  # "target" (length-controlled), "eos" or "length" (max_new_tokens)
    step: int  # the engine step it finished in


@dataclass
class MigratedSample:
    """An unfinished sample leaving one engine for another (RLHFuse section 4.1)."""

    sample_id: Hashable
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    target_len: int | None
    max_new_tokens: int
    rng_state: Tensor | None  # the sample's generator state (sampled decoding)
    kv: dict[int, tuple[Tensor, Tensor]] | None = None  # layer -> (kv_heads, n, head_dim) keys, values

    @property
    def kv_len(self) -> int:
        return next(iter(self.kv.values()))[0].shape[1] if self.kv else 0


def sample_seed(seed: int, sample_id: Hashable) -> int:
    """A stable 63-bit seed for one sample (independent of Python's hash randomisation)."""
    digest = hashlib.blake2b(f"{seed}:{sample_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_tokens(logits: Tensor, temperature: float, top_p: float,
                  generators: list[torch.Generator | None]) -> tuple[Tensor, Tensor]:
    """Next tokens (B,) and their log-probs (B,) from last-position ``logits`` (B, V); row ``b``
    draws one uniform number from ``generators[b]`` when sampling (inverse-CDF sampling)."""
    logits = logits.float()
    if temperature <= 0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    logp = (logits / temperature).log_softmax(-1)
    probs, order = logp.exp().sort(dim=-1, descending=True, stable=True)
    if top_p < 1.0:
        keep = (probs.cumsum(-1) - probs) < top_p
        probs = probs * keep
    cdf = probs.double().cumsum(-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(cdf.device)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=cdf.shape[-1] - 1)
    tokens = order.gather(-1, idx)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


@dataclass
class _Sample:
    sample_id: Hashable
    prompt: list[int]
    target_len: int | None
    max_new_tokens: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kv: dict | None = None  # imported cache, loaded on admission
    slot: int = -1
    cached: int = 0  # context tokens held in the KV cache

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


class EngineLoop:
    """The loop every engine shares: step until no sample is left. Engines implement ``has_work``
    and ``step(on_finish)``; both :class:`TorchGenerator` and the vLLM adapter use this one."""

    def run(self, on_finish: Callable[[FinishedSample], None] | None = None) -> list[FinishedSample]:
        """Step until no sample is left; return all finished samples in finish order."""
        done: list[FinishedSample] = []
        while self.has_work:
            done += self.step(on_finish)
        return done

    def steps_to_next_finish(self) -> int:
        """Engine steps from now until the first of them in which some sample finishes, where that
        is known in advance; 1 where it is not (an engine that cannot tell is advanced one step at
        a time)."""
        return 1


class TorchGenerator(EngineLoop):
    """Continuous batching over a :class:`~harness.real.model.LlamaModel` (or a last-and-first
    :class:`~harness.real.model.PipelineStage`) with a slot-based KV cache."""

    def __init__(self, model: PipelineStage, *, max_batch_size: int = 8,
                 sampling: SamplingParams = SamplingParams(), kv_capacity: int = 64):
        if not (model.has_embedding and model.has_head) or model.args.value_head:
            raise ValueError("generation needs a whole model with an LM head")
        self.model, self.max_batch_size, self.sampling = model, max_batch_size, sampling
        self.max_seq_len = model.args.max_seq_len
        self.cache = KVCache(max_batch_size, capacity=kv_capacity)
        self.device = next(model.parameters()).device
        self.waiting: deque[_Sample] = deque()
        self.running: list[_Sample] = []
        self.free_slots = list(range(max_batch_size))
        self.num_steps = 0
        self._ids: set[Hashable] = set()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def steps_to_next_finish(self) -> int:
        """Exact when every sample that the next step runs is length-controlled (``target_len``):
        the next step first admits waiting samples into free slots, then every running sample gains
        one token per step and no slot frees before one of them finishes, so nothing else joins
        until then. 1 when some sample may stop at EOS (or there is no work)."""
        upcoming = self.running + list(itertools.islice(self.waiting, len(self.free_slots)))
        if not upcoming or any(s.target_len is None for s in upcoming):
            return 1
        return max(1, min(s.target_len - len(s.tokens) for s in upcoming))

    def _new_generator(self, sample_id: Hashable, seed: int | None = None) -> torch.Generator | None:
        if self.sampling.temperature <= 0:
            return None
        return torch.Generator().manual_seed(sample_seed(self.sampling.seed, sample_id) if seed is None else seed)

    def _enqueue(self, sample: _Sample) -> None:
        if sample.sample_id in self._ids:
            raise ValueError(f"sample {sample.sample_id!r} is already in this engine")
        if not sample.prompt:
            raise ValueError(f"sample {sample.sample_id!r} has an empty prompt")
        limit = sample.target_len if sample.target_len is not None else sample.max_new_tokens
        if len(sample.prompt) + limit > self.max_seq_len or limit < 1:
            raise ValueError(f"sample {sample.sample_id!r}: prompt {len(sample.prompt)} + output {limit} tokens "
                             f"does not fit max_seq_len={self.max_seq_len}")
        self._ids.add(sample.sample_id)
        self.waiting.append(sample)

    def submit(self, sample_id: Hashable, prompt_tokens: list[int], target_len: int | None = None,
               generator_seed: int | None = None) -> None:
        """Queue a prompt; ``target_len`` makes it length-controlled (EOS ignored). Its sampler is
        seeded with ``generator_seed``, else from the engine's seed and the sample id."""
        prompt = [int(t) for t in prompt_tokens]
        max_new = min(self.sampling.max_new_tokens, self.max_seq_len - len(prompt))
        self._enqueue(_Sample(sample_id, prompt, target_len, max_new, self._new_generator(sample_id, generator_seed)))

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            s = self.waiting.popleft()
            s.slot = self.free_slots.pop(0)
            if s.kv is not None:
                self.cache.load(s.slot, s.kv)
                s.cached, s.kv = int(self.cache.lengths[s.slot]), None
            else:
                self.cache.clear(s.slot)
                s.cached = 0
            self.running.append(s)

    @torch.no_grad()
    def _forward(self, group: list[_Sample]) -> Tensor:
        """Feed each sample's uncached context; return last-position logits (B, V)."""
        chunks = [s.context[s.cached:] for s in group]
        width = max(len(c) for c in chunks)
        tokens = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, c in enumerate(chunks):
            tokens[i, : len(c)] = torch.tensor(c)
            mask[i, : len(c)] = 1
        slots = torch.tensor([s.slot for s in group])
        lengths = mask.sum(1)
        logits = self.model(tokens.to(self.device), attention_mask=mask.to(self.device),
                            cache=self.cache, slots=slots, output_index=lengths - 1)
        self.cache.advance(slots, lengths)
        for s, n in zip(group, lengths.tolist()):
            s.cached += n
        return logits

    def _done(self, s: _Sample) -> str | None:
        n = len(s.tokens)
        if s.target_len is not None:
            return "target" if n >= s.target_len else None
        if self.sampling.eos_token_id is not None and s.tokens[-1] == self.sampling.eos_token_id:
            return "eos"
        return "length" if n >= s.max_new_tokens else None

    def step(self, on_finish: Callable[[FinishedSample], None] | None = None) -> list[FinishedSample]:
        """Admit waiting samples, advance every running one by one token; return (and report to
        ``on_finish``) the samples that finished, in batch order."""
        self._admit()
        if not self.running:
            return []
        self.num_steps += 1
        decode = [s for s in self.running if len(s.context) - s.cached == 1]
        prefill = [s for s in self.running if len(s.context) - s.cached > 1]
        rows = {}
        for group in (decode, prefill):
            if group:
                for s, row in zip(group, self._forward(group)):
                    rows[id(s)] = row
        logits = torch.stack([rows[id(s)] for s in self.running])
        tokens, logprobs = sample_tokens(logits, self.sampling.temperature, self.sampling.top_p,
                                         [s.generator for s in self.running])
        finished, still = [], []
        for s, tok, lp in zip(self.running, tokens.tolist(), logprobs.tolist()):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            reason = self._done(s)
            if reason is None:
                still.append(s)
                continue
            self.free_slots.append(s.slot)
            self.cache.clear(s.slot)
            self._ids.discard(s.sample_id)
            finished.append(FinishedSample(s.sample_id, s.prompt, s.tokens, s.logprobs, reason, self.num_steps))
        self.running = still
        self.free_slots.sort()
        for f in finished:
            if on_finish is not None:
                on_finish(f)
        return finished

    def export_unfinished(self, with_kv: bool = True) -> list[MigratedSample]:
        """Remove every unfinished sample (running, then waiting) and return its state; with
        ``with_kv`` running samples carry copies of their KV cache (all but the last token)."""
        out = []
        states = [(s, True) for s in self.running] + [(s, False) for s in self.waiting]
        for s, running in states:
            kv = s.kv  # a waiting sample may hold an imported cache
            if running:
                kv = self.cache.export(s.slot) if with_kv else None
                self.cache.clear(s.slot)
            rng = s.generator.get_state() if s.generator is not None else None
            out.append(MigratedSample(s.sample_id, list(s.prompt), list(s.tokens), list(s.logprobs),
                                      s.target_len, s.max_new_tokens, rng, kv if with_kv else None))
        self.running, self.waiting, self._ids = [], deque(), set()
        self.free_slots = list(range(self.max_batch_size))
        return out

    def import_samples(self, samples: list[MigratedSample]) -> None:
        """Queue migrated samples; they continue exactly where they left off (a sample without
        KV is prefilled again from its prompt and tokens so far)."""
        for m in samples:
            if m.kv is not None and m.kv_len != len(m.prompt_tokens) + len(m.tokens) - 1:
                raise ValueError(f"sample {m.sample_id!r}: KV cache of {m.kv_len} tokens does not match its context")
            gen = None
            if m.rng_state is not None:
                gen = torch.Generator()
                gen.set_state(m.rng_state)
            elif self.sampling.temperature > 0:
                raise ValueError(f"sample {m.sample_id!r} has no RNG state but this engine samples")
            s = _Sample(m.sample_id, list(m.prompt_tokens), m.target_len, m.max_new_tokens, gen,
                        list(m.tokens), list(m.logprobs), m.kv)
            self._enqueue(s)
