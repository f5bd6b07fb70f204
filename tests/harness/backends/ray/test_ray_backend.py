"""backend=ray end to end: real PPO iterations on CPU worker processes, through ``python -m harness``.

One module-scoped set of runs (3 iterations each, tiny models, 4-8 devices) serves several checks.
The README's commands run as a user types them, in a new interpreter that starts its own Ray; the
others run the same entry point in this process (:func:`tests.helpers.run_in_process`) on one Ray
instance for the module, which saves each the seconds of an interpreter and a Ray start:

- every run writes its results (summary with throughput, stage times and RL metrics);
- **the README's three CPU commands** (``model=tiny workload=tiny backend=ray`` on 4 devices:
  deepspeed_chat, rlhfuse_base, rlhfuse) run as written, plus :data:`BOOKKEEPING` (no logger, no
  progress bar, the final weights dumped). They solve the same optimisation problem:
  DeepSpeed-Chat's derived mini-batch is the workload's 4 (one sample per GPU per micro-step), so
  each iteration takes two gradient steps as the others do;
- **same seed, same weights**: those three (DeepSpeed ZeRO-3, or our own ZeRO-3 when DeepSpeed is
  not installed, with hybrid-engine generation; RLHFuse-Base's searched layouts with pp=2
  training; RLHFuse with both fusions) end three iterations with the same actor and critic
  weights (every later iteration generates with weights that training updated and weight
  movements delivered); so do, on a long-tailed workload, RLHFuse with streaming, migration and
  the fused pipeline, rlhfuse_base with pinned tp=4 generation / actor training and pp=2 critic
  inference, and deepspeed_chat with our own ZeRO-3 and micro-batches of 1. Tolerance: relative L2 distance
  below 1e-6 and below 1% of the run's update. The layouts change float summation order only
  (measured differences: ~1e-8 relative); a change of math (e.g. one mini-batch instead of two)
  moves the weights by ~2e-4 relative, about the size of the update;
- ``summary.json``'s ``final_weights`` is the last iteration's digest of each trained model's full
  weights (:func:`harness.real.digest.weights_digest`), equal to the digest of the dumped weights;
  its SHA-256 is recomputed here from the definition in :func:`harness.real.digest.weights_sha256`'s
  docstring;
- workers end cleanly (barrier + destroy_process_group, nothing aborts);
- a worker that dies mid-iteration fails the run within seconds with an error naming it.

What the driver does with its workers' answers -- which calls it issues in which order, units on
disjoint devices started together, the stream handing finished samples to inference, a failed
worker named by its task -- is tested in-process, without Ray, in test_driver.py; the runs here
check what needs real workers.
"""
from __future__ import annotations

import csv
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import flat_weights, local_ray, readme_command, run_folder, run_in_process

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

# the module's runs start in the first test's setup: 12 runs of a few tens of seconds each, every one
# bounded by its own subprocess timeout, above pytest-timeout's 900 s per test on a loaded 2-core machine
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1800)]

BOOKKEEPING = ["logger=none", "logger.progress_bar=false", "backend.options.dump_weights_dir=w"]
COMMON = ["model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=1", *BOOKKEEPING]
README_SYSTEMS = ("deepspeed_chat", "rlhfuse_base", "rlhfuse")


# The README's commands run as written (with BOOKKEEPING); the others with COMMON.
RUNS = {system: readme_command(system) for system in README_SYSTEMS}
# A long-tailed workload (16 samples, heavy tail), where RLHFuse's long-tail migration has work to
# do: both fusions on, four generation instances, R_t = 25% of the batch. RLHFuse-Base runs it with
# pinned tensor- and pipeline-parallel layouts, DeepSpeed-Chat with our own ZeRO-3 and micro-batches
# of 1: the layouts and engines whose math test_rlhfuse_with_both_fusions_changes_the_schedule_not_the_math
# compares.
# Seed 1: the simulator migrates one sequence in iterations 1 and 2 of this plan (none in 0).
LONG_TAIL = ["cluster.gpus_per_node=4", "workload.global_batch_size=16", "workload.output_len.sigma=1.0",
             "workload.max_gen_len=24", "workload.output_len.max=24", "seed=1"]
