"""Execution engines: the facts (harness/core/engines.py, the Hydra groups engine/generation and
engine/training under conf/engine/) and the cost model's rules (harness/costmodel/engines.py).

Oracles, not mocks:

- every engine file under conf/engine/ loads and resolves, and composes through Hydra as its group's
  option into the same engine the harness reads from the file (by name or by path);
  ``engine.<kind>=<name>`` is that group choice; malformed engines (unknown keys, unknown names, bad
  batching / kernels / parallelism values) are refused with a ConfigError naming the fault;
- direction of the overrides on one DeepSpeed-Chat setup (the issue's acceptance test): vLLM
  generates faster than the hybrid engine, generate() on ZeRO-3 shards in place slower, ZeRO-Offload
  trains slower;
- ``engine.fitted=false`` resolves every fitted constant to its prior (FITTED_PRIORS); a fitted
  table given as ``engine.constants`` reaches the plan's engines, and doubling the hybrid engine's
  GPU-time factor cannot speed up generation, cannot more than double it, and leaves training untouched;
- identical runs give identical summaries;
- plans an engine cannot run are refused (static batching under long-tail migration; DeepSpeed ZeRO
  under a tensor/pipeline-parallel layout);
- the cost model under engines (``CostModel.with_engines``) against its closed forms (GPU-time
  factor, eager host floor, ZeRO-3 gather floor, KV-cache passes, host syncs, compute factor, eager
  attention-score traffic, CPU-Adam optimizer step recomputed from its docstring), spans equal to
  their steps bit for bit, and the plan memory check against cost-model primitives (ZeRO-Offload's
  freed optimizer states, in-place generation's two gathered layers);
- plans round-trip their engines through to_dict / from_dict / JSON, and plan.json shows the
  generation engine's kernels where it always did (the plan holds them once, in its engines);
- a malformed ``engine.constants`` table is refused, and so is one given with ``engine.fitted=false``;
  a training engine chosen by either spelling of the group choice is checked against the system.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from harness.core import engines as eng
from harness.run.pipeline import compose
from harness.costmodel.engine_fit import Constant, constants_override, with_constants
from harness.costmodel.memory import OFFLOAD_GRAD_BUCKET_PARAMS
from harness.core.engines import (FITTED_PRIORS, Engines, GenerationEngine, TrainingEngine, available,
                                  engine_group_overrides, engine_key_overrides, fitted_table, load_engine,
                                  resolve)
from harness.errors import ConfigError, PlanError
from harness.core.plan import Plan, TaskKind
from harness.planning.simulate import generation_gather_s
from harness.run.pipeline import build_context, make_plan
from harness.cli.replay import simulate_summary

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["logger=none", "logger.progress_bar=false", "backend.num_iterations=1", "backend.num_warmup_iterations=0"]
# One 8-GPU node of DeepSpeed-Chat on LLaMA-7B, 64 samples of at most 256 new tokens: ~0.2 s to plan + simulate.
DSCHAT = ["+system=deepspeed_chat", "model=7b", "cluster=a800_8x", "cluster.num_nodes=1",
          "workload.global_batch_size=64", "workload.mini_batch_size=64", "workload.max_gen_len=256",
          "workload.output_len.max=256", *QUIET]
# RLHFuse with inter-stage fusion and a pinned migration threshold (so the plan migrates the long tail).
RLHFUSE = ["+system=rlhfuse", "model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1",
           "system.fused_search.max_steps=50", "system.migration_frac=0.25", *QUIET]
COLOCATED = ["+system=colocated", "model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", *QUIET]
PRIORS = ["engine.fitted=false"]


def summary(overrides: list[str], constants: dict | None = None) -> dict[str, float]:
    """The summary of a run; ``constants`` (:class:`Constant` -> value) in force as ``engine.constants``."""
    cfg = compose(overrides)
    return simulate_summary(cfg if constants is None else with_constants(cfg, constants))


def planned(overrides: list[str], constants: dict | None = None):
    """(context, plan, memory report) of a composed config, as ``python -m harness`` plans it."""
    cfg = compose(overrides)
    run = OmegaConf.to_object(cfg if constants is None else with_constants(cfg, constants))
    ctx = build_context(run)
    plan, _, memory = make_plan(get_class(run.system.impl)(run.system), ctx)
    return ctx, plan, memory


# ---- 1. engine files ------------------------------------------------------------------------------
ENGINE_FILES = sorted((ROOT / "conf" / "engine").glob("*/*.yaml"))


def test_engine_files_are_the_available_engines():
    assert ENGINE_FILES, "no engine files under conf/engine/"
    assert {p.parent.name for p in ENGINE_FILES} == set(eng.KINDS)
    for kind in eng.KINDS:
        assert available(kind) == sorted(p.stem for p in ENGINE_FILES if p.parent.name == kind)


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_engine_file_loads_and_resolves(path):
    kind, name = path.parent.name, path.stem
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert raw.pop("defaults") == [{"/schema@_here_": f"{kind}_engine"}, "_self_"]  # its group's schema
    engine = load_engine(kind, name)
    assert isinstance(engine, GenerationEngine if kind == "generation" else TrainingEngine)
    assert engine.name == name == raw["name"]
    for key, value in raw.items():  # the file's values, as written
        assert getattr(engine, key) == value, key
    assert load_engine(kind, str(path)) == engine  # by path, the same engine
    for table in (None, fitted_table()):
        resolved = resolve(kind, engine, table)
        for const, prior in FITTED_PRIORS[kind].items():
            value = getattr(resolved, const)
            assert isinstance(value, float) and value > 0
            pinned = raw.get(const)
            if pinned is not None:
                assert value == pinned
            elif table is None:
                assert value == prior


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_engine_composes_through_its_hydra_group_as_the_harness_reads_it(path):
    """``engine/<kind>=<name>`` (and ``engine.<kind>=<name>``, the same choice) composes the engine file
    into ``engine.<kind>`` with its typed schema: the same engine, field for field and type for type
    (a number written as an integer is a number), as the harness's own reader of the file."""
    kind, name = path.parent.name, path.stem
    for choice in (f"engine/{kind}={name}", f"engine.{kind}={name}"):
        composed = OmegaConf.to_object(compose([choice]).engine)
        assert getattr(composed, kind) == load_engine(kind, name), choice
        assert [type(v) for v in vars(getattr(composed, kind)).values()] == \
            [type(v) for v in vars(load_engine(kind, name)).values()]


