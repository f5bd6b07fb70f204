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


TINY_4 = ["+system=deepspeed_chat", "model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1",
          "cluster.gpus_per_node=4"]


def test_tiny_on_four_devices_keeps_the_workloads_mini_batch():
    """The README's 4-device tiny setting: the workload's mini-batch of 4 is a
    multiple of the 4 GPUs, so DeepSpeed-Chat keeps it (the same optimisation problem as every other
    system) and trains one sample per GPU per micro-step (the workload's micro-batch is 2)."""
    plan, _, _ = plan_for(TINY_4)
    assert plan.mini_batch_size == 4
    for stage in plan.training:
        assert stage.micro_batch_size == 1 and stage.num_minibatches == 2
        assert [p.num_mbs for p in stage.schedule.pipes.values()] == [1]
    plan, _, _ = plan_for(TINY_4 + ["cluster.gpus_per_node=2"])  # two samples per GPU: the workload's micro-batch
    assert plan.mini_batch_size == 4 and {s.micro_batch_size for s in plan.training} == {2}


def test_set_mini_batch_must_give_every_gpu_a_sample():
    plan, _, _ = plan_for(TINY_4 + ["system.mini_batch_size=8"])  # two per GPU: micro-batches of 2
    assert {s.micro_batch_size for s in plan.training} == {2}
    with pytest.raises(PlanError, match=r"system\.mini_batch_size=2 must be a multiple of the 4 devices"):
        plan_for(TINY_4 + ["system.mini_batch_size=2"])
