"""Model homes and weight versions on ``backend=ray`` (harness/backends/ray/homes.py): a weight
movement must send current weights from the devices the scheduler gave it, so a plan whose movement
would send a stale copy is refused before Ray starts, naming the movement."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("ray")

from harness.backends.ray.driver.homes import ModelHomes, model_args, stale_movement_sources  # noqa: E402
from harness.backends.ray.driver.options import unsupported_features  # noqa: E402
from harness.testing import plan_for  # noqa: E402

TINY_4 = ["model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "cluster.gpus_per_node=4"]


@pytest.mark.parametrize("system", ["deepspeed_chat", "realhf", "disaggregated", "interleaved"])
def test_systems_move_current_weights(system):
    plan, _, _ = plan_for([f"+system={system}", *TINY_4])
    assert plan.weight_movements, "the test needs a plan that moves weights"
    assert stale_movement_sources(plan) == []


def test_a_movement_from_a_stale_copy_is_refused():
    plan, ctx, _ = plan_for(["+system=realhf", *TINY_4])
    move = next(m for m in plan.weight_movements if m.model.value == "actor")
    home = ModelHomes(plan).home["actor"]
    # a layout of the actor that no movement fills before this one: its copy is never current
    other = next(t.allocation for t in plan.tasks
                 if t.allocation not in (home, move.target) and len(t.allocation.mesh) == len(move.source.mesh))
    bad = dataclasses.replace(plan, weight_movements=[dataclasses.replace(m, source=other) if m is move else m
                                                      for m in plan.weight_movements])
    assert stale_movement_sources(bad) == [move.task]
    why = unsupported_features(bad, model_args(ctx.models))
    assert any(w.startswith(f"weight movement {move.task} sends actor from") and "stale" in w for w in why), why