def test_the_group_choice_is_written_back_as_the_key_the_user_wrote():
    assert engine_group_overrides(["engine.generation=vllm", "engine.training=deepspeed,megatron",
                                   "engine.generation=/x/mine.yaml", "engine.generation=nope",
                                   "engine.generation.kernels=eager", "+system=rlhfuse"]) == [
        "engine/generation=vllm", "engine/training=deepspeed,megatron", "engine.generation=/x/mine.yaml",
        "engine.generation=nope", "engine.generation.kernels=eager", "+system=rlhfuse"]
    assert engine_key_overrides(["engine/generation=vllm", "engine/training=deepspeed", "seed=1"]) == [
        "engine.generation=vllm", "engine.training=deepspeed", "seed=1"]


def test_a_composed_engine_field_can_be_set_on_the_command_line():
    cfg = compose([*DSCHAT, *PRIORS, "engine.generation=hf_generate", "engine.generation.launches_per_layer=74"])
    assert cfg.engine.generation.launches_per_layer == 74 and cfg.engine.generation.name == "hf_generate"
    _, plan, _ = planned([*DSCHAT, *PRIORS, "engine.generation=hf_generate", "engine.generation.launches_per_layer=74"])
    assert plan.engines.generation == resolve("generation", GenerationEngine(
        **{**vars(load_engine("generation", "hf_generate")), "launches_per_layer": 74}), None)
    with pytest.raises(ConfigError, match="launches_per_layer"):  # the engine's own checks still apply
        planned([*DSCHAT, "engine.generation=hf_generate", "engine.generation.kernels=graph"])


def test_every_system_default_engine_exists():
    for system in sorted(p.stem for p in (ROOT / "conf" / "system").glob("*.yaml")):
        cfg = compose([f"+system={system}", *QUIET])
        for kind in eng.KINDS:
            name = cfg.system[f"{kind}_engine"]
            assert name in available(kind), (system, kind, name)


def test_unknown_key_in_an_engine_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("batching: continuous\nkernels: graph\ncuda_graph_bucket: 8\n")
    with pytest.raises(ConfigError, match="cuda_graph_bucket"):
        load_engine("generation", str(path))
    # and through the run config, before any planning
    with pytest.raises(ConfigError, match="cuda_graph_bucket"):
        summary([*DSCHAT, f"engine.generation={path}"])
    train = tmp_path / "train.yaml"
    train.write_text("parallelism: zero\noffload_everything: true\n")
    with pytest.raises(ConfigError, match="offload_everything"):
        load_engine("training", str(train))


def test_an_engine_file_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- static\n- eager\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_engine("generation", str(path))


@pytest.mark.parametrize("kind", eng.KINDS)
def test_unknown_engine_name_lists_the_available_ones(kind):
    with pytest.raises(ConfigError) as info:
        load_engine(kind, "no_such_engine")
    message = str(info.value)
    assert "no_such_engine" in message
    for name in available(kind):
        assert name in message
    with pytest.raises(ConfigError) as info:  # through the run config
        summary([*DSCHAT, f"engine.{kind}=no_such_engine"])
    assert all(name in str(info.value) for name in available(kind))


def test_missing_engine_file_and_bad_kind_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_engine("generation", str(tmp_path / "absent.yaml"))
    with pytest.raises(ValueError, match="kind"):
        load_engine("inference", "vllm")


@pytest.mark.parametrize("fields,message", [
    ({"batching": "dynamic"}, "batching"),
    ({"kernels": "jit"}, "kernels"),
    ({"weights": "somewhere"}, "weights"),
    ({"kernels": "eager"}, "launches_per_layer"),  # eager without its launch count
    ({"kernels": "eager", "launches_per_layer": 0}, "launches_per_layer"),
    ({"kernels": "graph", "launches_per_layer": 6}, "launches_per_layer"),
    ({"batching": "continuous", "pad_to_longest": True}, "static"),
    ({"batching": "continuous", "synced_under_zero3": True}, "static"),
    ({"kv_cache_passes": 0.5}, "kv_cache_passes"),
    ({"kernels": "eager", "launches_per_layer": 9, "host_syncs_per_layer": -1}, "host_syncs_per_layer"),
    ({"host_syncs_per_layer": 1}, "host_syncs_per_layer"),  # a CUDA-graph step has no host syncs
])
def test_bad_generation_engine_values_are_refused(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        GenerationEngine(name="bad", **fields)
    path = tmp_path / "bad.yaml"  # the same through a file
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(fields)))
    with pytest.raises(ConfigError, match=message):
        load_engine("generation", str(path))


def test_bad_training_parallelism_is_refused():
    with pytest.raises(ConfigError, match="parallelism"):
        TrainingEngine(name="bad", parallelism="fsdp")


def test_an_engine_file_equal_to_vllm_runs_as_vllm(tmp_path):
    path = tmp_path / "my_vllm.yaml"
    path.write_text((ROOT / "conf" / "engine" / "generation" / "vllm.yaml").read_text())
    assert summary([*DSCHAT, *PRIORS, f"engine.generation={path}"]) == \
        summary([*DSCHAT, *PRIORS, "engine.generation=vllm"])


# ---- 2. direction of the overrides (the acceptance test) -----------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["priors", "fitted"])
def dschat_by_engine(request):
    fitted = [] if request.param else PRIORS
    runs = {"default": [], "ds_hybrid": ["engine.generation=ds_hybrid"], "vllm": ["engine.generation=vllm"],
            "ds_chat_generate": ["engine.generation=ds_chat_generate"]}
    return {name: summary([*DSCHAT, *fitted, *extra]) for name, extra in runs.items()}


