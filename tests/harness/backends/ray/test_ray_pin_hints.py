"""backend=ray's refusals name the key that pins a layout in the system that made the plan:
``system.layout=...`` for colocated (one shared layout), ``system.layouts.<task>=...`` for
RLHFuse-Base and RLHFuse; no key for a system that pins none. The key travels in the plan
(``Plan.layout_keys``, set through ``assemble_ppo_plan``), so the backend has no per-system branch;
it is not part of what runs, so plan.json does not hold it. The suggested layout keeps the task's
dp (pp folded into tp), so it splits the batch as the refused one did, and the backend executes it."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from harness.backends.ray.driver.homes import model_args  # noqa: E402
from harness.backends.ray.driver.options import unsupported_features  # noqa: E402
from harness.core.plan import Feature, Plan  # noqa: E402
from harness.testing import plan_for  # noqa: E402

TINY_4 = ["model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=4"]


def refusals(*overrides: str) -> tuple[Plan, list[str]]:
    plan, ctx, _ = plan_for([*overrides, *TINY_4])
    return plan, unsupported_features(plan, model_args(ctx.models))


def test_colocated_refusal_names_system_layout_and_the_suggestion_runs():
    plan, why = refusals("+system=colocated")  # the searched shared layout generates with pp=2 here
    assert why == ["task gen generates with pp=2; generation runs with pp=1 only "
                   "(pin a layout it executes: system.layout=dp2tp2pp1)"], why
    assert not any("system.layouts" in w for w in why)
    _, why = refusals("+system=colocated", "system.layout=dp2tp2pp1")  # the suggestion, as the README shows it
    assert why == []


def test_rlhfuse_refusals_name_the_task_key():
    for system, extra in (("rlhfuse_base", []), ("rlhfuse", ["system.fused_search.max_steps=200"])):
        _, why = refusals(f"+system={system}", "system.layouts.gen=dp2tp1pp2", *extra)
        assert any(w.endswith("(pin a layout it executes: system.layouts.gen=dp2tp2pp1)") for w in why), why


def test_plans_without_layout_keys_name_no_key():
    plan, _ = refusals("+system=colocated")
    assert plan.layout_keys["gen"] == "system.layout"
    again = Plan.from_json(plan.to_json())  # plan.json holds no hints: not what runs
    assert "layout_keys" not in plan.to_dict() and again.layout_keys == {} and again == plan
    _, ctx, _ = plan_for(["+system=colocated", *TINY_4])
    why = unsupported_features(again, model_args(ctx.models))
    assert why == ["task gen generates with pp=2; generation runs with pp=1 only"], why


def test_colocated_refusal_on_the_command_line(run_harness, tmp_path):
    proc = run_harness(["+system=colocated", *TINY_4, "backend=ray", "logger=none"], tmp_path, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "(pin a layout it executes: system.layout=dp2tp2pp1)" in proc.stderr
    assert "system.layouts" not in proc.stderr


def test_a_packed_plan_is_not_refused():
    """Sequence packing runs on Ray (test_ray_packing.py); its plan passes the feature check."""
    plan, ctx, _ = plan_for(["+system=nemo_rl", "algo=grpo", "model=tiny", "cluster.num_nodes=1",
                             "cluster.gpus_per_node=2", "workload=tiny", "workload.micro_batch_tokens=4096"])
    assert Feature.SEQUENCE_PACKING in plan.features()
    assert unsupported_features(plan, model_args(ctx.models)) == []
