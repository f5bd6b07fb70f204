"""Option conflicts of ``backend=ray`` are refused before Ray or any worker starts.

``RayBackend.check`` (run by the runner before the run folder exists, and again by ``setup`` before
Ray starts) refuses every combination of options the backend does not run -- device x machine,
ZeRO-3 engine x installation x mesh, generation engine x installation, pipeline matching x device,
fault injection x devices -- with one ConfigError naming each, and chooses each home layout's ZeRO-3
engine: ``zero3_impl=auto`` takes DeepSpeed whenever it can, in float32 and in bf16 (DeepSpeed's own
bf16 mode; its CPU run is compared with the native ZeRO-3 in test_ray_deepspeed.py). Here ``check``
runs in this process with ``ray.init`` and the workers replaced by failures, over the grid of
device x dtype x zero3_impl x generation engine, with this CPU machine as it is and with a faked
CUDA machine; one refusal runs end to end as a user would see it.
"""
from __future__ import annotations

import importlib.util
import itertools

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from harness.run.pipeline import compose
from harness.backends.ray.config import RayOptions
from harness.backends.ray.driver.options import option_conflicts, zero3_engine
from harness.errors import ConfigError
from harness.run.pipeline import build_context

torch = pytest.importorskip("torch")

BASE = ["+system=deepspeed_chat", "model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x",
        "cluster.num_nodes=1", "cluster.gpus_per_node=2", "logger=none", "logger.progress_bar=false"]
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
VLLM = importlib.util.find_spec("vllm") is not None