def test_dschat_default_is_its_hybrid_engine(dschat_by_engine):
    assert dschat_by_engine["default"] == dschat_by_engine["ds_hybrid"]


# With the fitted constants only: at the priors an eager engine's host time is its kernel launches
# alone, while a CUDA-graph engine's prior is vLLM's measured host seconds per step, so the priors do
# not order the two.
@pytest.mark.parametrize("dschat_by_engine", [True], ids=["fitted"], indirect=True)
def test_vllm_generates_faster_than_the_hybrid_engine(dschat_by_engine):
    assert dschat_by_engine["vllm"]["timing_s/gen"] < dschat_by_engine["default"]["timing_s/gen"]


def test_generate_on_zero3_shards_in_place_is_slower_than_the_hybrid_engine(dschat_by_engine):
    assert dschat_by_engine["ds_chat_generate"]["timing_s/gen"] > dschat_by_engine["default"]["timing_s/gen"]
    # it generates in place: no reallocation of the actor to a generation layout
    assert "timing_s/realloc" in dschat_by_engine["default"]
    assert dschat_by_engine["ds_chat_generate"].get("timing_s/realloc", 0.0) == 0.0


def test_zero_offload_trains_slower_at_the_priors():
    base = summary([*DSCHAT, *PRIORS, "engine.training=deepspeed"])
    offload = summary([*DSCHAT, *PRIORS, "engine.training=deepspeed_offload"])
    assert base == summary([*DSCHAT, *PRIORS])  # deepspeed is DS-Chat's default
    assert offload["timing_s/train"] > base["timing_s/train"]
    # generation does not see the optimizer
    assert offload["timing_s/gen"] == pytest.approx(base["timing_s/gen"], rel=1e-12, abs=0)


def test_in_place_generation_gathers_the_actor_every_step():
    ctx, plan, _ = planned([*DSCHAT, *PRIORS, "engine.generation=ds_chat_generate"])
    gen = next(t for t in plan.tasks if t.kind == TaskKind.GENERATE)
    actor = plan.task("update_actor")
    assert gen.allocation == actor.allocation and gen.allocation.strategy.zero_stage == 3
    assert all(m.model != "actor" for m in plan.weight_movements)  # no copy of the actor for generation
    cm = ctx.cost_model
    expected = cm.allgather_s(cm.weights_gb(ctx.models.actor, 1, 1) * 1e9, list(gen.allocation.mesh))
    assert expected > 0 and generation_gather_s(ctx, plan) == expected
    ctx, plan, _ = planned([*DSCHAT, *PRIORS])  # the hybrid engine gathers once, into its own layout
    assert generation_gather_s(ctx, plan) == 0.0
    assert [m.model for m in plan.weight_movements] == ["actor"]


# ---- 3. fitted constants -------------------------------------------------------------------------
def _priors_of(engines: Engines) -> None:
    for kind in eng.KINDS:
        for const, prior in FITTED_PRIORS[kind].items():
            assert getattr(getattr(engines, kind), const) == prior, (kind, const)


def test_unfitted_engines_resolve_to_the_priors():
    for extra in ([], ["engine.generation=vllm"], ["engine.generation=ds_chat_generate"],
                  ["engine.training=deepspeed_offload"]):
        _, plan, _ = planned([*DSCHAT, *PRIORS, *extra])
        _priors_of(plan.engines)
    # even with a table of fitted constants given
    _, plan, _ = planned([*DSCHAT, *PRIORS], {Constant("generation/ds_hybrid", "gpu_time_scale"): 2.0,
                                              Constant("training/deepspeed", "cpu_adam_gbps"): 7.0})
    _priors_of(plan.engines)


def test_a_fitted_table_reaches_the_plan_and_scales_generation_only():
    key = Constant("generation/ds_hybrid", "gpu_time_scale")
    _, plan, _ = planned(DSCHAT, {key: 2.0})
    doubled = summary(DSCHAT, {key: 2.0})
    assert plan.engines.generation.name == "ds_hybrid" and plan.engines.generation.gpu_time_scale == 2.0
    assert plan.engines.training.compute_time_scale == FITTED_PRIORS["training"]["compute_time_scale"]
    single = summary(DSCHAT, {key: 1.0})
    assert single == summary([*DSCHAT, *PRIORS])  # a table at the priors is the mechanism model alone
    # the same table given on the command line (as python -m harness.replay --fit gives it)
    assert summary([*DSCHAT, constants_override({key: 2.0})]) == doubled
    # each step is max(GPU x scale, host, gather): doubling the GPU factor cannot speed generation
    # up, nor more than double it; training does not run on the generation engine
    assert single["timing_s/gen"] <= doubled["timing_s/gen"] <= 2 * single["timing_s/gen"] * (1 + 1e-12)
    # and the table is not ignored: this setup's hybrid-engine steps (LLaMA-7B, tp 8, rounds of 64)
    # are GPU-bound (the eager host floor, 32 layers x 6 launches, is below them), so it slows down
    assert doubled["timing_s/gen"] > single["timing_s/gen"]
    # (equal up to rounding: the durations are differences of absolute times, which moved)
    for key_ in ("timing_s/train", "timing_s/update_actor", "timing_s/update_critic"):
        assert doubled[key_] == pytest.approx(single[key_], rel=1e-12, abs=0)


def test_fitted_constants_of_another_engine_do_not_apply():
    other_engine = {Constant("generation/vllm", "gpu_time_scale"): 5.0}
    _, plan, _ = planned(DSCHAT, other_engine)
    other = summary(DSCHAT, other_engine)
    assert plan.engines.generation.gpu_time_scale == 1.0
    assert other == summary([*DSCHAT, *PRIORS])


# ---- 4. determinism ------------------------------------------------------------------------------
def test_identical_runs_give_identical_summaries():
    first, second = summary(DSCHAT), summary(DSCHAT)
    assert first == second
    assert summary([*DSCHAT, "engine.generation=vllm"]) == summary([*DSCHAT, "engine.generation=vllm"])


