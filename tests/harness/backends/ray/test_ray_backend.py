"""backend=ray end to end: real PPO iterations on CPU worker processes, through ``python -m harness``.

One module-scoped set of runs (2 iterations each, tiny models, 2-4 devices) serves several checks:

- both systems write their results (summary with throughput, stage times and RL metrics);
- **same seed, same weights**: deepspeed_chat (DeepSpeed ZeRO-3 on 2 devices, or our own ZeRO-3
  when DeepSpeed is not installed; tp=2 hybrid-engine generation), deepspeed_chat with our own
  ZeRO-3 on 4 devices and micro-batches of 1, and rlhfuse_base (4 devices, its searched layouts
  with pp=2 training; and pinned tp=4 generation / actor training and pp=2 critic inference) end
  two iterations with the same actor and critic weights (the second iteration generates with
  weights that training updated and weight movements delivered). Tolerance: relative
  L2 distance below 1e-6 and below 1% of the iteration's update. The layouts change float
  summation order only (measured differences: ~1e-8 relative); a change of math (e.g. one
  mini-batch instead of two) moves the weights by ~2e-4 relative, about the size of the update;
- workers end cleanly (barrier + destroy_process_group, nothing aborts);
- a worker that dies mid-iteration fails the run within seconds with an error naming it.

What the driver does with its workers' answers -- which calls it issues in which order, units on
disjoint devices started together, the stream handing finished samples to inference, a failed
worker named by its task -- is tested in-process, without Ray, in test_driver.py; the runs here
check what needs real workers.
"""
from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.ray

COMMON = ["model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=1", "logger=none",
          "logger.progress_bar=false", "backend.num_iterations=2", "backend.options.dump_weights_dir=w"]
RUNS = {
    "deepspeed_chat": ["+system=deepspeed_chat", "cluster.gpus_per_node=2", "system.mini_batch_size=4",
                       "system.generation_batch_size=8"],
    "deepspeed_chat_native": ["+system=deepspeed_chat", "cluster.gpus_per_node=4", "system.mini_batch_size=4",
                              "system.generation_batch_size=8", "workload.micro_batch_size=1",
                              "backend.options.zero3_impl=native"],
    "rlhfuse_base": ["+system=rlhfuse_base", "cluster.gpus_per_node=4"],
    "rlhfuse_base_tp": ["+system=rlhfuse_base", "cluster.gpus_per_node=4", "system.layouts.gen=dp1tp4pp1",
                        "system.layouts.update_actor=dp1tp4pp1", "system.layouts.values=dp2tp1pp2"],
    # RLHFuse's intra-stage fusion: actor and critic train in one fused pipeline on shared ranks
    "rlhfuse_fused": ["+system=rlhfuse", "cluster.gpus_per_node=4", "system.inter_stage=false",
                      "system.fused_search.max_steps=200"],
}
# A long-tailed workload (16 samples, heavy tail), where RLHFuse's long-tail migration has work to
# do: both fusions on, four generation instances, R_t = 25% of the batch.
# Seed 1: the simulator migrates one sequence in iterations 1 and 2 of this plan (none in 0).
LONG_TAIL = ["cluster.gpus_per_node=4", "workload.global_batch_size=16", "workload.output_len.sigma=1.0",
             "workload.max_gen_len=24", "workload.output_len.max=24", "seed=1"]
RUNS.update({
    "rlhfuse_both": ["+system=rlhfuse", *LONG_TAIL, "system.fused_search.max_steps=200", "system.migration_frac=0.25",
                     "system.layouts.gen=dp4tp1pp1", "backend.num_iterations=3"],
    "rlhfuse_base_long_tail": ["+system=rlhfuse_base", *LONG_TAIL, "backend.num_iterations=3"],
    "deepspeed_chat_long_tail": ["+system=deepspeed_chat", *LONG_TAIL, "backend.num_iterations=3",
                                 "system.mini_batch_size=4", "system.generation_batch_size=16",
                                 "workload.micro_batch_size=1"],
})
# Every other system backend=ray runs, on the same long-tailed workload (2 iterations): with the
# three above, the runs the sim-vs-real parity test compares with the simulator.
PARITY_RUNS = {"rlhfuse": "rlhfuse_both", "rlhfuse_base": "rlhfuse_base_long_tail",
               "deepspeed_chat": "deepspeed_chat_long_tail"}
