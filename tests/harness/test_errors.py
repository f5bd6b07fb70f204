"""Friendly errors: bad input ends with ONE line on stderr and a clear exit code.

- an unknown key, in any config group or at the top level, or a misspelt group option: one line
  ``error: unknown key|option ... (did you mean ...?)``, exit 2, nothing written; in a sweep
  (``-m``) before any job starts;
- degenerate batch sizes (zero, negative, micro > mini > global): one line, exit 2, nothing written;
- cluster-dependent system defaults are derived: every system runs ``model=tiny workload=tiny`` on
  4 devices with no per-system override of its batch sizes (a placement with more pools than 4
  devices, OpenRLHF's, is given a split that fits: :data:`FOUR_DEVICE_PLACEMENTS`).

A sweep with a failing job (exit 1, a table of this sweep's failures only) is tests/harness/test_sweep.py's.
Exit codes and stderr are checked through the command's entry point in this process (the
``refused_in_process`` fixture); the
messages for every config group are checked with
:func:`harness.checks.command_line.check_command_line`.
"""
from __future__ import annotations

import json

import pytest

from harness.system import discover_systems
from harness.errors import ConfigError, OverrideError, PlanError
from harness.checks.command_line import check_command_line

TINY_4 = ["model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=4"]
# Placements whose default needs more devices than 4: OpenRLHF's ref:reward:actor:critic:vLLM =
# 1:1:2:2:2 is 8 units of whole GPUs; on 4, one GPU per model and no vLLM pool (its "ray" mode).
FOUR_DEVICE_PLACEMENTS = {"openrlhf": ["system.split.actor=1", "system.split.critic=1", "system.split.gen=0"]}


# ---- unknown keys and options: the exit code ---------------------------------------------------------

def test_unknown_key_is_one_line_with_suggestion(refused_in_process):
    line = refused_in_process("+system=rlhfuse", "model=13b", "system.migraton_frac=0.1")
    assert line.startswith("error: unknown key system.migraton_frac (did you mean system.migration_frac"), line


def test_misspelt_group_option_is_one_line_with_suggestion(refused_in_process):
    line = refused_in_process("+system=rlhfuse_base", "model=13bb")
    assert line.startswith("error: unknown option model=13bb (did you mean model=13b"), line


def test_sweep_with_unknown_key_is_refused_before_any_job(refused_in_process):
    # multirun.yaml, run folders, failures.jsonl: nothing is written (refused_in_process checks results_dir)
    line = refused_in_process("-m", "+system=rlhfuse_base", "model=7b,13b", "workload.mini_bach_size=4")
    assert line.startswith("error: unknown key workload.mini_bach_size (did you mean workload.mini_batch_size"), line


# ---- unknown keys and options: the message for every group, in-process --------------------------------

UNKNOWN = {  # id: (command line, the message starts with)
    "system": (["+system=rlhfuse", "system.migraton_frac=0.1"],
               "unknown key system.migraton_frac (did you mean system.migration_frac"),
    "system_added": (["+system=rlhfuse", "+system.migraton_frac=0.1"],  # Hydra accepts it; the run would ignore it
                     "unknown key system.migraton_frac (did you mean system.migration_frac"),
    "model": (["+system=rlhfuse_base", "model.actor.num_layer=2"],
              "unknown key model.actor.num_layer (did you mean model.actor.num_layers"),
    "model_role": (["+system=rlhfuse_base", "model.actr.num_layers=2"],
                   "unknown key model.actr.num_layers (did you mean model.actor.num_layers"),
    "cluster": (["+system=rlhfuse_base", "cluster.num_node=1"],
                "unknown key cluster.num_node (did you mean cluster.num_nodes"),
    "workload": (["+system=rlhfuse_base", "workload.prompt_len.medain=9"],
                 "unknown key workload.prompt_len.medain (did you mean workload.prompt_len.median"),
    "backend": (["+system=rlhfuse_base", "backend.num_iteration=1"],
                "unknown key backend.num_iteration (did you mean backend.num_iterations"),
    "backend_options": (["+system=rlhfuse_base", "backend=ray", "backend.options.zero3_imp=native"],
                        "unknown key backend.options.zero3_imp (did you mean backend.options.zero3_impl"),
    "logger": (["+system=rlhfuse_base", "logger.progess_bar=false"],
               "unknown key logger.progess_bar (did you mean logger.progress_bar"),
    "top_level": (["+system=rlhfuse_base", "seeed=1"], "unknown key seeed (did you mean seed"),
    # results_dir holds a path, not keys: the rest of the path is not carried into the suggestion
    "below_a_value": (["+system=rlhfuse_base", "results.root=/x"], "unknown key results.root (did you mean results_dir?)"),
    "top_level_group": (["+sytem=rlhfuse_base"], "unknown key sytem (did you mean system"),
    "option_cluster": (["+system=rlhfuse_base", "cluster=h100"],
                       "unknown option cluster=h100 (did you mean cluster=h100_8x"),
    "option_system": (["+system=rlhfuse_bse"], "unknown option +system=rlhfuse_bse (did you mean +system=rlhfuse_base"),
    "option_role": (["+system=rlhfuse_base", "llama@model.critic=33bb"],
                    "unknown option llama@model.critic=33bb (did you mean llama@model.critic=33b"),
    "option_no_match": (["+system=nope"], "unknown option +system=nope (options of system: areal, colocated, deepspeed_chat"),
    "wrong_type": (["+system=rlhfuse", "system.migration_frac=abc"], "system.migration_frac=abc: Value 'abc'"),
    "sweep_later_value": (["-m", "+system=rlhfuse_base", "model=13b,13bb"],
                          "unknown option model=13bb (did you mean model=13b"),
    # Hydra composes a sweep before choosing the swept system: system.* must be a sweep itself
    "sweep_key_in_swept_group": (["-m", "+system=rlhfuse,rlhfuse_base", "system.migration_frac=0.1"],
                                 "system.migration_frac=0.1 cannot be set while system is swept"),
    "sweep_key_of_one_system": (["-m", "+system=rlhfuse,rlhfuse_base", "system.migration_frac=choice(0.1)"],
                                "unknown key system.migration_frac (keys of system: "),
}