# ---- 5. compatibility refusals -------------------------------------------------------------------
def test_rlhfuse_migration_needs_continuous_batching():
    _, plan, _ = planned(RLHFUSE)  # its own engine (vLLM-style) migrates the long tail
    assert plan.engines.generation.batching == "continuous" and plan.generation.migration is not None
    with pytest.raises(PlanError, match="continuous-batching") as info:
        planned([*RLHFUSE, "engine.generation=ds_hybrid"])
    assert "ds_hybrid" in str(info.value)


def test_deepspeed_training_refuses_tensor_and_pipeline_parallel_layouts():
    layout = "system.layout=dp2tp2pp2"
    _, plan, _ = planned([*COLOCATED, layout])  # runs on its default Megatron-style engine
    assert plan.engines.training.name == "megatron"
    with pytest.raises(PlanError, match="training engine deepspeed") as info:
        planned([*COLOCATED, layout, "engine.training=deepspeed"])
    assert "dp2tp2pp2" in str(info.value)
    # a data-parallel-only layout runs on it
    _, plan, _ = planned([*COLOCATED, "system.layout=dp8tp1pp1", "workload.global_batch_size=32",
                          "workload.mini_batch_size=16", "engine.training=deepspeed"])
    assert plan.engines.training.name == "deepspeed"


# ---- 6. the cost model under engines: closed forms --------------------------------------------
@pytest.fixture(scope="module")
def ctx():
    return build_context(OmegaConf.to_object(compose([*DSCHAT, *PRIORS])))


def _engines(gen: dict, train: dict) -> Engines:
    """Resolved engines (every fitted constant set: factors 1 and no host seconds unless given)."""
    return Engines(GenerationEngine(name="g", **{"gpu_time_scale": 1.0, "host_time_scale": 1.0,
                                                 "host_s_per_step": 0.0, "reload_s": 0.0,
                                                 "reload_s_per_gb": 0.0, **gen}),
                   TrainingEngine(name="t", **{"compute_time_scale": 1.0, "cpu_adam_gbps": 50.0, **train}))


DECODE_CASES = [(1, 300, 1, 1), (64, 64 * 500, 8, 1), (16, 16 * 700, 2, 2), (256, 256 * 400, 4, 1)]


@pytest.mark.parametrize("batch,context,tp,pp", DECODE_CASES)
def test_gpu_time_scale_multiplies_graph_steps(ctx, batch, context, tp, pp):
    cm, model = ctx.cost_model, ctx.models.actor
    ec = cm.with_engines(_engines({"gpu_time_scale": 3.0}, {}))
    assert ec.decode_step_s(model, batch, context, tp, pp) == \
        pytest.approx(3 * cm.decode_step_s(model, batch, context, tp, pp), rel=1e-12)
    assert ec.prefill_s(model, context, tp, pp, context / batch) == \
        pytest.approx(3 * cm.prefill_s(model, context, tp, pp, context / batch), rel=1e-12)
    assert ec.decode_step_s(model, 0, 0.0, tp, pp) == 0.0 and ec.prefill_s(model, 0, tp, pp) == 0.0
    unit = cm.with_engines(_engines({"gpu_time_scale": 1.0}, {}))  # the prior: the cost model as is
    assert unit.decode_step_s(model, batch, context, tp, pp) == cm.decode_step_s(model, batch, context, tp, pp)


@pytest.mark.parametrize("batch,context,tp,pp", DECODE_CASES)
def test_host_seconds_per_step_add_to_every_graph_step_on_every_gpu(batch, context, tp, pp):
    """A CUDA-graph engine's host time per step is seconds, not a factor: the same seconds on the
    A100's and on the H100's calibrated cost model, added to the scaled GPU time of each decode and
    prefill step; an eager engine's host time is its launches, which host_s_per_step leaves alone."""
    host = 0.0037
    for cluster in ("a100_8x", "h100_8x"):
        cm = build_context(OmegaConf.to_object(compose([*DSCHAT, *PRIORS, f"cluster={cluster}"]))).cost_model
        model = build_context(OmegaConf.to_object(compose([*DSCHAT, *PRIORS]))).models.actor
        ec = cm.with_engines(_engines({"gpu_time_scale": 1.5, "host_s_per_step": host}, {}))
        assert ec.decode_step_s(model, batch, context, tp, pp) == pytest.approx(
            1.5 * cm.decode_step_s(model, batch, context, tp, pp) + host, rel=1e-12)
        assert ec.prefill_s(model, context, tp, pp, context / batch) == pytest.approx(
            1.5 * cm.prefill_s(model, context, tp, pp, context / batch) + host, rel=1e-12)
        eager = {"kernels": "eager", "launches_per_layer": 6, "batching": "static"}
        assert cm.with_engines(_engines({**eager, "host_s_per_step": host}, {})).decode_step_s(
            model, batch, context, tp, pp) == cm.with_engines(_engines(eager, {})).decode_step_s(
            model, batch, context, tp, pp)


@pytest.mark.parametrize("batch,context,tp,pp", DECODE_CASES)
def test_eager_steps_are_floored_by_the_host_and_steps_by_the_gather(ctx, batch, context, tp, pp):
    from harness.costmodel.calibrated import EAGER_HOST_S_PER_LAUNCH

    cm, model = ctx.cost_model, ctx.models.actor
    gpu = cm.decode_step_s(model, batch, context, tp, pp)
    launches = 6
    ec = cm.with_engines(_engines({"gpu_time_scale": 1.5, "host_time_scale": 2.0, "kernels": "eager",
                                   "launches_per_layer": launches, "batching": "static"}, {}))
    host = 2.0 * model.num_layers * launches * EAGER_HOST_S_PER_LAUNCH
    assert ec.decode_step_s(model, batch, context, tp, pp) == pytest.approx(
        max(1.5 * gpu, host), rel=1e-12)
    gather = 10 * max(gpu, host)  # a ZeRO-3 gather longer than the step bounds it
    ec = cm.with_engines(_engines({"gpu_time_scale": 3.0}, {}), gen_gather_s=gather)
    assert ec.decode_step_s(model, batch, context, tp, pp) == gather
    tiny = 1e-12
    ec = cm.with_engines(_engines({"gpu_time_scale": 3.0}, {}), gen_gather_s=tiny)
    assert ec.decode_step_s(model, batch, context, tp, pp) == pytest.approx(3 * gpu, rel=1e-12)


