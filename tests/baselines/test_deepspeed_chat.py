"""DeepSpeed-Chat plan: co-located ZeRO-3, hybrid-engine static generation, sequential stages."""
import pytest

from harness.errors import PlanError
from harness.testing import plan_for


def test_plan_shape_on_default_cluster():
    plan, ctx, _ = plan_for(["+system=deepspeed_chat", "model=13b"])
    for name in ("ref", "reward", "values", "update_actor", "update_critic"):
        s = plan.task(name).allocation.strategy
        assert (s.dp, s.tp, s.pp, s.zero_stage) == (256, 1, 1, 3)
    gen = plan.task("gen").allocation.strategy
    assert (gen.dp, gen.tp) == (32, 8)
    assert plan.generation.batching == "static" and plan.generation.max_batch_size == 256 // 32
    assert plan.mini_batch_size == 256
    assert [m.task for m in plan.weight_movements] == ["realloc_actor_gen"]
    assert all(len(t.allocation.mesh) == 256 for t in plan.tasks)


def test_needs_one_sample_per_gpu():
    with pytest.raises(PlanError, match="dp=256"):
        plan_for(["+system=deepspeed_chat", "model=13b", "system.mini_batch_size=64"])