for _system, _extra in {"interleaved": [], "realhf": [], "realhf_heuristic": [], "disaggregated": [],
                        "colocated": ["system.layout=dp2tp2pp1"], "openrlhf": ["cluster.gpus_per_node=8"]}.items():
    _keys = {e.split("=")[0] for e in _extra}
    RUNS[f"{_system}_long_tail"] = [f"+system={_system}", *(a for a in LONG_TAIL if a.split("=")[0] not in _keys), *_extra]
    PARITY_RUNS[_system] = f"{_system}_long_tail"
ABORT = re.compile(r"terminate called|Aborted|core dumped|SIGABRT|destroy_process_group\(\) was not called", re.I)


def with_common(args: list[str]) -> list[str]:
    """COMMON overrides, unless ``args`` sets the same key."""
    keys = {a.split("=", 1)[0] for a in args}
    return [c for c in COMMON if c.split("=", 1)[0] not in keys] + args


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_harness):
    root = tmp_path_factory.mktemp("ray_runs")
    out = {}
    for name, args in RUNS.items():
        start = time.monotonic()
        proc = run_harness(with_common(args), root / name, timeout=600)
        out[name] = (root / name, proc, time.monotonic() - start)
    return out


def _run_folder(cwd: Path) -> Path:
    [summary] = cwd.glob("results/default/*/tiny/seed*/summary.json")
    return summary.parent


def _flat(path: Path) -> torch.Tensor:
    state = torch.load(path)
    return torch.cat([state[n].reshape(-1).double() for n in sorted(state)])


@pytest.mark.parametrize("name", list(RUNS))
def test_runs_write_results(runs, name):
    cwd, proc, _ = runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = _run_folder(cwd)
    summary = json.loads((folder / "summary.json").read_text())
    m = summary["metrics"]
    assert summary["run"]["backend"] == "ray"
    assert m["perf/samples_per_s"] > 0
    for key in ("timing_s/gen", "timing_s/ref", "timing_s/reward", "timing_s/values", "timing_s/update_actor",
                "timing_s/update_critic", "rl/reward_mean", "rl/kl", "rl/policy_loss", "rl/value_loss",
                "rl/actor_param_l2", "rl/critic_param_l2", "rl/actor_update_l2", "util/gpu_busy_frac/mean"):
        assert key in m, key
    with open(folder / "samples.csv") as f:
        rows = list(csv.DictReader(f))
    expected = 16 if "workload.global_batch_size=16" in RUNS[name] else 8
    assert len(rows) == expected and all(int(r["response_len"]) >= 1 for r in rows)
    assert (folder / "trace.json").is_file() and (folder / "metrics.jsonl").is_file()


def test_rlhfuse_base_plans_exercise_pipeline_and_tensor_parallelism(runs):
    plans = {n: json.loads((_run_folder(runs[n][0]) / "plan.json").read_text()) for n in RUNS}
    strategies = {n: {t["name"]: t["allocation"]["strategy"] for t in p["tasks"]} for n, p in plans.items()}
    assert strategies["rlhfuse_base"]["update_actor"]["pp"] == 2
    assert strategies["rlhfuse_base_tp"]["update_actor"]["tp"] == 4
    assert strategies["rlhfuse_base_tp"]["values"]["pp"] == 2
    assert strategies["deepspeed_chat"]["update_actor"]["zero_stage"] == 3
    assert "ZeRO-3 by native" in runs["deepspeed_chat_native"][1].stdout


