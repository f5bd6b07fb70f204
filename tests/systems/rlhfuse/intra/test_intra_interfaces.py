"""The fused search's kernels over named state (RLHFuse section 5): compiled and pure Python give
the same search bit for bit, the loop's state is read and written by name, modules use each
other's public names only, and every search option's default is written once (intra/config.py)."""
import ast
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from systems.rlhfuse.fuse import parser, search_config
from systems.rlhfuse.intra import kernel, loop
from systems.rlhfuse.intra.anneal import AnnealParams
from systems.rlhfuse.intra.config import PLANNING_MAX_STEPS, FusedSearchConfig
from systems.rlhfuse.intra.memory import MemoryParams
from systems.rlhfuse.system import RLHFuseConfig

ROOT = Path(__file__).resolve().parents[4]
PACKAGE = ROOT / "systems" / "rlhfuse"

# One small search, its result as JSON: every number of the summary but the clocks, and the schedule.
SEARCH = """
import json
from systems.rlhfuse.intra import FusedSearchConfig, fused_costs, fused_pipes, search_fused_schedule
pipes = fused_pipes(4, 2, 4, 4)
costs = fused_costs(pipes, 1.0, 0.45, mem1=1.0, mem2=0.5, p2p=0.02)
result = search_fused_schedule(pipes, costs, None, FusedSearchConfig(seed=1, max_steps=1500, num_seeds=2,
                                                                     makespan_slack_frac=0.02))
summary = {k: v for k, v in result.summary().items() if k not in ("search_s", "steps_per_s", "exact_s")}
order = {str(r): [str(a) for a in acts] for r, acts in result.schedule.order.items()}
print(json.dumps({"summary": summary, "order": order, "makespan": result.makespan.hex(),
                  "peak": result.peak_memory.hex()}, sort_keys=True))
"""


def _search_in_process(pure_python: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HARNESS_PURE_PYTHON", "RLHFUSE_PURE_PYTHON")}
    if pure_python:
        env["HARNESS_PURE_PYTHON"] = "1"
    proc = subprocess.run([sys.executable, "-c", SEARCH], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(not kernel.AVAILABLE, reason="numba is not installed: nothing compiled to compare")
def test_pure_python_process_searches_bit_for_bit_as_the_compiled_kernels():
    """Every kernel interpreted (HARNESS_PURE_PYTHON=1: no numba at all, not only the outer loop)
    against every kernel compiled: the same schedule and the same numbers, to the last bit."""
    assert _search_in_process(pure_python=True) == _search_in_process(pure_python=False)


def test_loop_state_is_a_record_read_and_written_by_name():
    state = loop.new_state(best_peak=math.inf, step=7)
    assert state.step == 7 and state.best_peak == math.inf and state.cap == 0.0
    state.trial_makespan = 3.5
    assert state.trial_makespan == 3.5 and set(loop.LOOP_STATE.names) >= {"step", "trial_makespan", "levels"}
    with pytest.raises(AttributeError, match="no field 'stepp'"):
        loop.new_state(stepp=1)


def test_loop_params_take_the_kernels_types_whatever_they_are_given():
    """One compiled version of the loop serves every run: integers and floats as declared."""
    params = loop.LoopParams(loop.MEMORY, 2, 1, 10.0, 256.0, max_shift=8.0, cap_step=1, tol=np.float64(3.0)).typed()
    assert [type(v) for v in params] == [int, float, float, int, int, float, float, float, int] + [float] * 8
    assert params.objective == loop.MEMORY and params.rung == 10 and params.cap_step == 1.0


def test_modules_read_no_private_name_of_another_object():
    """Every attribute with a leading underscore read in systems/rlhfuse/ is its own object's
    (``self``, ``cls``) or a named tuple's public method (``_replace``, ``_fields``, ...)."""
    public_tuple_api = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in public_tuple_api
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found


def test_the_run_config_sets_no_search_option_and_takes_the_typed_defaults():
    """conf/system/rlhfuse.yaml leaves system.fused_search to its schema: the run's search is
    FusedSearchConfig's defaults with the planner's step budget."""
    raw = OmegaConf.load(ROOT / "conf" / "system" / "rlhfuse.yaml")
    assert "fused_search" not in raw
    del raw["defaults"]  # the schema named there is RLHFuseConfig's
    assert RLHFuseConfig().fused_search == FusedSearchConfig(max_steps=PLANNING_MAX_STEPS)
    schema = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RLHFuseConfig), raw))
    assert asdict(schema.fused_search) == asdict(FusedSearchConfig(max_steps=PLANNING_MAX_STEPS))


def test_the_command_line_and_the_search_parameters_read_the_config_defaults():
    args = parser().parse_args(["--stages", "4", "2", "--microbatches", "4", "4", "--fwd", "1", "1",
                                 "--mem", "1", "1"])
    assert search_config(args) == FusedSearchConfig()
    defaults, anneal, memory = FusedSearchConfig(), AnnealParams(), MemoryParams()
    assert (anneal.seed, anneal.max_steps, anneal.time_limit_s) == (defaults.seed, defaults.step_budget, None)
    assert (anneal.memory_phase, anneal.makespan_slack_frac) == (defaults.memory_phase, defaults.makespan_slack_frac)
    assert list(anneal.memory_cap_steps) == defaults.memory_cap_steps
    assert list(anneal.memory_makespan_weights) == defaults.memory_makespan_weights
    assert memory.max_shift == defaults.memory_move_reach
    assert (memory.cap_step, memory.makespan_weight) == (defaults.memory_cap_steps[0],
                                                         defaults.memory_makespan_weights[0])
