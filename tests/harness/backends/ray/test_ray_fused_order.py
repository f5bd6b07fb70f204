"""A fused pipeline of 4 stages under NCCL's message matching, emulated on gloo, end to end.

NCCL matches the point-to-point messages between two ranks in posting order and ignores tags;
``backend.options.p2p_matching=in_order`` (the default) posts every pipeline message with tag 0, so
gloo matches them the same way. RLHFuse's searched fused schedules (section 5) interleave the
actor's activations and the critic's gradients on each link differently on its two ends, so a
runtime that posted receives in its own compute order would hand activations to the wrong
micro-batch or model (with equal shapes silently). Here the fused stage's actor and critic layouts
are pinned to ``pp = 4`` on 4 devices (4 layers per model, 8 micro-batches per pipe), and the run
must end with the same weights as the same layouts trained one model after the other
(``system.intra_stage=false``). The message lists of searched 4- and 8-stage schedules are checked
in-process, under the same matching, by tests/harness/real/parallel/test_comm.py; this is the one
run through the Ray workers. The test first checks that the plan's searched schedule is one the
naive lowering gets wrong, so that it can fail. With gloo's tag matching (``p2p_matching=tags``)
the same lists give bit-identical weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import flat_weights, local_ray, run_in_process

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.ray, pytest.mark.slow]
NUM_STAGES = 4


def _args(num_stages: int, fused: bool, matching: str = "in_order") -> list[str]:
    layout = f"dp1tp1pp{num_stages}"
    return ["+system=rlhfuse", "model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=1",
            f"cluster.gpus_per_node={num_stages}", "logger=none", "logger.progress_bar=false",
            "backend.num_iterations=1", "backend.num_warmup_iterations=0", "backend.options.dump_weights_dir=w", f"backend.options.p2p_matching={matching}",
            f"model.actor.num_layers={num_stages}", f"model.critic.num_layers={num_stages}",
            "workload.micro_batch_size=1", "workload.mini_batch_size=8", "system.inter_stage=false",
            f"system.layouts.update_actor={layout}", f"system.layouts.update_critic={layout}",
            f"system.intra_stage={str(fused).lower()}"] + (["system.fused_search.max_steps=2000"] if fused else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, machine_lock):
    root = tmp_path_factory.mktemp("fused_order")
    out = {}
    with local_ray():
        for fused in (True, False):
            cwd = root / f"pp{NUM_STAGES}_{'fused' if fused else 'serial'}"
            out[(NUM_STAGES, fused)] = (cwd, run_in_process(_args(NUM_STAGES, fused), cwd))
        cwd = root / f"pp{NUM_STAGES}_fused_tags"  # gloo's tag matching (backend.options.p2p_matching=tags), for comparison
        out[(NUM_STAGES, "tags")] = (cwd, run_in_process(_args(NUM_STAGES, True, "tags"), cwd))
    return out


def test_fused_training_matches_serial_under_in_order_matching(runs):
    from harness.core.plan import Plan
    from harness.schedule import lower
    from harness.schedule.p2p_order import order_mismatches

    for fused in (True, False):
        cwd, proc = runs[(NUM_STAGES, fused)]
        assert proc.returncode == 0, proc.stderr[-3000:]
    cwd = runs[(NUM_STAGES, True)][0]
    [plan_path] = cwd.glob("results/default/*/tiny/seed*/plan.json")
    [stage] = Plan.from_json(plan_path.read_text()).training
    assert stage.fused and all(p.num_stages == NUM_STAGES for p in stage.schedule.pipes.values())
    # the searched schedule is one that posting receives in compute order would get wrong
    assert order_mismatches(lower(stage.schedule)), "schedule too easy: the test could not fail"
    summary = json.loads(plan_path.with_name("summary.json").read_text())["metrics"]
    for role in ("actor", "critic"):
        serial = flat_weights(runs[(NUM_STAGES, False)][0] / "w" / f"{role}.pt")
        fused = flat_weights(cwd / "w" / f"{role}.pt")
        update = summary[f"rl/{role}_update_l2"]
        diff = float((fused - serial).norm())
        assert update > 1e-4
        assert diff < 1e-6 * float(serial.norm()) and diff < 1e-2 * update, (role, diff, update)


def test_tag_matching_gives_the_same_weights_as_in_order(runs):
    """The ordered lists are correct under either matching rule: gloo's tags agree with posting order."""
    for key in ((NUM_STAGES, True), (NUM_STAGES, "tags")):
        assert runs[key][1].returncode == 0, runs[key][1].stderr[-3000:]
    for role in ("actor", "critic"):
        in_order = flat_weights(runs[(NUM_STAGES, True)][0] / "w" / f"{role}.pt")
        tags = flat_weights(runs[(NUM_STAGES, "tags")][0] / "w" / f"{role}.pt")
        assert torch.equal(in_order, tags), role