@pytest.mark.parametrize("batch,context,tp,pp", DECODE_CASES)
def test_without_a_kv_cache_a_decode_step_is_a_prefill_of_the_whole_context(ctx, batch, context, tp, pp):
    cm, model = ctx.cost_model, ctx.models.actor
    ec = cm.with_engines(_engines({"gpu_time_scale": 2.0, "kv_cache": False}, {}))
    tokens = context + batch  # every sequence's context and the token being produced
    assert ec.decode_step_s(model, batch, context, tp, pp) == pytest.approx(
        2.0 * cm.prefill_s(model, tokens, tp, pp, tokens / batch), rel=1e-12)
    cached = cm.with_engines(_engines({"gpu_time_scale": 2.0}, {}))
    assert ec.decode_step_s(model, batch, context, tp, pp) > cached.decode_step_s(model, batch, context, tp, pp)


def test_coati_generation_without_kv_cache_is_slower_than_hf_generate():
    """Same plan (DeepSpeed-Chat on ZeRO-3 shards, in place), same kernels and fitted factor
    (coati_generate shares hf_generate's): only the KV cache differs, so generation must be slower."""
    base = [*DSCHAT, "system.zero_stage=3", "system.gen_tp=1"]
    hf = summary([*base, "engine.generation=hf_generate"])["timing_s/gen"]
    coati = summary([*base, "engine.generation=coati_generate"])["timing_s/gen"]
    assert coati > 1.5 * hf
    assert eng.fit_key("generation", load_engine("generation", "coati_generate")) == "generation/hf_generate"


@pytest.mark.parametrize("tp,num_layers,head", [(1, None, None), (2, 16, True), (8, 8, False)])
def test_compute_time_scale_multiplies_forward_and_backward_exactly(ctx, tp, num_layers, head):
    cm, model = ctx.cost_model, ctx.models.actor
    ec = cm.with_engines(_engines({}, {"compute_time_scale": 1.7}))
    args = (model, 4 * 600.0, 600.0, tp, num_layers, head)
    assert ec.forward_s(*args) == cm.forward_s(*args) * 1.7
    assert ec.backward_s(*args) == cm.backward_s(*args) * 1.7
    # everything else is the cost model's
    assert ec.optimizer_step_s(model, 8, tp, 1, 3) == cm.optimizer_step_s(model, 8, tp, 1, 3)
    assert ec.allgather_s(1e9, list(range(8))) == cm.allgather_s(1e9, list(range(8)))
    assert ec.decode_step_s(model, 8, 8 * 300, tp) == cm.decode_step_s(model, 8, 8 * 300, tp)


@pytest.mark.parametrize("tp,num_layers,recompute", [(1, None, "none"), (2, 16, "full"), (8, 8, "selective"),
                                                     (4, None, "full")])
def test_eager_attention_score_traffic_is_its_closed_form(ctx, tp, num_layers, recompute):
    """bytes per score x heads/tp x tokens x seq_len x layers at the streaming rate, inside the compute
    factor; the backward pays the forward's bytes again when it recomputes the attention."""
    cm, model = ctx.cost_model, ctx.models.actor
    fwd_b, bwd_b, scale = 24.0, 30.0, 1.3
    ec = cm.with_engines(_engines({}, {"compute_time_scale": scale, "attention_score_bytes_forward": fwd_b,
                                       "attention_score_bytes_backward": bwd_b}))
    tokens, seq = 4 * 512.0, 512.0
    layers = model.num_layers if num_layers is None else num_layers
    elements = model.num_heads / tp * tokens * seq * layers
    stream = cm.compute.stream_s_per_byte
    args = (model, tokens, seq, tp, num_layers, None)
    assert ec.forward_s(*args) == pytest.approx(scale * (cm.forward_s(*args) + fwd_b * elements * stream),
                                                rel=1e-12)
    bwd_bytes = bwd_b + (fwd_b if recompute != "none" else 0.0)
    assert ec.backward_s(*args, recompute) == pytest.approx(
        scale * (cm.backward_s(*args, recompute) + bwd_bytes * elements * stream), rel=1e-12)
    assert ec.forward_s(model, 0.0, seq, tp) == 0.0


@pytest.mark.parametrize("key", ["attention_score_bytes_forward", "attention_score_bytes_backward"])
@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_bad_attention_score_bytes_are_refused(key, value):
    with pytest.raises(ConfigError, match=key):
        TrainingEngine(name="bad", **{key: value})


def test_eager_attention_trains_slower_and_generates_the_same():
    """DeepSpeed-Chat's OPT runs (replay P001-P029) train with transformers' eager OPT attention: the same
    plan on deepspeed_hf_eager trains and runs ref/reward/critic passes slower, generates identically."""
    opt = [*DSCHAT, "model=opt_1_3b_350m", "cluster=a100_40g_8x", "workload.max_gen_len=256"]
    fused = summary([*opt, "engine.training=deepspeed"])
    eager = summary([*opt, "engine.training=deepspeed_hf_eager"])
    assert eager["timing_s/train"] > fused["timing_s/train"]
    assert eager["timing_s/ref"] > fused["timing_s/ref"]
    assert eager["timing_s/gen"] == fused["timing_s/gen"]
    for name in ("deepspeed_hf_eager", "deepspeed_offload_hf_eager"):  # same kernels: one fitted factor
        assert eng.fit_key("training", load_engine("training", name)) == "training/deepspeed"


@pytest.mark.parametrize("dp,tp,pp,zero", [(8, 1, 1, 3), (4, 2, 1, 1), (2, 1, 1, 2), (16, 1, 1, 3),
                                           (2, 2, 2, 1), (1, 1, 1, 0)])
