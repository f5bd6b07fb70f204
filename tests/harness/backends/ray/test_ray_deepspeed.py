"""DeepSpeed ZeRO-3 against our own ZeRO-3: one deepspeed_chat iteration on two
CPU workers (gloo, ``DS_ACCELERATOR=cpu``), same seed and data, once with DeepSpeed
(``backend.options.zero3_impl=deepspeed``: the run fails rather than fall back if DeepSpeed cannot be
used) and once with the native fallback (``zero3_impl=native``), then the actor and critic weights
after the iteration are compared.

Tolerance: relative L2 distance ``|w_ds - w_native| / |w_native| < 1e-6`` and
``|w_ds - w_native| < 1e-2 * |update|`` (the distance the iteration moved the weights). Both paths
compute the same fp32 math: the same summed gradient (DeepSpeed averages over dp and divides by the
accumulation steps; its replica multiplies the loss by dp * gas, powers of two here, so exactly) and
the same Adam. What differs is float summation order (DeepSpeed reduce-scatters per-parameter
partitions, we reduce one flat buffer; gather order), i.e. a few ulps per gradient element, which
Adam's normalised step turns into relative differences of the same order in the update
(measured: at most 8e-9 of the weights and 3e-5 of the update, docs/CHECKPOINTS.md: far inside both
bounds, which are those of the cross-system same-weights test in test_ray_backend.py). The control is a
run that changes the math slightly but really -- the native path with one optimizer step on the
whole batch (``system.mini_batch_size=8``) instead of two steps on halves -- which moves the
weights by about the size of the update itself (measured: 0.67-0.73 of it), orders of magnitude beyond
the tolerance.

bf16: the same iteration in bf16 (``backend.options.dtype=bf16``, the default on
CUDA) with the default ``zero3_impl=auto``, which now takes DeepSpeed in its own bf16 mode (bf16
parameters, float32 master weights, Adam states, gradient reduction and accumulation;
harness/real/parallel/zero3.py), against the native ZeRO-3 in bf16. The weights compared are the
bf16 parameters, so a difference is whole bf16 ulps of single elements (about 2^-8 of the element,
some 2% of this iteration's actor update each); measured: bitwise equal (0) for actor and critic,
while the control's change of math moves the (fp32) weights by 0.64-0.97 of the bf16 update.
Tolerance: 10% of the update (about a dozen flipped roundings), well below the control. DeepSpeed's CPU accelerator supports bf16
(``is_bf16_supported``); a one-process check shows the engine's parameters are bf16 and its master
partition and Adam states float32.

CI installs DeepSpeed (README's test command, ``.[dev]``), so this runs there; without DeepSpeed it
is skipped.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.helpers import flat_weights, local_ray, run_in_process

pytest.importorskip("ray")
torch = pytest.importorskip("torch")
if importlib.util.find_spec("deepspeed") is None:  # found, not imported (the workers import it)
    pytest.skip("DeepSpeed is not installed (the dev extra installs it)", allow_module_level=True)

pytestmark = pytest.mark.ray

COMMON = ["+system=deepspeed_chat", "model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x",
          "cluster.num_nodes=1", "cluster.gpus_per_node=2", "logger=none", "logger.progress_bar=false",
          "backend.num_iterations=1", "backend.num_warmup_iterations=0", "system.generation_batch_size=8", "backend.options.dump_weights_dir=w"]
RUNS = {
    "deepspeed": ["system.mini_batch_size=4", "backend.options.zero3_impl=deepspeed"],
    "native": ["system.mini_batch_size=4", "backend.options.zero3_impl=native"],
    # control: one optimizer step on all 8 samples instead of two on 4 (a real change of math)
    "control": ["system.mini_batch_size=8", "backend.options.zero3_impl=native"],
    # bf16: zero3_impl=auto (DeepSpeed's own bf16 mode), against the native ZeRO-3 in bf16
    "deepspeed_bf16": ["system.mini_batch_size=4", "backend.options.dtype=bf16"],
    "native_bf16": ["system.mini_batch_size=4", "backend.options.dtype=bf16", "backend.options.zero3_impl=native"],
}
REL_TOL = 1e-6  # of the weights' norm
UPDATE_TOL = 1e-2  # of the iteration's update
BF16_UPDATE_TOL = 0.1  # of the iteration's update (bf16 weights: whole ulps of single elements)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_runs")
    out = {}
    with local_ray():
        for name, args in RUNS.items():
            proc = run_in_process(COMMON + args, root / name)
            assert proc.returncode == 0, (name, proc.stderr[-3000:])
            out[name] = (root / name, proc)
    return out


def _initial(role: str) -> torch.Tensor:
    """The seeded initial weights of ``role`` (seed 0), as the backend builds them."""
    from harness.backends.ray.driver.homes import role_seeds
    from harness.real.model import LlamaModel, ModelArgs, load_llama_config

    args = {r: ModelArgs.from_llama_config(load_llama_config("tiny"), value_head=r in ("critic", "reward"))
            for r in ("actor", "critic", "ref", "reward")}
    state = LlamaModel(args[role], seed=role_seeds(0, args)[role]).state_dict()
    return torch.cat([state[n].reshape(-1).double() for n in sorted(state)])


def test_runs_use_the_zero3_engine_asked_for(runs):
    assert "ZeRO-3 by deepspeed" in runs["deepspeed"][1].stdout
    assert "ZeRO-3 by native" in runs["native"][1].stdout
    assert "2 workers (cpu, gloo, bf16) on 1 node, ZeRO-3 by deepspeed" in runs["deepspeed_bf16"][1].stdout
    assert "2 workers (cpu, gloo, bf16) on 1 node, ZeRO-3 by native" in runs["native_bf16"][1].stdout


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_deepspeed_and_native_zero3_give_the_same_weights(runs, role):
    ds = flat_weights(runs["deepspeed"][0] / "w" / f"{role}.pt")
    native = flat_weights(runs["native"][0] / "w" / f"{role}.pt")
    control = flat_weights(runs["control"][0] / "w" / f"{role}.pt")
    update = float((native - _initial(role)).norm())
    assert update > 1e-4, update  # the iteration moved the weights
    diff = float((ds - native).norm())
    control_diff = float((control - native).norm())
    print(f"{role}: |w|={float(native.norm()):.4g} update={update:.3g} ds-native={diff:.3g} "
          f"({diff / float(native.norm()):.2g} of |w|, {diff / update:.2g} of the update); "
          f"control-native={control_diff:.3g} ({control_diff / update:.2g} of the update)")
    assert diff < REL_TOL * float(native.norm()), (role, diff)
    assert diff < UPDATE_TOL * update, (role, diff, update)
    # the control shows the comparison can fail: a real change of math is far outside the tolerance
    assert control_diff > 100 * max(diff, 1e-12) and control_diff > UPDATE_TOL * update, (role, control_diff)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_deepspeed_bf16_and_native_bf16_give_the_same_weights(runs, role):
    ds = flat_weights(runs["deepspeed_bf16"][0] / "w" / f"{role}.pt")
    native = flat_weights(runs["native_bf16"][0] / "w" / f"{role}.pt")
    fp32 = flat_weights(runs["native"][0] / "w" / f"{role}.pt")
    control = flat_weights(runs["control"][0] / "w" / f"{role}.pt")
    init = _initial(role)
    update = float((native - init.float().bfloat16().double()).norm())
    assert update > 1e-4, update
    diff = float((ds - native).norm())
    print(f"{role} bf16: update={update:.3g} ds-native={diff:.3g} ({diff / update:.2g} of the update); "
          f"bf16-fp32={float((native - fp32).norm()):.3g}; control-native(fp32)={float((control - fp32).norm()):.3g}")
    assert diff < BF16_UPDATE_TOL * update, (role, diff, update)
    # the runs are bf16: their weights are bf16 values, unlike the fp32 run's
    assert torch.equal(native.float().bfloat16().double(), native) and torch.equal(ds.float().bfloat16().double(), ds)
    assert not torch.equal(fp32.float().bfloat16().double(), fp32)
    # a real change of math (fp32 control vs fp32) is far outside the bf16 tolerance
    assert float((control - fp32).norm()) > 5 * BF16_UPDATE_TOL * update


PROBE = r"""
import json, sys
import torch
from harness.real.parallel.comm import Groups
from harness.backends.ray.settings import WorkerOptions
from harness.backends.ray.worker.device import DeviceWorker
from harness.core.plan import Allocation, ParallelStrategy
from harness.real.model import LlamaModel, ModelArgs, load_llama_config

