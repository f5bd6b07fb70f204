"""backend=ray in bf16 on CPU workers (the mixed-precision path CUDA runs by default), with tensor-
and pipeline-parallel layouts, freeing of copies whose phase has ended, and per-worker memory.

One run of rlhfuse_base on 4 CPU workers, ``backend.options.dtype=bf16``, actor training pinned to
dp1tp2pp2 and generation to dp2tp2pp1 (so a tp=2 generation copy of the actor is filled by a
weight movement in bf16 every iteration and freed after generation, as the plan does not keep it
resident; likewise the critic's inference copy). Checks: the run completes in bf16; every
iteration frees exactly those two copies; each worker reports its peak model state and RSS; and the
trained weights stay within bf16 rounding plus the update of the float32 initial weights (a wrong
dtype anywhere on the wire would give garbage, not a small distance).
"""
from __future__ import annotations

import json

import pytest

from tests.helpers import run_in_process

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.ray

ARGS = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=1",
        "cluster.gpus_per_node=4", "logger=none", "logger.progress_bar=false", "backend.num_iterations=2",
        "backend.options.dtype=bf16", "backend.options.dump_weights_dir=w", "system.layouts.update_actor=dp1tp2pp2",
        "system.layouts.gen=dp2tp2pp1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("bf16")
    proc = run_in_process(ARGS, cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [summary] = cwd.glob("results/default/*/tiny/seed0/summary.json")
    return cwd, proc, summary.parent


def test_bf16_run_frees_transient_copies_and_reports_memory(run):
    cwd, proc, folder = run
    assert "4 workers (cpu, gloo, bf16)" in proc.stdout + proc.stderr
    plan = json.loads((folder / "plan.json").read_text())
    strategies = {t["name"]: t["allocation"]["strategy"] for t in plan["tasks"]}
    assert (strategies["update_actor"]["tp"], strategies["update_actor"]["pp"]) == (2, 2)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["perf/freed_copies"] == 2  # actor's generation copy, critic's inference copy
        assert row["perf/freed_copy_gb"] > 0
        for d in range(4):
            assert 0 < row[f"perf/model_state_gb/dev{d}"] < 0.05
            assert row[f"perf/peak_rss_gb/dev{d}"] > row[f"perf/model_state_gb/dev{d}"]


def test_bf16_weights_stay_close_to_the_initial_model(run):
    from harness.backends.ray.driver.experience import stable_seed
    from harness.real.model import LlamaModel, ModelArgs, load_llama_config

    cwd, _, _ = run
    state = torch.load(cwd / "w" / "actor.pt")
    init = LlamaModel(ModelArgs.from_llama_config(load_llama_config("tiny")), seed=stable_seed("init", 0, "actor"))
    full = init.state_dict()
    diff = torch.cat([(state[n] - full[n]).reshape(-1) for n in sorted(full)]).norm()
    norm = torch.cat([full[n].reshape(-1) for n in sorted(full)]).norm()
    assert 0 < diff / norm < 2e-2, float(diff / norm)  # bf16 rounding (~2^-9 relative) + two small updates