def test_optimizer_offload_is_the_cpu_adam_step(ctx, dp, tp, pp, zero):
    from harness.costmodel.llama import ModelDims, num_params
    from harness.costmodel.memory import max_stage_params

    cm, model = ctx.cost_model, ctx.models.actor
    gbps = 37.0
    ec = cm.with_engines(_engines({}, {"optimizer_offload": True, "cpu_adam_gbps": gbps}))
    stage_params = num_params(model) if pp == 1 else max_stage_params(ModelDims.of(model), pp)
    params = stage_params / tp / (dp if zero >= 1 else 1)  # one rank's share of the optimizer states
    ranks_per_node = min(dp * tp * pp, cm.gpus_per_node)
    cpu_adam_s = params * ranks_per_node * 28 / (gbps * 1e9)  # fp32 master + 2 Adam moments (+ grads)
    pcie_s = 2 * cm.host_transfer_s(2 * params)  # fp16 gradients down, fp16 parameters up
    assert ec.optimizer_step_s(model, dp, tp, pp, zero) == pytest.approx(cpu_adam_s + pcie_s, rel=1e-12)
    # and it replaces the GPU's step: without offload the cost model's
    plain = cm.with_engines(_engines({}, {"cpu_adam_gbps": gbps}))
    assert plain.optimizer_step_s(model, dp, tp, pp, zero) == cm.optimizer_step_s(model, dp, tp, pp, zero)


def test_zero_offload_frees_the_optimizer_states_and_gradients_on_the_gpus():
    ctx, _, base = planned([*DSCHAT, *PRIORS])
    _, plan, offload = planned([*DSCHAT, *PRIORS, "engine.training=deepspeed_offload"])
    assert plan.engines.training.optimizer_offload
    cm, n = ctx.cost_model, ctx.num_devices
    freed = 0.0
    bucket_gb = OFFLOAD_GRAD_BUCKET_PARAMS * 2 / 1e9
    for role in ("actor", "critic"):  # ZeRO-3: the weights stay, sharded over the dp ranks; the gradient
        model = getattr(ctx.models, role)  # shards follow Adam to the host but for one reduce bucket
        grads_gb = cm.weights_gb(model) / n
        freed += cm.training_state_gb(model, n, 1, 1, 3) - cm.weights_gb(model) / n - min(grads_gb, bucket_gb)
    assert freed > 0
    for task in ("update_actor", "update_critic", "ref"):
        assert base.task_peak_gb[task] - offload.task_peak_gb[task] == pytest.approx(freed, rel=1e-9)


def test_in_place_generation_holds_two_gathered_layers():
    ctx, plan, memory = planned([*DSCHAT, *PRIORS, "engine.generation=ds_chat_generate"])
    cm, models, n, w = ctx.cost_model, ctx.models, ctx.num_devices, ctx.workload
    resident = (cm.training_state_gb(models.actor, n, 1, 1, 3) + cm.training_state_gb(models.critic, n, 1, 1, 3)
                + cm.weights_gb(models.ref) / n + cm.weights_gb(models.reward) / n)
    max_seq = w.prompt_len.max + w.max_gen_len
    gen = resident + 2 * cm.weights_gb(models.actor) / models.actor.num_layers + cm.kv_cache_gb(models.actor, max_seq)
    assert memory.task_peak_gb["gen"] == pytest.approx(gen, rel=1e-9)
    # the hybrid engine holds its own full tp-sharded copy instead
    _, plan, memory = planned([*DSCHAT, *PRIORS])
    tp = plan.task("gen").allocation.strategy.tp
    gen = resident + cm.weights_gb(models.actor, tp) + cm.kv_cache_gb(models.actor, max_seq, tp)
    assert memory.task_peak_gb["gen"] == pytest.approx(gen, rel=1e-9)


# NeMo-RL GRPO on one node: Megatron training dp 8 and vLLM engines of tp 1, the two layouts the same.
NEMO_RL_SAME_LAYOUT = ["+system=nemo_rl", "algo=grpo", "model=7b", "cluster=h100_8x", "cluster.num_nodes=1",
                       "workload.global_batch_size=64", "workload.mini_batch_size=64", "workload.max_gen_len=256",
                       "workload.output_len.max=256", "system.gen_tp=1", "system.train_layout=dp8tp1pp1", *QUIET]
RELOAD = {"reload_s": 2.5, "reload_s_per_gb": 0.125}


def test_a_reloading_engine_refits_at_its_closed_form_even_where_the_layouts_are_the_same():
    """``refit: reload`` (vLLM, as verl and NeMo-RL run it): the actor's refit into generation is a
    task even where the training and generation layouts are the same, lasting ``reload_s +
    reload_s_per_gb x`` the model's bf16 GB on every generation GPU (no bytes move); a ``transfer``
    engine (cuda_graph) has no movement there, as before."""
    constants = {Constant("generation/vllm", k): v for k, v in RELOAD.items()}
    ctx, plan, _ = planned(NEMO_RL_SAME_LAYOUT, constants)
    assert plan.engines.generation.refit == "reload"
    move = plan.movement_of("realloc_actor_gen")
    assert move.source.strategy.dp == move.target.strategy.dp == 8 and move.target.strategy.tp == 1
    weights_gb = ctx.cost_model.weights_gb(ctx.models.actor, 1, 1)
    expected_s = RELOAD["reload_s"] + RELOAD["reload_s_per_gb"] * weights_gb
    assert summary(NEMO_RL_SAME_LAYOUT, constants)["timing_s/realloc"] == pytest.approx(expected_s, rel=1e-9)
    _, plan, _ = planned([*NEMO_RL_SAME_LAYOUT, "engine.generation=cuda_graph"])
    assert plan.engines.generation.refit == "transfer"
    assert not any(t.kind == TaskKind.WEIGHT_MOVEMENT for t in plan.tasks)