RUNS.update({
    "rlhfuse_both": ["+system=rlhfuse", *LONG_TAIL, "system.fused_search.max_steps=200", "system.migration_frac=0.25",
                     "system.layouts.gen=dp4tp1pp1"],
    "rlhfuse_base_long_tail": ["+system=rlhfuse_base", *LONG_TAIL, "system.layouts.gen=dp1tp4pp1",
                               "system.layouts.update_actor=dp1tp4pp1", "system.layouts.values=dp2tp1pp2"],
    "deepspeed_chat_long_tail": ["+system=deepspeed_chat", *LONG_TAIL,
                                 "system.mini_batch_size=4", "system.generation_batch_size=16",
                                 "workload.micro_batch_size=1", "backend.options.zero3_impl=native"],
})
# Every other system backend=ray runs, on the same long-tailed workload (2 iterations: the first
# without migration, the second with): with the three above, the runs the sim-vs-real parity test
# compares with the simulator.
PARITY_RUNS = {"rlhfuse": "rlhfuse_both", "rlhfuse_base": "rlhfuse_base_long_tail",
               "deepspeed_chat": "deepspeed_chat_long_tail"}
for _system, _extra in {"interleaved": [], "realhf": [], "realhf_heuristic": [], "disaggregated": [],
                        "colocated": ["system.layout=dp2tp2pp1"], "openrlhf": ["cluster.gpus_per_node=8"]}.items():
    _keys = {e.split("=")[0] for e in _extra}
    RUNS[f"{_system}_long_tail"] = [f"+system={_system}", *(a for a in LONG_TAIL if a.split("=")[0] not in _keys), *_extra,
                                     "backend.num_iterations=2"]
    PARITY_RUNS[_system] = f"{_system}_long_tail"
ABORT = re.compile(r"terminate called|Aborted|core dumped|SIGABRT|destroy_process_group\(\) was not called", re.I)


def with_common(args: list[str]) -> list[str]:
    """COMMON overrides, unless ``args`` sets the same key; a README command as written, with BOOKKEEPING."""
    keys = {a.split("=", 1)[0] for a in args}
    common = BOOKKEEPING if args in (RUNS[s] for s in README_SYSTEMS) else COMMON
    return [c for c in common if c.split("=", 1)[0] not in keys] + args


@pytest.fixture(scope="module")
def ray_logs(tmp_path_factory):
    """The runs' worker logs: the README's commands run as written in a subprocess, each starting and
    stopping its own Ray, whose workers' output ends in its stderr; the others run in this process
    (:func:`tests.helpers.run_in_process`) on one Ray instance, whose workers' log files are read
    here once every run has ended."""
    with local_ray() as logs_dir:
        yield logs_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_harness, ray_logs):
    root = tmp_path_factory.mktemp("ray_runs")
    out = {}
    for name, args in RUNS.items():
        if name in README_SYSTEMS:
            out[name] = (root / name, run_harness(with_common(args), root / name, timeout=600))
        else:
            out[name] = (root / name, run_in_process(with_common(args), root / name))
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_runs_write_results(runs, name):
    cwd, proc = runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = run_folder(cwd)
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
    expected = 16 if "workload.global_batch_size=16" in RUNS[name] else 8  # the tiny workload's batch
    assert len(rows) == expected and all(int(r["response_len"]) >= 1 for r in rows)
    assert (folder / "trace.json").is_file() and (folder / "metrics.jsonl").is_file()


def test_rlhfuse_base_plans_exercise_pipeline_and_tensor_parallelism(runs):
    plans = {n: json.loads((run_folder(runs[n][0]) / "plan.json").read_text()) for n in RUNS}
    strategies = {n: {t["name"]: t["allocation"]["strategy"] for t in p["tasks"]} for n, p in plans.items()}
    assert strategies["rlhfuse_base"]["update_actor"]["pp"] == 2
    assert strategies["rlhfuse_base_long_tail"]["update_actor"]["tp"] == 4
    assert strategies["rlhfuse_base_long_tail"]["values"]["pp"] == 2
    assert strategies["deepspeed_chat"]["update_actor"]["zero_stage"] == 3
    assert "ZeRO-3 by native" in runs["deepspeed_chat_long_tail"][1].stdout


def _summary(runs, name: str) -> dict:
    return json.loads((run_folder(runs[name][0]) / "summary.json").read_text())


def _state(runs, name: str, role: str) -> dict[str, torch.Tensor]:
    return torch.load(runs[name][0] / "w" / f"{role}.pt")