def test_same_seed_same_weights_across_systems(runs):
    for role in ("actor", "critic"):
        ref = _flat(runs["deepspeed_chat"][0] / "w" / f"{role}.pt")
        summary = json.loads((_run_folder(runs["deepspeed_chat"][0]) / "summary.json").read_text())["metrics"]
        update = summary[f"rl/{role}_update_l2"]
        assert update > 1e-4  # the iterations did move the weights
        for other in ("deepspeed_chat_native", "rlhfuse_base", "rlhfuse_base_tp", "rlhfuse_fused"):
            w = _flat(runs[other][0] / "w" / f"{role}.pt")
            diff = float((w - ref).norm())
            assert diff < 1e-6 * float(ref.norm()), (role, other, diff)
            assert diff < 1e-2 * update, (role, other, diff, update)


def test_fused_stage_runs_the_fused_schedule_on_every_rank(runs):
    """Each device runs its logical rank's actions of the plan's fused schedule, actor and critic
    interleaved, in the schedule's order, once per mini-batch (a driver that trained the models one
    after the other would give every device all of one model's actions first)."""
    from harness.core.plan import Plan
    from harness.planning.taskmodels.passes import pipe_stage_devices

    folder = _run_folder(runs["rlhfuse_fused"][0])
    plan = Plan.from_json((folder / "plan.json").read_text())
    [stage] = plan.training
    assert stage.fused
    rank_of = {d: stage.schedule.pipes[pipe].stage_to_rank[st]
               for (pipe, st), devices in pipe_stage_devices(plan, stage).items() for d in devices}
    events = json.loads((folder / "trace.json").read_text())["traceEvents"]
    interleaved = False
    for device, rank in rank_of.items():
        expected = [(stage.schedule.pipes[a.pipe].model, a.kind) for a in stage.schedule.order[rank] if a.is_compute]
        models = [m for m, _ in expected]
        interleaved |= models != sorted(models)  # not all of one model's actions first
        ran = [(e["name"].split(":")[0].removeprefix("update_"), "F" if e["name"].endswith(":forward") else "B")
               for e in sorted(events, key=lambda e: e.get("ts", 0))
               if e.get("ph") == "X" and e["pid"] == device and e["name"].startswith("update_")
               and e["name"].split(":")[1] in ("forward", "backward")]
        assert ran == expected * stage.num_minibatches, (device, ran, expected)
    assert interleaved, "the searched fused schedule should interleave actor and critic actions on some rank"


def test_rlhfuse_with_both_fusions_changes_the_schedule_not_the_math(runs):
    """Streaming, migration and the fused pipeline on the long-tailed workload reach the same
    weights and the same per-sample rewards, reference log-probs and values as RLHFuse-Base (and
    DeepSpeed-Chat the same weights and rewards)."""
    for role in ("actor", "critic"):
        ref = _flat(runs["rlhfuse_base_long_tail"][0] / "w" / f"{role}.pt")
        for other in ("rlhfuse_both", "deepspeed_chat_long_tail"):
            w = _flat(runs[other][0] / "w" / f"{role}.pt")
            assert float((w - ref).norm()) < 1e-6 * float(ref.norm()), (role, other)
    base = np.load(runs["rlhfuse_base_long_tail"][0] / "w" / "experience.npz")
    both = np.load(runs["rlhfuse_both"][0] / "w" / "experience.npz")
    ds = np.load(runs["deepspeed_chat_long_tail"][0] / "w" / "experience.npz")
    np.testing.assert_allclose(ds["scores"], base["scores"], atol=1e-5)
    np.testing.assert_array_equal(both["action_mask"], base["action_mask"])
    np.testing.assert_allclose(both["old_logprobs"], base["old_logprobs"], atol=1e-5)
    mask = base["action_mask"]
    for key in ("ref_logprobs", "values"):
        np.testing.assert_allclose(both[key] * mask, base[key] * mask, atol=1e-5, err_msg=key)
    np.testing.assert_allclose(both["scores"], base["scores"], atol=1e-5)


