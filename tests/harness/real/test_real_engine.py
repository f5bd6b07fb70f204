"""The continuous-batching engine against a no-cache, full-recompute reference decode."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from harness.real.engine import SamplingParams, TorchGenerator, sample_seed, sample_tokens

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=7)


def reference_decode(model, prompt, sampling, sample_id, target_len=None):
    """One sample, one token at a time, recomputing the whole context every step (no cache)."""
    gen = torch.Generator().manual_seed(sample_seed(sampling.seed, sample_id)) if sampling.temperature > 0 else None
    limit = target_len if target_len is not None else min(sampling.max_new_tokens, model.args.max_seq_len - len(prompt))
    context, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        while len(tokens) < limit:
            logits = model(torch.tensor([context]))[:, -1]
            tok, lp = sample_tokens(logits, sampling.temperature, sampling.top_p, [gen])
            context.append(int(tok))
            tokens.append(int(tok))
            logprobs.append(float(lp))
            if target_len is None and tok == sampling.eos_token_id:
                break
    return tokens, logprobs


def _workload(n=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 16, (n,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (k,), generator=gen).tolist() for k in lengths]
    targets = [int(t) for t in torch.randint(1, 24, (n,), generator=gen)]
    return prompts, targets


def _check_against_reference(model, finished, prompts, targets, sampling):
    assert sorted(f.sample_id for f in finished) == list(range(len(prompts)))
    for f in finished:
        tokens, logprobs = reference_decode(model, prompts[f.sample_id], sampling, f.sample_id, targets[f.sample_id])
        assert f.tokens == tokens, f.sample_id
        assert f.prompt_tokens == prompts[f.sample_id]
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_engine_equals_reference_decode(tiny_model, sampling):
    prompts, targets = _workload()
    engine = TorchGenerator(tiny_model, max_batch_size=3, sampling=sampling, kv_capacity=8)
    for i in range(5):
        engine.submit(i, prompts[i], targets[i])
    finished = engine.step() + engine.step()
    assert engine.num_running == 3 and engine.num_waiting == 2 - len(finished)
    for i in (5, 6):  # admitted mid-flight
        engine.submit(i, prompts[i], targets[i])
    finished += engine.run()
    assert all(f.finish_reason == "target" and len(f.tokens) == targets[f.sample_id] for f in finished)
    _check_against_reference(tiny_model, finished, prompts, targets, sampling)


def test_results_do_not_depend_on_batch_size(tiny_model):
    prompts, targets = _workload(seed=1)
    runs = []
    for batch in (1, 4, 7):
        engine = TorchGenerator(tiny_model, max_batch_size=batch, sampling=SAMPLED)
        for i, (p, t) in enumerate(zip(prompts, targets)):
            engine.submit(i, p, t)
        runs.append({f.sample_id: f.tokens for f in engine.run()})
    assert runs[0] == runs[1] == runs[2]


def test_eos_mode(tiny_model):
    prompts, _ = _workload(n=4, seed=2)
    free = reference_decode(tiny_model, prompts[0], SamplingParams(max_new_tokens=12), 0)[0]
    eos = free[5]  # a token the greedy decode of sample 0 produces
    sampling = SamplingParams(eos_token_id=eos, max_new_tokens=12)
    engine = TorchGenerator(tiny_model, max_batch_size=2, sampling=sampling)
    for i, p in enumerate(prompts):
        engine.submit(i, p)
    engine.submit("fixed", prompts[0], target_len=12)  # length-controlled: EOS ignored
    finished = {f.sample_id: f for f in engine.run()}
    first = finished[0]
    assert first.finish_reason == "eos" and first.tokens == free[: free.index(eos) + 1]
    assert finished["fixed"].tokens == free and finished["fixed"].finish_reason == "target"
    for i, p in enumerate(prompts):
        tokens, _ = reference_decode(tiny_model, p, sampling, i)
        assert finished[i].tokens == tokens
        assert finished[i].finish_reason == ("eos" if tokens[-1] == eos else "length")
        assert finished[i].finish_reason == "eos" or len(tokens) == 12


def test_finish_callbacks_fire_once_in_finish_order(tiny_model):
    prompts, targets = _workload(n=6, seed=3)
    engine = TorchGenerator(tiny_model, max_batch_size=2)
    seen = []
    for i, (p, t) in enumerate(zip(prompts, targets)):
        engine.submit(i, p, t)
    def on_finish(f):
        assert f.step == engine.num_steps  # reported in the step it finished
        seen.append(f)
    returned = engine.run(on_finish=on_finish)
    assert [f.sample_id for f in seen] == [f.sample_id for f in returned]
    assert sorted(f.sample_id for f in seen) == list(range(6))
    steps = [f.step for f in seen]
    assert steps == sorted(steps) and len(set(steps)) > 1
    assert not engine.has_work and engine.step() == []


@pytest.mark.parametrize("with_kv", [True, False], ids=["kv", "tokens"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_migration_continues_exactly(tiny_model, with_kv, sampling):
    prompts, targets = _workload(seed=4)
    targets = [t + 6 for t in targets]
    baseline = TorchGenerator(tiny_model, max_batch_size=4, sampling=sampling)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        baseline.submit(i, p, t)
    expected = {f.sample_id: f for f in baseline.run()}

    source = TorchGenerator(tiny_model, max_batch_size=4, sampling=sampling)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        source.submit(i, p, t)
    finished = source.step() + source.step() + source.step() + source.step()
    migrated = source.export_unfinished(with_kv=with_kv)
    assert not source.has_work and len(migrated) == 7 - len(finished)
    running = [m for m in migrated if m.tokens]
    assert running and any(not m.tokens for m in migrated)  # running and still-waiting samples move
    for m in running:
        assert (m.kv is not None) == with_kv
        assert m.kv is None or m.kv_len == len(m.prompt_tokens) + len(m.tokens) - 1
    target = TorchGenerator(tiny_model, max_batch_size=3, sampling=sampling)
    target.import_samples(migrated)
    finished += target.run()
    assert sorted(f.sample_id for f in finished) == list(range(7))
    for f in finished:
        assert f.tokens == expected[f.sample_id].tokens, f.sample_id
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(expected[f.sample_id].logprobs),
                                   atol=1e-4, rtol=0)


def test_sample_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    tokens, logprobs = sample_tokens(logits, 0.0, 1.0, [None, None])
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])
    gens = [torch.Generator().manual_seed(s) for s in range(2)]
    for _ in range(20):  # top-p small enough keeps only the most likely token
        assert sample_tokens(logits, 1.0, 0.5, gens)[0].tolist() == [1, 0]
    counts = torch.zeros(3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        counts[sample_tokens(logits[:1], 1.0, 1.0, [gen])[0]] += 1
    torch.testing.assert_close(counts / 2000, logits[0].softmax(-1), atol=0.03, rtol=0)


def test_submit_errors(tiny_model):
    engine = TorchGenerator(tiny_model, max_batch_size=2)
    engine.submit("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match="already"):
        engine.submit("a", [1], 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit("b", [1] * 500, 20)
    with pytest.raises(ValueError, match="empty"):
        engine.submit("c", [], 2)


def test_vllm_engine_is_optional():
    import harness.real.vllm_engine as vllm_engine

    assert "vllm" not in sys.modules  # not imported at module import
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    with pytest.raises(vllm_engine.EngineUnavailableError, match="vLLM"):
        vllm_engine.VllmEngine("/nonexistent")


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_steps_to_next_finish_is_exact_for_length_controlled_samples(tiny_model, batch):
    """After ``steps_to_next_finish()`` steps some sample has finished, and in none of the steps
    before (the driver's round length in streamed generation); samples submitted mid-flight count."""
    prompts, targets = _workload(n=7, seed=3)
    engine = TorchGenerator(tiny_model, max_batch_size=batch, sampling=SAMPLED)
    for i in range(5):
        engine.submit(i, prompts[i], targets[i])
    rounds = 0
    while engine.has_work:
        k = engine.steps_to_next_finish()
        assert k >= 1
        for j in range(k):
            finished = engine.step()
            assert bool(finished) == (j == k - 1), (rounds, j, k)
        rounds += 1
        if rounds == 2:
            for i in (5, 6):
                engine.submit(i, prompts[i], targets[i])
    assert rounds <= 7  # one round per distinct finishing step, at most one per sample


def test_steps_to_next_finish_is_one_when_eos_may_end_a_sample(tiny_model):
    prompts, _ = _workload(n=2, seed=4)
    engine = TorchGenerator(tiny_model, max_batch_size=2, sampling=SamplingParams(eos_token_id=3, max_new_tokens=9))
    engine.submit(0, prompts[0], target_len=9)
    assert engine.steps_to_next_finish() == 9
    engine.submit(1, prompts[1])  # EOS-controlled
    assert engine.steps_to_next_finish() == 1