worker = DeviceWorker(0, 1, WorkerOptions(device="cpu", dtype="bf16"))  # sets DS_ACCELERATOR=cpu
worker.init_distributed("127.0.0.1", int(sys.argv[1]), 60.0)
from harness.real.parallel.zero3 import DeepSpeedReplica

args = ModelArgs.from_llama_config(load_llama_config("tiny"))
r = DeepSpeedReplica("actor", args, Allocation((0,), ParallelStrategy(1, 1, 1, zero_stage=3)), 0,
                     Groups(0, 1, [], worker.device), worker.device, LlamaModel(args, seed=1).state_dict(),
                     {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}, 1, 1, dtype=worker.dtype)
r.set_train(True)
out = r(torch.randint(0, args.vocab_size, (2, 8)))
r.backward(out.float().pow(2).mean())
r.micro_step()
opt = r.engine.optimizer
master = torch.cat([t.reshape(-1) for t in opt.fp32_partitioned_groups_flat])
params = torch.cat([t.reshape(-1) for t in opt.fp16_partitioned_groups_flat])
print("PROBE " + json.dumps({
    "config_bf16": r.engine.bfloat16_enabled(), "output": str(out.dtype),
    "params": sorted({str(p.dtype) for p in r.module.parameters()}),
    "master": sorted({str(t.dtype) for t in opt.fp32_partitioned_groups_flat}),
    "adam": sorted({str(v.dtype) for s in opt.optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.numel() > 1}),
    "master_finer_than_params": bool((master != params.float()).any()),
    "params_are_rounded_master": bool(torch.equal(master.bfloat16(), params.bfloat16())),
}))
worker.shutdown()
"""


def test_deepspeed_bf16_engine_keeps_float32_master_and_adam_states(tmp_path):
    """DeepSpeed's own bf16 mode as the DeepSpeedReplica configures it, on the CPU accelerator: bf16
    parameters and compute, float32 master partition and Adam states, parameters the master rounded."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[4]
    proc = subprocess.run([sys.executable, "-c", PROBE, str(port)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert got == {"config_bf16": True, "output": "torch.bfloat16", "params": ["torch.bfloat16"],
                   "master": ["torch.float32"], "adam": ["torch.float32"], "master_finer_than_params": True,
                   "params_are_rounded_master": True}, got