def test_readme_commands_use_the_same_mini_batches(runs):
    plans = {s: json.loads((run_folder(runs[s][0]) / "plan.json").read_text()) for s in README_SYSTEMS}
    assert {s: p["mini_batch_size"] for s, p in plans.items()} == dict.fromkeys(README_SYSTEMS, 4)
    # DeepSpeed-Chat: one sample per GPU per micro-step (the workload's micro-batch is 2)
    assert {stage["micro_batch_size"] for stage in plans["deepspeed_chat"]["training"]} == {1}


def test_same_seed_same_weights_across_systems(runs):
    for role in ("actor", "critic"):
        ref = flat_weights(_state(runs, "deepspeed_chat", role))
        final = _summary(runs, "deepspeed_chat")["final_weights"]["models"][role]
        update = final["update_l2"]
        assert update > 1e-3  # three iterations did move the weights
        for other in ("rlhfuse_base", "rlhfuse"):
            diff = float((flat_weights(_state(runs, other, role)) - ref).norm())
            assert diff < 1e-6 * float(ref.norm()), (role, other, diff)
            assert diff < 1e-2 * update, (role, other, diff, update)
            # what a user compares without dumping weights: the summaries' final digests
            theirs = _summary(runs, other)["final_weights"]["models"][role]
            assert final["num_params"] == theirs["num_params"]
            assert abs(final["l2"] - theirs["l2"]) < 1e-6 * final["l2"], (role, other)
            assert abs(final["update_l2"] - theirs["update_l2"]) < 1e-2 * final["update_l2"], (role, other)


def sha256_by_definition(state: dict[str, torch.Tensor]) -> str:
    """weights_sha256's docstring, written out independently: per entry in sorted-name order, the
    UTF-8 name, a zero byte, then the values as little-endian float32 in row-major order."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode("utf-8"))
        h.update(b"\x00")
        h.update(np.ascontiguousarray(state[name].float().numpy(), dtype="<f4").tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("system", README_SYSTEMS)
def test_summary_records_the_final_weights(runs, system):
    from harness.real.digest import weights_sha256

    summary = _summary(runs, system)
    final = summary["final_weights"]
    metrics = [json.loads(line) for line in (run_folder(runs[system][0]) / "metrics.jsonl").read_text().splitlines()]
    assert final["iteration"] == len(metrics) - 1 == 2  # the last of the README's 3 iterations
    assert set(final["models"]) == {"actor", "critic"}
    for role, digest in final["models"].items():
        state = _state(runs, system, role)  # dumped after the last iteration
        flat = flat_weights(state)
        assert digest["sha256"] == sha256_by_definition(state) == weights_sha256(state), (system, role)
        assert digest["num_params"] == flat.numel()
        assert digest["sum"] == pytest.approx(float(flat.sum()), rel=1e-12, abs=1e-12)
        assert digest["l2"] == pytest.approx(float(flat.norm()), rel=1e-12)
        # the last iteration's counters, not the average that summary.json's metrics hold
        assert digest["l2"] == metrics[-1][f"rl/{role}_param_l2"]
        assert digest["update_l2"] == metrics[-1][f"rl/{role}_update_l2"]
        assert summary["metrics"][f"rl/{role}_update_l2"] != digest["update_l2"]  # averaged over 2 iterations


def test_hash_is_exact_not_tolerant(runs):
    """Identical weights hash identically; a change in the last bit of one value changes the hash
    (which is why systems are compared by their floats, not their hashes)."""
    from harness.real.digest import weights_sha256

    state = _state(runs, "rlhfuse_base", "actor")
    assert weights_sha256({n: t.clone() for n, t in state.items()}) == weights_sha256(state)
    name = sorted(state)[0]
    nudged = dict(state, **{name: torch.nextafter(state[name], torch.full_like(state[name], np.inf))})
    assert weights_sha256(nudged) != weights_sha256(state)


def test_fused_stage_runs_the_fused_schedule_on_every_rank(runs):
    """Each device runs its logical rank's actions of the plan's fused schedule, actor and critic
    interleaved, in the schedule's order, once per mini-batch (a driver that trained the models one
    after the other would give every device all of one model's actions first)."""
    from harness.core.plan import Plan
    from harness.planning.taskmodels.passes import pipe_stage_devices

    folder = run_folder(runs["rlhfuse"][0])
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
        ref = flat_weights(runs["rlhfuse_base_long_tail"][0] / "w" / f"{role}.pt")
        for other in ("rlhfuse_both", "deepspeed_chat_long_tail"):
            w = flat_weights(runs[other][0] / "w" / f"{role}.pt")
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

    folder = run_folder(runs["rlhfuse_both"][0])
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


