"""Plan memory feasibility: per-device sums by hand, and a refused plan names its numbers."""
import pytest

from harness.costmodel.llama import kv_bytes_per_token, num_params
from harness.errors import PlanMemoryError
from harness.planning.memory import check_plan_memory
from harness.testing import plan_for


def test_deepspeed_chat_13b_generation_memory_by_hand():
    """ZeRO-3 over 256 GPUs keeps 16 B/param of actor and critic and 2 B/param of ref and reward
    per device (/256); generation adds the TP-8 weights (2 B/param / 8) and the KV cache of one
    max-length sample (prompt cap 512 + max_gen_len 1024 tokens, KV split over tp 8)."""
    plan, ctx, _ = plan_for(["+system=deepspeed_chat", "model=13b"])
    report = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    actor, critic = num_params(ctx.models.actor), num_params(ctx.models.critic)
    resident = (16 * actor + 16 * critic + 2 * actor + 2 * critic) / 256 / 1e9
    gen = 2 * actor / 8 / 1e9 + kv_bytes_per_token(ctx.models.actor) * (512 + 1024) / 8 / 1e9
    assert report.task_peak_gb["gen"] == pytest.approx(resident + gen, rel=1e-3)
    assert report.kv_capacity_gb["gen"] == pytest.approx(80 * 0.9 - resident - 2 * actor / 8 / 1e9, rel=1e-3)


def test_plan_that_does_not_fit_is_refused_with_numbers():
    plan, ctx, _ = plan_for(["+system=deepspeed_chat", "model=65b", "cluster.num_nodes=1"])
    with pytest.raises(PlanMemoryError) as err:
        check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    text = str(err.value)
    assert "does not fit" in text and "72.0 GB" in text and "resident actor train" in text
