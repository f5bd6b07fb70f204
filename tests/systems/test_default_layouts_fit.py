"""Every system's defaults run at every model pair of the paper's setup (the default cluster,
32 x 8 H100s), or its refusal names the ``system.*`` overrides that make it run.

Each case plans as the runner does (:func:`harness.run.runner.make_plan`: the plan, its IR, tensor
parallelism and the memory check). A refusal must name overrides; applied, they must plan. Systems
that search (disaggregated's split, ReaLHF's annealing, RLHFuse's fused schedule: 3-8 s a case on
2 cores) are marked slow; the rest take about 30 s together.
"""
from __future__ import annotations

import re

import pytest
from hydra.utils import get_class

from harness.system import discover_systems
from harness.errors import HarnessError
from harness.run.runner import build_context, make_plan
from harness.testing import run_config

PAPER_MODELS = ["13b", "33b", "65b", "13b_33b", "33b_13b", "33b_65b", "65b_33b"]  # conf/model: the paper's setup
SEARCHING = {"disaggregated", "realhf", "rlhfuse"}
OVERRIDE = re.compile(r"\bsystem\.[a-z0-9_.]+=[^\s,;]+")


def _plan(overrides: list[str]):
    run = run_config(overrides)
    return make_plan(get_class(run.system.impl)(run.system), build_context(run))


def _check_defaults_or_named_fix(system: str, model: str) -> None:
    command = [f"+system={system}", f"model={model}"]
    try:
        _plan(command)
        return
    except HarnessError as e:
        message = str(e)
    fix = [o.rstrip(".") for o in OVERRIDE.findall(message)]
    assert fix, f"+system={system} model={model} is refused without naming a fix: {message}"
    _plan(command + fix)  # the named overrides make it run


def _cases(searching: bool):
    return [(s, m) for s in discover_systems() if (s in SEARCHING) == searching for m in PAPER_MODELS]


@pytest.mark.parametrize(("system", "model"), _cases(searching=False))
def test_defaults_run_or_the_refusal_names_the_fix(system, model):
    _check_defaults_or_named_fix(system, model)


@pytest.mark.slow
@pytest.mark.parametrize(("system", "model"), _cases(searching=True))
def test_searching_systems_defaults_run_or_the_refusal_names_the_fix(system, model):
    _check_defaults_or_named_fix(system, model)


def test_openrlhf_names_the_fewest_options_that_fit():
    with pytest.raises(HarnessError) as refused:
        _plan(["+system=openrlhf", "model=65b_33b"])
    message = str(refused.value)
    assert "does not fit in device memory" in message
    assert message.endswith("With OpenRLHF's own options, system.vllm_tp=2 system.zero_stage=3 makes it fit.")
    with pytest.raises(HarnessError, match=r"With OpenRLHF's own options, system.zero_stage=3 makes it fit\.$"):
        _plan(["+system=openrlhf", "model=33b"])