def test_workers_shut_down_cleanly(runs, ray_logs):
    for name, (_, proc) in runs.items():
        assert "workers shut down cleanly" in proc.stdout, name
        assert not ABORT.search(proc.stderr), (name, ABORT.search(proc.stderr))
    worker_logs = sorted(ray_logs.glob("worker-*"))
    assert worker_logs, ray_logs  # the in-process runs' workers wrote here
    for log in worker_logs:
        assert not ABORT.search(log.read_text(errors="replace")), (log, ABORT.search(log.read_text(errors="replace")))


# A hang surfaces as a task timeout ("did not finish within ... backend.options.task_timeout_s"),
# never as a death; HANG_BOUND is the fault runs' task timeout, far above a task's seconds here and
# below the subprocess's limit, so a run that waits on its dead peer fails with that line.
HANG_BOUND = ["backend.options.task_timeout_s=300"]


def test_dead_worker_fails_fast_with_a_clear_error(ray_logs, tmp_path):
    """Device 1 dies as it starts update_actor while its peers wait for it in collectives; the run
    must end with the death named, not wait for the task timeout (a hang's bound)."""
    args = [a for a in with_common(RUNS["rlhfuse_base"]) if not a.startswith("backend.options.dump_weights_dir=")]
    proc = run_in_process(args + HANG_BOUND + ["backend.options.fault_injection={task:update_actor,device:1}"], tmp_path)
    assert proc.returncode != 0
    assert "task update_actor: the worker of device 1" in proc.stderr and "died" in proc.stderr
    assert "did not finish within" not in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("results/**/summary.json"))  # a failed run leaves no result


@pytest.mark.parametrize("where,fault,task", [
    ("mid-migration", "{task:gen,op:migrate,device:2}", "gen"),
])
def test_dead_worker_during_fusion_fails_fast(ray_logs, tmp_path, where, fault, task):
    """A worker dying inside a fused mechanism ends the run within a bounded time, naming the task
    and the device, and leaves no finished result: mid-migration, while its peers wait for its KV
    shards in a point-to-point exchange. (A death in a training collective is the test above; which
    task a death mid-stream or in a fused pipeline is charged to is the driver's, tested in-process
    in test_driver.py.)"""
    device = fault.rsplit("device:", 1)[1].rstrip("}") if "device:" in fault else r"\d+"
    proc = run_in_process(with_common(RUNS["rlhfuse_both"] + HANG_BOUND + [f"backend.options.fault_injection={fault}"]),
                          tmp_path)
    assert proc.returncode != 0, where
    assert re.search(rf"task {re.escape(task)}: the worker of device {device} \(pid \d+\) died", proc.stderr), \
        proc.stderr[-2000:]
    assert "did not finish within" not in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("results/**/summary.json"))


def test_unsupported_plan_is_refused_before_workers_start(ray_logs, tmp_path):
    proc = run_in_process(COMMON + ["+system=rlhfuse_base", "cluster.gpus_per_node=4", "system.layouts.gen=dp2tp1pp2"],
                          tmp_path)
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
def test_real_run_and_simulation_of_the_same_plan_agree(runs, tmp_path, system):
    """backend=ray and backend=sim run the same plan through the one scheduler: per iteration they
    start the units in the same order and migrate the same samples; the pairs of units that run at
    the same time are the same, except pairs whose overlap the plan leaves to the units' durations
    (real and predicted durations differ), and every pair the real run overlapped is one the
    scheduler allows."""
    from harness.core.plan import Plan

    name = PARITY_RUNS[system]
    cwd, proc = runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    real_dir = run_folder(cwd)
    args = [a for a in with_common(RUNS[name]) if not a.startswith("backend")]
    sim_proc = run_in_process([*args, "backend.num_iterations=" + str(len(_jsonl(real_dir / "units.jsonl")))],
                              tmp_path)
    assert sim_proc.returncode == 0, sim_proc.stderr[-3000:]
    sim_dir = run_folder(tmp_path)
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