def test_a_refit_adds_the_reload_to_the_bytes_transfer_and_only_into_generation():
    """Where bytes move (vLLM engines of tp 1 from a dp 4 tp 2 layout), a reloading engine's refit is the
    transfer engine's movement plus ``refit_reload_s``, on the same devices; a movement that is not the
    actor's refit into generation (the broadcast to a pool of its own) is the bytes' transfer alone."""
    from harness.planning.taskmodels.passes import weight_movement_s

    over = [*NEMO_RL_SAME_LAYOUT, "system.train_layout=dp4tp2pp1"]
    ctx, plan, _ = planned(over, {Constant("generation/vllm", k): v for k, v in RELOAD.items()})
    move, model = plan.movement_of("realloc_actor_gen"), ctx.models.actor
    reloading = ctx.cost_model.with_engines(plan.engines)
    transferring = ctx.cost_model.with_engines(Engines(
        GenerationEngine(**{**plan.engines.generation.__dict__, "refit": "transfer"}), plan.engines.training))
    moved_s, devices = weight_movement_s(transferring, move, model)
    assert moved_s > 0 and len(devices) == 8
    reload_s = reloading.engine_costs.refit_reload_s(model)
    assert reload_s == pytest.approx(RELOAD["reload_s"] + RELOAD["reload_s_per_gb"]
                                     * ctx.cost_model.weights_gb(model, 1, 1), rel=1e-12)
    assert transferring.engine_costs.refit_reload_s(model) == 0.0
    with_reload_s, same_devices = weight_movement_s(reloading, move, model)
    assert with_reload_s == pytest.approx(moved_s + reload_s, rel=1e-12) and same_devices == devices
    broadcast = replace(move, task="param_sync", kind="param_sync")
    assert weight_movement_s(reloading, broadcast, model) == weight_movement_s(transferring, broadcast, model)


# ---- 7. plans carry their engines ----------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["engine.generation=vllm", "engine.training=deepspeed_offload"],
                                   ["engine.generation=ds_chat_generate"]])
def test_plan_round_trips_its_engines(extra):
    _, plan, _ = planned([*DSCHAT, *extra])
    assert plan.engines is not None
    d = plan.to_dict()
    assert d["engines"] == plan.engines.to_dict()
    again = Plan.from_dict(copy.deepcopy(d))
    assert again.engines == plan.engines
    assert again.to_dict() == d
    assert Plan.from_json(plan.to_json()).engines == plan.engines
    assert Engines.from_dict(plan.engines.to_dict()) == plan.engines


def test_plan_without_engines_round_trips():
    _, plan, _ = planned(DSCHAT)
    d = plan.to_dict()
    d["engines"] = None
    assert Plan.from_dict(d).engines is None
    del d["engines"]  # a plan.json written before plans named their engines
    assert Plan.from_dict(d).engines is None


@pytest.mark.parametrize("batch,context,tp,pp", DECODE_CASES)
def test_kv_cache_passes_and_host_syncs_are_their_closed_forms(ctx, batch, context, tp, pp):
    """Each KV-cache pass beyond the first streams the bytes one device holds for one micro-batch at
    the calibrated streaming rate (scaled with the GPU time); each host sync adds one launch of host
    time per layer on top of the step."""
    from harness.costmodel import kv_bytes_per_token
    from harness.costmodel.calibrated import EAGER_HOST_S_PER_LAUNCH
    from harness.costmodel.llama import ModelDims
    cm, model = ctx.cost_model, ctx.models.actor
    d = ModelDims.of(model)
    gpu = cm.decode_step_s(model, batch, context, tp, pp) - cm.compute.graph_step_overhead_s
    kv = kv_bytes_per_token(d) * context / (min(tp, d.num_kv_heads) * min(pp, batch)) * cm.compute.stream_s_per_byte
    graph = cm.with_engines(_engines({"gpu_time_scale": 2.0, "kv_cache_passes": 3.5}, {}))
    assert graph.decode_step_s(model, batch, context, tp, pp) == pytest.approx(
        2.0 * (gpu + 2.5 * kv) + cm.compute.graph_step_overhead_s, rel=1e-12)
    launches, syncs = 40, 2
    eager = cm.with_engines(_engines({"host_time_scale": 1.5, "kernels": "eager", "launches_per_layer": launches,
                                      "batching": "static", "kv_cache_passes": 7, "host_syncs_per_layer": syncs}, {}))
    host_launch = 1.5 * EAGER_HOST_S_PER_LAUNCH
    assert eager.decode_step_s(model, batch, context, tp, pp) == pytest.approx(
        max(gpu + 6 * kv, d.num_layers * launches * host_launch) + d.num_layers * syncs * host_launch, rel=1e-12)


def test_flash_attention_generation_of_openrlhf_is_slower_than_sdpa():
    """Same plan (OpenRLHF without vLLM), same fitted constants (hf_generate_fa2 shares hf_generate's):
    transformers' flash-attention-2 path copies the KV cache twice more per step, launches more kernels
    and syncs with the host, so it cannot generate faster; at the priors and with the fit alike."""
    base = ["+system=openrlhf", "model=7b", "cluster=a800_8x", "cluster.num_nodes=1", "system.split.gen=0",
            "system.split.actor=4", "workload.global_batch_size=64", "workload.mini_batch_size=64",
            "workload.max_gen_len=256", "workload.output_len.max=256", *QUIET]
    for fitted in ([], PRIORS):
        default = summary([*base, *fitted])["timing_s/gen"]  # hf_generate_fa2, derived from split.gen=0
        sdpa = summary([*base, *fitted, "engine.generation=hf_generate"])["timing_s/gen"]
        assert default > 1.05 * sdpa
    assert eng.fit_key("generation", load_engine("generation", "hf_generate_fa2")) == "generation/hf_generate"


@pytest.mark.parametrize("fitted", [False, True], ids=["priors", "fitted"])
@pytest.mark.parametrize("generation", ["ds_hybrid", "vllm", "coati_generate", "ds_chat_generate",
                                        "hf_generate_fa2"])
