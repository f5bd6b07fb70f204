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
    with pytest.raises(PlanMemoryError) as err:  # the plan's memory check (check_plan_memory) refuses it
        plan_for(["+system=deepspeed_chat", "model=65b", "cluster.num_nodes=1"])
    text = str(err.value)
    assert "does not fit" in text and "72.0 GB" in text and "resident actor train" in text


def _per_device_oracle(plan, cm, models, workload):
    """check_plan_memory's numbers the plain way: every device of every task, one at a time."""
    from harness.planning import memory as m

    offload = plan.engines is not None and plan.engines.training.optimizer_offload
    held: dict[int, list[float]] = {}
    for r in plan.resident:
        gb = m._state_gb(cm, getattr(models, r.model), plan.task(r.task).allocation, r.what, offload)
        for d in plan.task(r.task).allocation.mesh:
            held.setdefault(d, []).append(gb)
    train_act = m.training_activation_gb(plan, cm, models, workload)
    peak, task_peak, kv = {}, {}, {}
    for task in plan.tasks:
        if task.kind == "weight_movement":
            continue
        here = any((r.model == task.model and r.task == task.name)
                   or (r.model == task.model and plan.task(r.task).allocation == task.allocation)
                   for r in plan.resident)
        working = m._working_set_gb(task, cm, models, workload, here, train_act, offload,
                                    m.fused_attention(plan.engines))
        totals = {d: sum(held.get(d, [])) + sum(working.values()) for d in task.allocation.mesh}
        if max(totals.values()) > cm.hbm_capacity_gb:
            return "does not fit", next(d for d, t in totals.items() if t > cm.hbm_capacity_gb)
        for d, t in totals.items():
            peak[d] = max(peak.get(d, 0.0), t)
        task_peak[task.name] = max(totals.values())
        if task.kind == "generate":
            kv[task.name] = (cm.hbm_capacity_gb - max(sum(held.get(d, [])) for d in task.allocation.mesh)
                             - sum(v for k, v in working.items() if "weights" in k))
    return list(peak.items()), task_peak, kv


def test_report_equals_a_per_device_count_over_searched_and_scattered_meshes():
    """The array bookkeeping (slices for contiguous meshes, index arrays otherwise) gives the
    per-device numbers, in the same device order, and refuses at the same device."""
    import random

    from baselines.realhf import RealHF
    from harness.planning.workflow import workflow_tasks
    from harness.core.plan import Allocation, ParallelStrategy
    from harness.run.pipeline import build_context
    from harness.testing import run_config

    run = run_config(["+system=realhf", "model=7b", "cluster.num_nodes=4", "logger=none"])
    ctx = build_context(run)
    system = RealHF(run.system)
    meshes, strategies = system._options(ctx)
    rng = random.Random(0)
    choice = system.heuristic_choice(ctx)
    seen = {"fits": 0, "does not fit": 0}
    for step in range(160):
        call = rng.choice(workflow_tasks())  # PPO's calls
        mesh = rng.choice(meshes)
        if step % 4 == 0:  # a scattered mesh: same size, devices shuffled across the cluster
            mesh = tuple(rng.sample(range(ctx.num_devices), len(mesh)))
        options = strategies(call, tuple(range(len(mesh))))
        if not options:
            continue
        choice = {**choice, call: Allocation(mesh, rng.choice(options))}
        plan = system.build_plan(ctx, choice, offload=step % 3 == 0)
        expected = _per_device_oracle(plan, ctx.cost_model, ctx.models, ctx.workload)
        if expected[0] == "does not fit":
            with pytest.raises(PlanMemoryError, match=f"on device {expected[1]} needs"):
                check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
            seen["does not fit"] += 1
            continue
        report = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
        assert (list(report.peak_gb.items()), report.task_peak_gb, report.kv_capacity_gb) == expected
        seen["fits"] += 1
    assert seen["fits"] > 10 and seen["does not fit"] > 3, seen
