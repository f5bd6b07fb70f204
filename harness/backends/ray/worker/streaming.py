"""Worker side of RLHFuse's inter-stage fusion (section 4): generation that the driver advances in
short rounds, reports finished samples as they finish, and whose long tail migrates to other
instances with its KV cache sent over point-to-point collectives.

A :class:`GenerationSession` lives on every device of one generation instance (tp ranks step in
lockstep; tp rank 0 reports) between the ``OpenSession`` and ``CloseSession`` requests
(:mod:`harness.backends.ray.protocol`):

- :meth:`submit`: adds samples to the open session (continuous rollout's launches);
- :meth:`steps`: up to ``max_steps`` engine steps (continuous batching); returns the samples that
  finished, each with the wall-clock time it finished, how many are left, and how many steps
  until the next one finishes (exact for length-controlled samples: the driver's round length);
- :meth:`export`: removes every unfinished sample; the small per-sample state (tokens, log-probs,
  RNG state) goes to the driver, the KV cache shard stays here until :func:`migrate` sends it;
- :func:`migrate`: every source and destination device of a migration runs it at once; each KV
  shard goes from tp rank ``t`` of the source instance to tp rank ``t`` of the destination in one
  ``batch_isend_irecv`` exchange (:func:`harness.real.parallel.comm.exchange`), and destinations
  import the samples, which continue exactly where they stopped (or, for ``transfer=tokens``,
  are prefilled again from their tokens).
"""
from __future__ import annotations

import time

import torch

from harness.backends.ray.protocol import ExportedSample, Migrate, OpenSession, Submit
from harness.backends.ray.replies import Exported, FinishedSample, SessionProgress, SpanT
from harness.backends.ray.worker.passes import make_engine
from harness.real.engine import MigratedSample, SamplingParams
from harness.real.parallel.comm import exchange
from harness.real.parallel.replica import Replica


class GenerationSession:
    def __init__(self, replica: Replica, p: OpenSession):
        self.replica = replica
        self.reports = replica.coord[2] == 0
        sampling = SamplingParams(temperature=p.temperature, seed=p.sampling_seed)
        ids = [int(i) for i in p.sample_ids]
        # slots for the instance's own samples and for any migrated to it later
        self.engine = make_engine(replica, max_batch_size=max(1, int(p.max_batch_size)), sampling=sampling,
                                  kv_capacity=int(p.kv_capacity))
        for i in ids:
            self.engine.submit(i, p.prompts[i], target_len=int(p.target_lens[i]))
        self.exported: list[MigratedSample] = []

    def submit(self, p: Submit) -> SessionProgress:
        for i, prompt, target, seed in zip(p.sample_ids, p.prompts, p.target_lens, p.generator_seeds):
            self.engine.submit(int(i), prompt, target_len=int(target), generator_seed=int(seed))
        return self.progress([])

    def steps(self, max_steps: int) -> tuple[list[SpanT], SessionProgress]:
        finished = []
        t0 = time.time()
        with torch.no_grad(), self.replica.compute():
            self.replica.set_train(False)
            for _ in range(max_steps):
                if not self.engine.has_work:
                    break
                for f in self.engine.step():
                    finished.append(FinishedSample(f.sample_id, f.tokens, f.logprobs, time.time()))
        spans = [("decode", t0, time.time(), 0.0, 0.0)] if finished or self.engine.has_work else []
        return spans, self.progress(finished)

    def progress(self, finished: list[FinishedSample]) -> SessionProgress:
        """The session now, with the samples that just finished (reported by tp rank 0 only)."""
        return SessionProgress(finished if self.reports else [], self.engine.num_running + self.engine.num_waiting,
                               self.engine.steps_to_next_finish(), self.engine.num_steps)

    def export(self, with_kv: bool) -> Exported:
        self.exported = self.engine.export_unfinished(with_kv=with_kv)
        meta = [ExportedSample(m.sample_id, m.prompt_tokens, m.tokens, m.logprobs, m.target_len, m.max_new_tokens,
                               m.rng_state.tolist() if m.rng_state is not None else None)
                for m in self.exported]
        shapes = {m.sample_id: {layer: list(k.shape) for layer, (k, _) in (m.kv or {}).items()} for m in self.exported}
        return Exported(meta if self.reports else None, shapes)


def _flat_kv(m: MigratedSample) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for layer in sorted(m.kv) for t in m.kv[layer]])


def _unflat_kv(buf: torch.Tensor, shapes: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    out, pos = {}, 0
    for layer in sorted(shapes, key=int):
        shape = shapes[layer]
        n = int(torch.tensor(shape).prod())
        k = buf[pos:pos + n].reshape(shape)
        v = buf[pos + n:pos + 2 * n].reshape(shape)
        out[int(layer)] = (k, v)
        pos += 2 * n
    return out


def migrate(rank: int, session: GenerationSession | None, p: Migrate, device,
            dtype: torch.dtype = torch.float32) -> list[SpanT]:
    """Send this device's exported KV shards and/or receive and import the samples moved here.

    ``p.moves``: one :class:`~harness.backends.ray.protocol.KvMove` per (sample, tp rank);
    ``p.with_kv`` says whether KV travels."""
    t0 = time.time()
    sends, recv_numel, incoming = {}, {}, {}
    by_id = {m.sample_id: m for m in (session.exported if session is not None else [])}
    for move in p.moves:
        numel = 2 * sum(int(torch.tensor(s).prod()) for s in move.kv_shapes.values()) if p.with_kv else 0
        if move.src == rank and numel:
            sends.setdefault(move.dst, []).append(_flat_kv(by_id[move.sample.sample_id]))
        if move.dst == rank:
            incoming.setdefault(move.src, []).append((move, numel))
            recv_numel[move.src] = recv_numel.get(move.src, 0) + numel
    # KV caches travel in the model's dtype (bf16 on CUDA)
    flat_sends = {dst: torch.cat(parts).to(dtype) for dst, parts in sends.items()}
    received = exchange(rank, flat_sends, {s: n for s, n in recv_numel.items() if n}, dtype, device)
    if session is not None:
        samples = []
        for src, moves in sorted(incoming.items()):
            pos = 0
            for move, numel in moves:
                kv = _unflat_kv(received[src][pos:pos + numel], move.kv_shapes) if numel else None
                pos += numel
                s = move.sample
                rng = torch.tensor(s.rng_state, dtype=torch.uint8) if s.rng_state is not None else None
                samples.append(MigratedSample(s.sample_id, s.prompt, s.tokens, s.logprobs, s.target_len,
                                              s.max_new_tokens, rng, kv))
        if samples:
            session.engine.import_samples(samples)
        session.exported = []
    return [("migrate", t0, time.time(), 0.0, float(sum(t.numel() * t.element_size() for t in flat_sends.values())))]