def test_a_decode_span_under_an_engine_is_its_steps_bit_for_bit(generation, fitted):
    """A decode span under an engine (the cost model's one-pass span, then the engine's step rule;
    or step by step without a KV cache) equals the engine's per-step times, bit for bit: CUDA-graph
    and eager engines, at the priors and with the fitted factors."""
    ctx, plan, _ = planned([*DSCHAT, *([] if fitted else PRIORS), f"engine.generation={generation}"])
    costs = ctx.cost_model.with_engines(plan.engines, generation_gather_s(ctx, plan))
    model = ctx.models.actor
    for batch, tp, pp, num_steps in ((8, 1, 1, 40), (8, 2, 2, 40), (33, 4, 1, 40),
                                     (8, 2, 2, 5), (33, 4, 1, 2)):  # short: step by step
        span = costs.decode_span_s(model, batch, batch * 100, num_steps, tp, pp)
        fresh = ctx.cost_model.with_engines(plan.engines, generation_gather_s(ctx, plan))
        assert span == tuple(fresh.decode_step_s(model, batch, batch * 100 + j * batch, tp, pp)
                             for j in range(num_steps))
        assert all(type(t) is float for t in span)


@pytest.mark.parametrize("generation", ["ds_hybrid", "vllm", "coati_generate", "ds_chat_generate",
                                        "hf_generate_fa2"])
def test_many_decode_steps_at_once_under_an_engine_are_its_steps_bit_for_bit(generation):
    """The cost model's elementwise pass over many steps (mixed batch sizes and contexts, as the
    planners' step schedules ask for them), under an engine, equals the engine's steps one by one,
    bit for bit; an engine without a KV cache has no such pass (None: its caller times spans)."""
    ctx, plan, _ = planned([*DSCHAT, f"engine.generation={generation}"])
    costs = ctx.cost_model.with_engines(plan.engines, generation_gather_s(ctx, plan))
    model = ctx.models.actor
    rng = np.random.default_rng(0)
    batch_sizes = rng.integers(1, 70, size=200)
    contexts = batch_sizes * rng.integers(1, 900, size=200) + rng.integers(0, 50, size=200)
    for tp, pp in ((1, 1), (2, 2), (4, 1)):
        steps = costs.decode_steps_s(model, batch_sizes, contexts, tp, pp)
        if not plan.engines.generation.kv_cache:
            assert steps is None
            continue
        fresh = ctx.cost_model.with_engines(plan.engines, generation_gather_s(ctx, plan))
        assert steps.tolist() == [fresh.decode_step_s(model, int(b), int(c), tp, pp)
                                  for b, c in zip(batch_sizes, contexts)]


def test_with_engines_is_a_view_of_the_same_cost_model(ctx):
    """The cost model under engines shares the plain one's configs and memo, times memory, links and
    collectives as it does, and is built from the plain one again when asked twice."""
    cm, model = ctx.cost_model, ctx.models.actor
    engines = _engines({"gpu_time_scale": 2.0}, {"compute_time_scale": 3.0})
    view = cm.with_engines(engines)
    assert cm.engine_costs is None and view.engine_costs.base is cm
    assert view.weights_gb(model, 2) == cm.weights_gb(model, 2)
    assert view.allgather_s(1e9, list(range(8))) == cm.allgather_s(1e9, list(range(8)))
    again = view.with_engines(engines)
    assert again.engine_costs.base is cm
    assert again.forward_s(model, 1024.0, 512.0) == view.forward_s(model, 1024.0, 512.0) == \
        3.0 * cm.forward_s(model, 1024.0, 512.0)


# ---- 8. the selection: a table of constants, refusals by option, plan.json -----------------------
@pytest.mark.parametrize("table,fault", [("[1, 2]", "maps kind/fit_key"),
                                         ("{generation/vllm:{gpu_time_scael:2.0}}", "generation/vllm"),
                                         ("{inference/vllm:{gpu_time_scale:2.0}}", "inference/vllm"),
                                         ("{generation/vllm:{gpu_time_scale:fast}}", "generation/vllm")])
def test_a_malformed_table_of_constants_is_refused(table, fault):
    with pytest.raises(ConfigError, match=fault):
        planned([*DSCHAT, f"engine.constants={table}"])


def test_constants_without_fitted_constants_are_refused_and_engine_choices_are_checked_by_group_too():
    from harness.core.option_effects import check_option_effects
    from harness.errors import OverrideError

    option = constants_override({Constant("generation/ds_hybrid", "gpu_time_scale"): 2.0})
    refusal = r"^engine\.constants\.generation/ds_hybrid\.gpu_time_scale=2 has no effect with engine\.fitted=false"
    with pytest.raises(OverrideError, match=refusal):
        check_option_effects(compose([*DSCHAT, *PRIORS, option]), [*DSCHAT, *PRIORS, option])
    for choice in ("engine.training=megatron", "engine/training=megatron"):  # either spelling of the choice
        with pytest.raises(OverrideError, match=r"^engine\.training=megatron does not apply to deepspeed_chat's"):
            check_option_effects(compose(["+system=deepspeed_chat", choice]), ["+system=deepspeed_chat", choice])


@pytest.mark.parametrize("generation,kernels,launches", [("ds_hybrid", "eager", 6), ("vllm", "graph", None),
                                                         ("hf_generate_fa2", "eager", 51)])
def test_plan_json_shows_the_engines_kernels_where_it_always_did(generation, kernels, launches):
    """The plan holds the generation engine's kernels once (its engines); plan.json's ``generation``
    still shows them, in its fixed order, read from there; an engine that allocates its KV cache on
    demand (vLLM) adds that after them."""
    _, plan, _ = planned([*DSCHAT, f"engine.generation={generation}"])
    assert not hasattr(plan.generation, "engine") and not hasattr(plan.generation, "eager_launches_per_layer")
    shown = plan.to_dict()["generation"]
    on_demand = ["kv_allocation"] if generation == "vllm" else []
    assert list(shown) == ["batching", "max_batch_size", "migration", "engine", "eager_launches_per_layer",
                           "synced_instances", "pad_to_longest", *on_demand]
    assert (shown["engine"], shown["eager_launches_per_layer"]) == (kernels, launches)
    assert Plan.from_json(plan.to_json()) == plan
