"""backend=ray runs sequence-packed plans (``workload.micro_batch_tokens``): each replica's share of
a training mini-batch as its pipe's planned count of packed micro-batches, and each forward-only
pass's rows packed first-fit decreasing to the budget (harness/real/packing.py,
harness/backends/ray/worker/pipeline.py and passes.py).

Oracle: packing changes how the samples are cut into micro-batches, not what is computed. The loss
of a mini-batch is divided by its masked tokens, so its gradient is the same however the samples
are cut; each packed sample attends within itself. A packed run therefore ends with the weights of
the same run unpacked, to float rounding (relative L2 distance below 1e-6 and below 1% of the
update, test_ray_critic_free.py's tolerance), in fewer micro-batches. Four layouts, 2 iterations
each, 2 devices:

- NeMo-RL, GRPO, a two-stage training pipeline (``dp1tp1pp2``): packed micro-batches cross the
  pipeline, their activations the shapes the neighbouring stage packs alike;
- DeepSpeed-Chat, PPO with a critic and a reward model, ZeRO-3 on dp 2: values and scores read
  from packed rows, and ZeRO-3's gathers keep the replicas' forward passes in lockstep;
- ReaLHF's heuristic layout, PPO, tensor parallelism 2;
- RLHFuse's fused actor+critic stage (PPO, both models in two pipeline stages): the fused schedule
  searched over each model's packed micro-batches, both models' packed micro-batches crossing the
  same links in opposite directions.
"""
from __future__ import annotations

import json

import pytest

from tests.helpers import flat_weights, local_ray, run_all_in_process

pytest.importorskip("ray")
pytest.importorskip("torch")

pytestmark = pytest.mark.ray

COMMON = ["model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=1",
          "cluster.gpus_per_node=2", "backend.num_iterations=2", "workload.micro_batch_size=1", "logger=none",
          "logger.progress_bar=false", "backend.options.dump_weights_dir=w"]
VERIFIER = ["backend.options.reward.kind=token_range", "backend.options.reward.low=0",
            "backend.options.reward.high=32"]
LAYOUTS = {
    "nemo_rl_pp2": ["+system=nemo_rl", "algo=grpo", "algo.group_size=4", "workload.global_batch_size=2",
                    "workload.mini_batch_size=1", "system.train_layout=dp1tp1pp2", *VERIFIER],
    "deepspeed_chat_zero3": ["+system=deepspeed_chat", "algo=ppo"],
    "realhf_tp2": ["+system=realhf_heuristic", "algo=ppo"],
    "rlhfuse_fused_pp2": ["+system=rlhfuse", "algo=ppo", "system.inter_stage=false",
                          "system.layouts.update_actor=dp1tp1pp2", "system.layouts.update_critic=dp1tp1pp2",
                          "system.fused_search.max_steps=200"],
}
# samples of the tiny workload are at most 32 tokens, 64 as the packer pads them: 4 to a bin
BUDGET = 256


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    configs = {f"{name}_{mode}": [*args, *COMMON, *([f"workload.micro_batch_tokens={BUDGET}"] if mode == "packed" else [])]
               for name, args in LAYOUTS.items() for mode in ("packed", "unpacked")}
    with local_ray():
        folders = run_all_in_process(configs, root)
    return {name: (root / name, folders[name]) for name in configs}


def _trained(folder) -> dict[str, dict]:
    summary = json.loads((folder / "summary.json").read_text())
    return summary["final_weights"]["models"]


def _micro_batches(folder) -> dict[str, int]:
    """Each training pipe's micro-batches per replica in the plan that ran."""
    plan = json.loads((folder / "plan.json").read_text())
    return {pipe["model"]: pipe["num_mbs"] for stage in plan["training"] for pipe in stage["schedule"]["pipes"]}


def _forward_spans(folder, task: str) -> int:
    trace = json.loads((folder / "trace.json").read_text())
    return sum(1 for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") == f"{task}:forward")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_packed_run_ends_with_the_unpacked_runs_weights(runs, layout):
    (packed_cwd, packed), (unpacked_cwd, unpacked) = runs[f"{layout}_packed"], runs[f"{layout}_unpacked"]
    models = _trained(packed)
    assert set(models) == set(_trained(unpacked)) == ({"actor"} if "algo=grpo" in LAYOUTS[layout] else {"actor", "critic"})
    for model in models:
        update = models[model]["update_l2"]
        assert update > 1e-3  # two iterations did move the weights
        a, b = flat_weights(packed_cwd / "w" / f"{model}.pt"), flat_weights(unpacked_cwd / "w" / f"{model}.pt")
        diff = float((a - b).norm())
        assert diff < 1e-6 * float(b.norm()) and diff < 1e-2 * update, (model, diff, update)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_packed_run_trains_in_fewer_micro_batches(runs, layout):
    packed, unpacked = runs[f"{layout}_packed"][1], runs[f"{layout}_unpacked"][1]
    planned, planned_unpacked = _micro_batches(packed), _micro_batches(unpacked)
    assert planned.keys() == planned_unpacked.keys()
    assert all(planned[m] < planned_unpacked[m] for m in planned), (planned, planned_unpacked)
    # the workers ran the plan's count: the training forward passes scale with it
    task = "update_actor"
    ratio = _forward_spans(packed, task) / _forward_spans(unpacked, task)
    assert ratio == pytest.approx(planned["actor"] / planned_unpacked["actor"])
    # the same responses were scored (a reward model's score to float rounding)
    rewards = [json.loads((f / "summary.json").read_text())["metrics"]["rl/reward_mean"] for f in (packed, unpacked)]
    assert rewards[0] == pytest.approx(rewards[1], rel=1e-5)