def _backend_and_plan(overrides: list[str]):
    run = OmegaConf.to_object(compose(BASE + overrides))
    ctx = build_context(run)
    plan = get_class(run.system.impl)(run.system).plan(ctx)
    return get_class(run.backend._target_)(run.backend, ctx), plan


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Nothing here may start Ray or a worker."""
    def refuse(*a, **kw):
        raise AssertionError("Ray was started")

    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "init", refuse)
    from harness.backends.ray.driver import cluster

    monkeypatch.setattr(cluster.Cluster, "start_ray", refuse)


def fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


GRID = list(itertools.product(["auto", "cpu", "cuda"], ["auto", "fp32", "bf16"], ["auto", "deepspeed", "native"],
                              ["ours", "vllm"]))


KINDS = {"cuda": "needs one CUDA device per worker", "vllm": "vLLM is not installed",
         "deepspeed": "cannot use DeepSpeed"}


@pytest.mark.parametrize("cuda_devices", [0, 1, 2])
def test_every_option_combination_is_run_or_refused_before_ray_starts(monkeypatch, cuda_devices):
    """On a machine with 0, 1 or 2 GPUs (this one, or faked) and 2 devices to run: every combination
    is accepted, with its ZeRO-3 engine chosen, or refused with a ConfigError naming each conflict."""
    fake_cuda(monkeypatch, cuda_devices)
    backend, plan = _backend_and_plan([])
    for device, dtype, zero3, engine in GRID:
        backend.opts = RayOptions(device=device, dtype=dtype, zero3_impl=zero3, generation_engine=engine)
        resolved = device if device != "auto" else ("cuda" if cuda_devices else "cpu")
        expected = {}
        if resolved == "cuda" and cuda_devices < 2:
            expected["cuda"] = (f"backend.options.device={device} needs one CUDA device per worker (2, "
                                f"cluster.num_nodes x cluster.gpus_per_node) but this machine has {cuda_devices}")
        if engine == "vllm" and not VLLM:
            expected["vllm"] = "generation_engine=vllm: vLLM is not installed in this environment"
        if zero3 == "deepspeed" and not DEEPSPEED:
            expected["deepspeed"] = ("backend.options.zero3_impl=deepspeed: task update_actor cannot use DeepSpeed "
                                     "(DeepSpeed is not installed")
        case = (device, dtype, zero3, engine, cuda_devices)
        if expected:
            with pytest.raises(ConfigError) as e:
                backend.check(plan)
            message = str(e.value)
            assert message.startswith("backend=ray cannot run these options: "), (case, message)
            for kind, phrase in KINDS.items():
                assert (phrase in message) == (kind in expected), (case, message)
            for phrase in expected.values():
                assert phrase in message, (case, message)
        else:
            backend.check(plan)  # accepted: the ZeRO-3 engine of every ZeRO-3 home layout is chosen
            impl = "native" if zero3 == "native" or not DEEPSPEED else "deepspeed"
            assert backend.zero3 == {"actor": impl, "critic": impl, "ref": impl, "reward": impl}, case
            assert backend.opts.device == device and backend.opts.dtype == dtype  # resolved later, in setup
        assert backend.group is None


@pytest.mark.skipif(not DEEPSPEED, reason="DeepSpeed is not installed (the dev extra installs it)")
def test_bf16_runs_on_deepspeed_by_default(monkeypatch):
    """What a GPU run of deepspeed_chat gets without options: bf16 (dtype=auto on CUDA) on DeepSpeed
    ZeRO-3 (zero3_impl=auto) -- no longer refused."""
    fake_cuda(monkeypatch, 2)
    backend, plan = _backend_and_plan([])
    backend.check(plan)
    assert backend.cluster.device() == "cuda" and backend.opts.resolved_dtype("cuda") == "bf16"
    assert set(backend.zero3.values()) == {"deepspeed"}


def test_deepspeed_missing_is_refused_before_ray_starts(monkeypatch):
    from harness.real.parallel import zero3

    monkeypatch.setattr(zero3, "deepspeed_available", lambda: False)
    backend, plan = _backend_and_plan(["backend.options.device=cpu", "backend.options.zero3_impl=deepspeed"])
    with pytest.raises(ConfigError, match="task update_actor cannot use DeepSpeed .DeepSpeed is not installed"):
        backend.check(plan)
    backend, plan = _backend_and_plan(["backend.options.device=cpu"])  # auto: the native ZeRO-3 instead
    backend.check(plan)
    assert set(backend.zero3.values()) == {"native"}


def test_zero3_engine_choice():
    assert zero3_engine("auto", "t", 4, 4, True) == ("deepspeed", None)
    assert zero3_engine("deepspeed", "t", 4, 4, True) == ("deepspeed", None)
    assert zero3_engine("native", "t", 4, 4, True) == ("native", None)
    assert zero3_engine("auto", "t", 2, 4, True) == ("native", None)  # a mesh of some devices: native
    assert zero3_engine("auto", "t", 4, 4, False) == ("native", None)
    impl, why = zero3_engine("deepspeed", "t", 2, 4, True)
    assert impl == "native" and "task t cannot use DeepSpeed (its mesh has 2 of the 4 devices" in why
    impl, why = zero3_engine("deepspeed", "t", 4, 4, False)
    assert "DeepSpeed is not installed" in why


def test_other_conflicts():
    n = 4
    assert option_conflicts(RayOptions(), "cpu", n) == []
    assert option_conflicts(RayOptions(), None, n, None) == []  # device unknown yet (joining a cluster)
    assert option_conflicts(RayOptions(device="cuda"), "cuda", n, None) == []  # a cluster: checked at placement
    [msg] = option_conflicts(RayOptions.from_config({"fault_injection": {"task": "gen", "device": 4}}), "cpu", n)
    assert "fault_injection.device=4: the run has devices 0-3" in msg
    problems = option_conflicts(RayOptions(torch_threads=0, task_timeout_s=0), "cpu", n)
    assert [p.split(":")[0] for p in problems] == ["backend.options.torch_threads=0",
                                                   "backend.options.task_timeout_s=0"]
    if hasattr(RayOptions(), "p2p_matching"):  # pipeline messages matched by tags: gloo only
        [msg] = option_conflicts(RayOptions(p2p_matching="tags"), "cuda", n, 4)
        assert "p2p_matching=tags on CUDA" in msg
        assert option_conflicts(RayOptions(p2p_matching="tags"), "cpu", n) == []


def test_joining_a_cluster_checks_the_device_once_known(monkeypatch):
    """device=auto on a cluster is known once joined: check() defers device conflicts, and setup
    runs check_options again with the resolved device before any worker starts."""
    backend, plan = _backend_and_plan(["backend.address=auto", "backend.options.fault_injection.device=9"])
    assert backend.cluster.device() is None
    with pytest.raises(ConfigError, match="fault_injection.device=9"):
        backend.check(plan)
    backend, plan = _backend_and_plan(["backend.address=auto"])
    backend.check(plan)
    backend.check_options(plan, "cuda")  # a cluster's GPUs: counted when the devices are placed


def test_conflict_ends_the_run_before_ray_starts(run_harness, tmp_path):
    proc = run_harness(BASE + ["backend.options.device=cuda", "backend.options.fault_injection.device=5"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [s for s in proc.stderr.splitlines() if s.strip()]
    assert line.startswith("error: backend=ray cannot run these options: backend.options.device=cuda needs one "
                           "CUDA device per worker (2, cluster.num_nodes x cluster.gpus_per_node) but this "
                           "machine has 0") or torch.cuda.device_count() >= 2, line
    assert "fault_injection.device=5" in line
    assert "workers (" not in proc.stdout and "Ray" not in proc.stdout
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").rglob("summary.json"))


def test_stream_rounds_is_checked_when_the_options_are_built():
    assert RayOptions().stream_rounds == "to_next_finish"
    assert RayOptions(stream_rounds="one_step").stream_rounds == "one_step"
    with pytest.raises(ConfigError, match="stream_rounds='every_token'.*to_next_finish, one_step"):
        RayOptions(stream_rounds="every_token")


def test_vllm_takes_the_plans_memory_share_on_cuda_only():
    """A system's generation memory share (NeMo-RL's gpu_memory_utilization, plan data the simulator
    sizes the KV cache with) is vLLM's on CUDA; on CPU vLLM's share is of host memory, so the
    backend option stays, as it does for a plan without a share."""
    from harness.backends.ray.config import VllmOptions
    from harness.backends.ray.driver.cluster import vllm_memory_share
    from harness.testing import plan_for

    plan, _, _ = plan_for(["+system=nemo_rl", "algo=grpo", "model=tiny", "workload=tiny", "cluster=h100_8x",
                           "cluster.num_nodes=1", "system.gpu_memory_utilization=0.8"])
    share = plan.generation.memory_frac
    assert share == 0.8
    option = VllmOptions(gpu_memory_utilization=0.3)
    assert vllm_memory_share(option, share, "cuda").gpu_memory_utilization == 0.8
    assert vllm_memory_share(option, share, "cuda").enforce_eager == option.enforce_eager
    assert vllm_memory_share(option, share, "cpu") == option
    assert vllm_memory_share(option, None, "cuda") == option
