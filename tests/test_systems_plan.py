"""Every system plans the model presets on the default cluster (32 x 8 H100s), as ``python -m
harness`` plans (:func:`harness.testing.plan_for`: the plan, its IR, tensor parallelism and the
memory check):

- :data:`CASES`, which must plan as they are (searches with small step budgets): the plan has the
  PPO tasks, uses every device and round-trips through JSON;
- every system's defaults at every model of the paper's setup (:data:`PAPER_MODELS`): they plan, or
  the refusal names the ``system.*`` (or ``workload.*``) overrides that make them plan (applied, they must). A command
  that :data:`CASES` already plans (the same command: no budget of its own) is not planned again.

Systems that search (disaggregated's split, ReaLHF's annealing, RLHFuse's fused schedule: 3-8 s a
case on 2 cores) are marked slow at their defaults.
"""
import re

import pytest

from harness.core.plan import Plan
from harness.errors import HarnessError
from harness.system import discover_systems
from harness.testing import plan_for

MODELS = ["tiny", "tiny2", "7b", "13b", "33b", "65b", "70b", "13b_33b", "33b_13b", "33b_65b", "65b_33b"]
PAPER_PAIRS = ["13b_33b", "33b_13b", "33b_65b", "65b_33b"]
PAPER_MODELS = ["13b", "33b", "65b", *PAPER_PAIRS]  # conf/model: the paper's setup
# Searches get small deterministic budgets here; their quality is checked in their own tests.
FAST = {"realhf": ["system.max_steps=5"],
        "rlhfuse": ["system.fused_search.max_steps=50", "system.migration_frac=0.2"],
        "disaggregated": ["system.gen_nodes=8"]}  # the split search has its own tests
CASES = [(s, m) for s in ("deepspeed_chat", "rlhfuse_base", "realhf_heuristic", "realhf") for m in MODELS] + \
        [("rlhfuse", m) for m in ["tiny", "13b", *PAPER_PAIRS]] + \
        [(s, m) for s in ("interleaved", "disaggregated") for m in ["13b", *PAPER_PAIRS]]
SEARCHING = {"disaggregated", "realhf", "rlhfuse"}
OVERRIDE = re.compile(r"\b(?:system|workload)\.[a-z0-9_.]+=[^\s,;]+")


def check_plan(plan: Plan, ctx) -> None:
    assert {t.name for t in plan.tasks} >= {"gen", "ref", "reward", "values", "update_actor", "update_critic"}
    assert plan.devices() == list(range(ctx.num_devices))
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


@pytest.mark.parametrize(("system", "model"), CASES)
def test_system_plans_model_on_default_cluster(system, model):
    # tiny's 512-token context cannot hold hh_rlhf's prompts and answers: its own lengths, the
    # default batch sizes (256 devices)
    workload = (["workload=tiny", "workload.global_batch_size=512", "workload.mini_batch_size=64"]
                if model.startswith("tiny") else [])
    plan, ctx, _ = plan_for([f"+system={system}", f"model={model}", *workload, *FAST.get(system, [])])
    check_plan(plan, ctx)


def _check_defaults_or_named_fix(system: str, model: str) -> None:
    command = [f"+system={system}", f"model={model}"]
    try:
        check_plan(*plan_for(command)[:2])
        return
    except HarnessError as e:
        message = str(e)
    fix = [o.rstrip(".") for o in OVERRIDE.findall(message)]
    assert fix, f"+system={system} model={model} is refused without naming a fix: {message}"
    check_plan(*plan_for(command + fix)[:2])  # the named overrides make it run


def _default_cases(searching: bool) -> list[tuple[str, str]]:
    planned_as_they_are = {case for case in CASES if case[0] not in FAST}  # the same command in CASES
    return [(s, m) for s in discover_systems() if (s in SEARCHING) == searching for m in PAPER_MODELS
            if (s, m) not in planned_as_they_are]


@pytest.mark.parametrize(("system", "model"), _default_cases(searching=False))
def test_defaults_run_or_the_refusal_names_the_fix(system, model):
    _check_defaults_or_named_fix(system, model)


@pytest.mark.slow
@pytest.mark.parametrize(("system", "model"), _default_cases(searching=True))
def test_searching_systems_defaults_run_or_the_refusal_names_the_fix(system, model):
    _check_defaults_or_named_fix(system, model)


def test_openrlhf_names_the_fewest_options_that_fit():
    with pytest.raises(HarnessError) as refused:
        plan_for(["+system=openrlhf", "model=65b_33b"])
    message = str(refused.value)
    assert "does not fit in device memory" in message
    assert message.endswith("With OpenRLHF's own options, system.vllm_tp=2 system.zero_stage=3 makes it fit.")
    with pytest.raises(HarnessError, match=r"With OpenRLHF's own options, system.zero_stage=3 makes it fit\.$"):
        plan_for(["+system=openrlhf", "model=33b"])


TINY_ONE_NODE = ["model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=4"]


@pytest.mark.parametrize(("system", "extra", "mini_batch_size"), [
    ("deepspeed_chat", ["system.mini_batch_size=8", "system.generation_batch_size=8"], 8),
    ("rlhfuse_base", [], 4),  # the workload's
])
def test_tiny_models_plan_on_one_node(system, extra, mini_batch_size):
    """Every sample of a mini-batch is trained once per mini-batch (micro-batches x micro-batch
    size x data-parallel replicas), and the mini-batches make up the global batch."""
    plan, ctx, _ = plan_for([f"+system={system}", *TINY_ONE_NODE, *extra])
    assert plan.devices() == [0, 1, 2, 3]
    assert plan.mini_batch_size == mini_batch_size
    assert {stage.tasks for stage in plan.training} == {("update_actor",), ("update_critic",)}
    for stage in plan.training:
        dp = plan.task(stage.tasks[0]).allocation.strategy.dp
        assert stage.num_minibatches * plan.mini_batch_size == ctx.workload.global_batch_size
        for pipe in stage.schedule.pipes.values():
            assert pipe.num_mbs * stage.micro_batch_size * dp == plan.mini_batch_size
    if system == "deepspeed_chat":
        assert plan.generation.max_batch_size == 8


def test_role_override_changes_one_model():
    _, ctx, _ = plan_for(["+system=deepspeed_chat", "model=13b", "llama@model.critic=33b"])
    assert ctx.models.actor.name == "13b" and ctx.models.critic.name == "33b"
    assert ctx.models.critic.value_head and not ctx.models.actor.value_head