def test_trace_proves_streaming_and_migration(runs):
    """Migration moved sequences (counted, with migrate spans on the senders), inference ran on
    devices released by generation while generation still ran elsewhere, and samples were
    inferred as they finished (the first inference pass starts before generation ends)."""
    from harness.core.plan import Plan
    from harness.planning.memory import check_plan_memory
    from harness.planning.simulate import simulate_iteration
    from harness.testing import context
    from harness.core.workload import make_batch

    folder = _run_folder(runs["rlhfuse_both"][0])
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    real = [int(m["gen/migrated_samples"]) for m in metrics]
    assert sum(real) >= 1, real
    # the migration point agrees with the simulator's, iteration by iteration, on the same plan
    ctx = context(with_common(RUNS["rlhfuse_both"]))
    plan = Plan.from_json((folder / "plan.json").read_text())
    memory = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    sim = [int(simulate_iteration(ctx, plan, memory, it, make_batch(ctx.workload, ctx.seed, it))
               .counters["gen/migrated_samples"]) for it in range(len(real))]
    assert real == sim, (real, sim)

    events = [e for e in json.loads((folder / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    assert real[-1] > 0 and any(e["name"] == "gen:migrate" for e in events)  # the traced iteration migrated
    gen = [(e["ts"], e["ts"] + e["dur"], e["pid"]) for e in events if e["name"] == "gen:decode"]
    inference = [(e["ts"], e["ts"] + e["dur"], e["pid"]) for e in events
                 if e["name"].split(":")[0] in ("ref", "reward", "values") and e["name"].endswith(":forward")]
    assert min(s for s, _, _ in inference) < max(e for _, e, _ in gen)  # streaming: before generation ends
    overlapping = [(i, g) for i in inference for g in gen if i[2] != g[2] and i[0] < g[1] and g[0] < i[1]]
    assert overlapping, "no inference pass overlaps generation's tail on another device"


def test_workers_shut_down_cleanly(runs):
    for name, (_, proc, _) in runs.items():
        assert "workers shut down cleanly" in proc.stdout, name
        assert not ABORT.search(proc.stderr), (name, ABORT.search(proc.stderr))


def test_dead_worker_fails_fast_with_a_clear_error(runs, run_harness, tmp_path):
    """Device 1 dies as it starts update_actor while its peers wait for it in collectives; the run
    must end with the cause named, no later than the same run completing normally (plus a margin
    far below backend.options.task_timeout_s, which would be the bound of a hang)."""
    start = time.monotonic()
    proc = run_harness(COMMON[:-1] + RUNS["rlhfuse_base"] + ["backend.options.fault_injection={task:update_actor,device:1}"],
                       tmp_path, timeout=600)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "task update_actor: the worker of device 1" in proc.stderr and "died" in proc.stderr
    assert elapsed < runs["rlhfuse_base"][2] + 60, (elapsed, runs["rlhfuse_base"][2])
    assert not list(tmp_path.glob("results/**/summary.json"))  # a failed run leaves no result


@pytest.mark.parametrize("where,fault,task", [
    ("mid-migration", "{task:gen,op:migrate,device:2}", "gen"),
])
def test_dead_worker_during_fusion_fails_fast(runs, run_harness, tmp_path, where, fault, task):
    """A worker dying inside a fused mechanism ends the run within a bounded time, naming the task
    and the device, and leaves no finished result: mid-migration, while its peers wait for its KV
    shards in a point-to-point exchange. (A death in a training collective is the test above; which
    task a death mid-stream or in a fused pipeline is charged to is the driver's, tested in-process
    in test_driver.py.)"""
    device = fault.rsplit("device:", 1)[1].rstrip("}") if "device:" in fault else r"\d+"
    start = time.monotonic()
    proc = run_harness(with_common(RUNS["rlhfuse_both"] + [f"backend.options.fault_injection={fault}"]), tmp_path,
                       timeout=600)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, where
    assert re.search(rf"task {re.escape(task)}: the worker of device {device} \(pid \d+\) died", proc.stderr), \
        proc.stderr[-2000:]
    assert elapsed < runs["rlhfuse_both"][2] + 60, (where, elapsed)
    assert not list(tmp_path.glob("results/**/summary.json"))


def test_unsupported_plan_is_refused_before_workers_start(run_harness, tmp_path):
    proc = run_harness(COMMON + ["+system=rlhfuse_base", "cluster.gpus_per_node=4", "system.layouts.gen=dp2tp1pp2"],
                       tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "backend=ray cannot execute this rlhfuse_base plan: task gen generates with pp=2" in proc.stderr
    assert "workers (" not in proc.stdout


# ---- sim-vs-real parity -------------------------------------------------------
def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _duration_dependent_pairs(plan, num_devices: int, trials: int = 200) -> tuple[set, set]:
    """(pairs that run at the same time under every duration, pairs that do under some): the
    plan's units timed by the scheduler with random durations."""
    import random

    from harness.core.units import execution_units
    from harness.planning.scheduler import schedule_durations

    labels = [u.label for u in execution_units(plan)]
    rng, always, ever = random.Random(0), None, set()
    for _ in range(trials):
        table = {label: rng.choice([0.001, 1.0, rng.random() * 10]) for label in labels}
        pairs = {tuple(p) for p in schedule_durations(plan, num_devices, lambda u: table[u.label]).record["concurrent"]}
        always = pairs if always is None else always & pairs
        ever |= pairs
    return always or set(), ever


@pytest.mark.parametrize("system", list(PARITY_RUNS))
def test_real_run_and_simulation_of_the_same_plan_agree(runs, run_harness, tmp_path, system):
    """backend=ray and backend=sim run the same plan through the one scheduler: per iteration they
    start the units in the same order and migrate the same samples; the pairs of units that run at
    the same time are the same, except pairs whose overlap the plan leaves to the units' durations
    (real and predicted durations differ), and every pair the real run overlapped is one the
    scheduler allows."""
    from harness.core.plan import Plan

    name = PARITY_RUNS[system]
    cwd, proc, _ = runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    real_dir = _run_folder(cwd)
    args = [a for a in with_common(RUNS[name]) if not a.startswith("backend")]
    sim_proc = run_harness([*args, "backend.num_iterations=" + str(len(_jsonl(real_dir / "units.jsonl")))],
                           tmp_path, timeout=300)
    assert sim_proc.returncode == 0, sim_proc.stderr[-3000:]
    sim_dir = _run_folder(tmp_path)
    plan = Plan.from_json((real_dir / "plan.json").read_text())
    same = {k: v for k, v in plan.to_dict().items() if k != "notes"}  # notes hold wall-clock search times
    assert same == {k: v for k, v in Plan.from_json((sim_dir / "plan.json").read_text()).to_dict().items() if k != "notes"}
    real, sim = _jsonl(real_dir / "units.jsonl"), _jsonl(sim_dir / "units.jsonl")
    num_devices = json.loads((real_dir / "summary.json").read_text())["run"]["num_devices"]
    always, ever = _duration_dependent_pairs(plan, num_devices)
    for r, s in zip(real, sim, strict=True):
        assert r["started"] == s["started"], (system, r["iteration"])
        r_pairs, s_pairs = {tuple(p) for p in r["concurrent"]}, {tuple(p) for p in s["concurrent"]}
        assert always <= r_pairs and always <= s_pairs, (system, r["iteration"], always - r_pairs, always - s_pairs)
        assert r_pairs <= ever and s_pairs <= ever, (system, r["iteration"], r_pairs - ever, s_pairs - ever)
    migration = ("gen/migrated_samples", "gen/tail_instances")
    real_m = [{k: row.get(k) for k in migration} for row in _jsonl(real_dir / "metrics.jsonl")]
    sim_m = [{k: row.get(k) for k in migration} for row in _jsonl(sim_dir / "metrics.jsonl")]
    assert real_m == sim_m, system