@pytest.mark.parametrize("case", list(UNKNOWN))
def test_unknown_key_or_option_message(case):
    argv, start = UNKNOWN[case]
    with pytest.raises(OverrideError) as err:
        check_command_line(argv)
    message = str(err.value)
    assert message.startswith(start), message
    assert "\n" not in message


@pytest.mark.parametrize("argv", [["+system=rlhfuse", "model=13b", "system.migration_frac=0.1"],
                                  ["-m", "+system=rlhfuse,rlhfuse_base", "model=7b,13b", "cluster.num_nodes=1,2"],
                                  ["+experiment=fig9_migration"]])
def test_valid_command_lines_pass(argv):
    check_command_line(argv)


# ---- degenerate batch sizes --------------------------------------------------------------------------

def test_zero_global_batch_is_refused(refused_in_process):
    line = refused_in_process("+system=rlhfuse_base", "model=7b", "workload.global_batch_size=0")
    assert line == "error: workload.global_batch_size=0 must be a positive number of samples"


DEGENERATE = {  # id: (overrides, error type, message pattern)
    "mini_zero": (["workload.mini_batch_size=0"], ConfigError, r"workload\.mini_batch_size=0 must be a positive"),
    "micro_negative": (["workload.micro_batch_size=-1"], ConfigError,
                       r"workload\.micro_batch_size=-1 must be a positive"),
    "micro_above_mini": (["workload.micro_batch_size=8"], ConfigError,
                         r"workload\.micro_batch_size=8 is larger than workload\.mini_batch_size=4"),
    "mini_above_global": (["workload.mini_batch_size=16"], ConfigError,
                          r"workload\.mini_batch_size=16 is larger than workload\.global_batch_size=8"),
    "system_mini_zero": (["system.mini_batch_size=0"], ConfigError, r"system\.mini_batch_size=0 must be a positive"),
    "system_gen_negative": (["system.generation_batch_size=-8"], ConfigError,
                            r"system\.generation_batch_size=-8 must be a positive"),
    "system_mini_above_global": (["system.mini_batch_size=16"], PlanError,
                                 r"system\.mini_batch_size=16 is larger than the global batch"),
}


@pytest.mark.parametrize("case", list(DEGENERATE))
def test_degenerate_batch_sizes_are_refused(case):
    from harness.testing import plan_for

    overrides, error, pattern = DEGENERATE[case]
    with pytest.raises(error, match=pattern):
        plan_for(["+system=deepspeed_chat", *TINY_4, *overrides])


def test_system_batch_sizes_of_any_system_must_be_positive():
    from harness.run.pipeline import compose
    from harness.checks.command_line import check_batch_sizes

    with pytest.raises(ConfigError, match=r"system\.max_gen_batch_size=0 must be a positive"):
        check_batch_sizes(compose(["+system=rlhfuse_base", "system.max_gen_batch_size=0"]))
    check_batch_sizes(compose(["+system=deepspeed_chat"]))  # null = derived: fine


# ---- derived defaults: every system runs tiny on 4 devices ------------------------------------------

def test_deepspeed_chat_mini_batch_rule():
    from harness.run.pipeline import compose
    from harness.core.config import WorkloadConfig
    from omegaconf import OmegaConf

    from baselines.deepspeed_chat import derived_mini_batch_size, per_device_micro_batch_size

    hh = OmegaConf.to_object(compose([]).workload)
    tiny = OmegaConf.to_object(compose(["workload=tiny"]).workload)
    assert isinstance(hh, WorkloadConfig)
    assert derived_mini_batch_size(256, hh) == 256  # the RLHFuse testbed: RLHFuse section 7's 256 (Figure 7)
    assert derived_mini_batch_size(8, hh) == 64  # one node: the workload's own mini-batch
    # tiny (mini-batch 4, micro-batch 2): the workload's own mini-batch up to 4 devices,
    # in micro-batches of 2 per device, or of 1 (one sample per GPU) on 4
    assert [derived_mini_batch_size(n, tiny) for n in (1, 2, 4, 8)] == [4, 4, 4, 8]
    assert [per_device_micro_batch_size(4, n, tiny) for n in (1, 2, 4)] == [2, 2, 1]
    assert per_device_micro_batch_size(8, 8, tiny) == 1
    assert per_device_micro_batch_size(256, 256, hh) == 1
    with pytest.raises(PlanError, match=r"workload\.global_batch_size=8 must be a multiple of 6"):
        derived_mini_batch_size(6, tiny)


@pytest.mark.parametrize("system", sorted(discover_systems()))
def test_every_system_runs_tiny_on_four_devices(system, tmp_path):
    from harness.run.pipeline import compose
    from harness.run.pipeline import execute

    cfg = compose([f"+system={system}", *TINY_4, *FOUR_DEVICE_PLACEMENTS.get(system, []), "logger=none",
                   "logger.progress_bar=false", "backend.num_iterations=1", "backend.num_warmup_iterations=0",
                   f"results_dir={tmp_path}"])
    outcome = execute(cfg, [])
    assert outcome.summary["perf/samples_per_s"] > 0
    plan = json.loads((outcome.path / "plan.json").read_text())
    assert plan["mini_batch_size"] >= 4 and 8 % plan["mini_batch_size"] == 0
