"""``backend.address=auto``: the driver joins a Ray cluster started from the command line instead of
starting its own, and places one worker per device on it.

The cluster has two nodes on this machine, each a separate ``ray start`` (a head with 2 CPUs and a
worker node with 2 CPUs joining it), so the run's 4 devices span both nodes: the placement group
packs ranks 0-1 on one node and 2-3 on the other, and torch.distributed rendezvouses over the
nodes' IP. Each ``ray start`` runs with ``--block`` in its own process group, which this test
kills at the end, pass or fail (never ``ray stop``, which would stop every Ray on the machine).

The converse: with ``backend.address`` null (the default) the driver starts a Ray instance of its
own even while a cluster runs on the machine that a plain ``ray.init()`` would join (found through
the address file ``ray start --head`` writes, or through ``RAY_ADDRESS``): the README's tiny ray
command runs beside such a cluster without touching it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

pytestmark = pytest.mark.ray

RUN = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x", "cluster.num_nodes=2",
       "cluster.gpus_per_node=2", "logger=none", "logger.progress_bar=false", "backend.num_iterations=1",
       "backend.num_warmup_iterations=0", "backend.address=auto"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


def _stop(proc: subprocess.Popen) -> None:
    """Stop one ``ray start --block`` and everything in its process group (GCS, raylet, workers):
    SIGINT (Ctrl-C in the terminal that runs it, which it answers by stopping its processes, in a
    second or two on an idle machine; SIGTERM to the group took 10 s), 3 s of grace, then SIGKILL to
    the group (a throw-away cluster: nothing checks that it stops cleanly)."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=3)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _kill_leftovers(temp: str) -> None:
    """Processes of this test's cluster that left its process groups (their command lines name
    the cluster's own temp dir), by pid."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if temp in args and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def cluster(tmp_path):
    """``(address, env)`` of a 2-node local Ray cluster (2 CPUs each), stopped at the end."""
    temp = tempfile.mkdtemp(prefix="/tmp/rc")  # short: Ray's socket paths must stay under 108 bytes
    port = _free_port()
    # token authentication off: a throw-away cluster of this machine, which the test alone uses
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST_"))},
           "RAY_AUTH_MODE": "disabled"}
    procs = []
    logs = []
    try:
        head_log = open(tmp_path / "head.log", "w")
        logs.append(head_log)
        procs.append(subprocess.Popen(
            [_ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0", "--block",
             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
            stdout=head_log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        address = f"127.0.0.1:{port}"
        _wait_for_cpus(address, 2, env, procs, tmp_path / "head.log")
        node_log = open(tmp_path / "node.log", "w")
        logs.append(node_log)
        procs.append(subprocess.Popen(
            [_ray_cli(), "start", f"--address={address}", "--num-cpus=2", "--num-gpus=0", "--block",
             "--disable-usage-stats"],
            stdout=node_log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        _wait_for_cpus(address, 4, env, procs, tmp_path / "node.log")
        yield address, {**env, "RAY_ADDRESS": address}
    finally:
        for proc in reversed(procs):
            _stop(proc)
        _kill_leftovers(temp)
        for f in logs:
            f.close()
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_cpus(address: str, cpus: int, env: dict, procs: list, log: Path, timeout: float = 40.0) -> None:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(int(ray.cluster_resources().get('CPU', 0)), len(ray.nodes()))")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"ray start exited: {log.read_text()[-2000:]}")
        out = subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True, text=True,
                             timeout=30)
        if out.returncode == 0 and int(out.stdout.split()[0]) >= cpus:
            return
        time.sleep(1.0)
    pytest.fail(f"the cluster at {address} did not reach {cpus} CPUs in {timeout:.0f} s: {log.read_text()[-2000:]}")


def test_driver_joins_a_cluster_started_from_the_command_line(cluster, tmp_path):
    address, env = cluster
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", *RUN], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    # joined (did not start its own), 4 workers over the cluster's 2 nodes
    assert re.search(rf"4 workers \(cpu, gloo, fp32\) on 2 nodes of the Ray cluster at auto", out), out[-3000:]
    [summary] = tmp_path.glob("results/default/*/tiny/seed0/summary.json")
    m = json.loads(summary.read_text())["metrics"]
    assert m["perf/samples_per_s"] > 0
    for d in range(4):  # every worker reported its memory
        assert m[f"perf/model_state_gb/dev{d}"] > 0 and m[f"perf/peak_rss_gb/dev{d}"] > 0
    print(f"cluster run: {elapsed:.1f} s")
    # the cluster is still up after the driver left (the driver does not stop a cluster it joined)
    probe = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); print(len(ray.nodes()))"
    alive = subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0 and int(alive.stdout.split()[-1]) == 2


def test_joining_without_a_cluster_fails_with_one_line(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST_"))},
           "RAY_AUTH_MODE": "disabled"}
    port = _free_port()
    proc = subprocess.run([sys.executable, "-m", "harness", *RUN[:-1], f"backend.address=127.0.0.1:{port}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no Ray cluster to join" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("results/default/*/tiny/seed0/summary.json"))


# ---- isolation: the embedded default never joins a cluster that happens to run on the machine ------
README_RAY = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "backend=ray", "cluster=h100_8x",
              "cluster.num_nodes=1", "cluster.gpus_per_node=4"]  # the README's tiny ray command
SHORT = ["backend.num_iterations=1", "backend.num_warmup_iterations=0", "logger=none", "logger.progress_bar=false"]
JOBS = ("import ray, sys, ray._private.state as s; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(len(s.jobs()), ray.available_resources().get('CPU', 0))")


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """``(address, env)`` of a one-node cluster started with ``ray start --head`` (2 CPUs) the way a
    user starts one, stopped at the end. ``RAY_TMPDIR`` (in ``env``) puts its temp dir under a folder
    of this test instead of /tmp/ray, so its address file, ``ray_current_cluster``, is where a plain
    ``ray.init()`` run with ``env`` looks for the machine's running cluster."""
    logs = tmp_path_factory.mktemp("head")
    temp = tempfile.mkdtemp(prefix="/tmp/rh")  # short: Ray's socket paths must stay under 108 bytes
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST_"))},
           "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": temp}
    port = _free_port()
    proc = None
    try:
        with open(logs / "head.log", "w") as log:
            proc = subprocess.Popen(
                [_ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0", "--block",
                 "--include-dashboard=false", "--disable-usage-stats"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        address = f"127.0.0.1:{port}"
        _wait_for_cpus(address, 2, env, [proc], logs / "head.log")
        assert (Path(temp) / "ray" / "ray_current_cluster").read_text().strip().endswith(f":{port}")
        yield address, env
    finally:
        if proc is not None:
            _stop(proc)
        _kill_leftovers(temp)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize("found_by", ["ray_current_cluster", "RAY_ADDRESS"])
def test_default_run_starts_its_own_ray_beside_a_running_cluster(head, tmp_path, found_by):
    """With a cluster up that a plain ``ray.init()`` would join -- found through the address file
    ``ray start`` wrote, or through ``RAY_ADDRESS`` -- the README's tiny ray command (``backend.address``
    null) runs on a Ray instance of its own: 4 workers, where the cluster has 2 CPUs, and the
    cluster sees no driver of it and keeps its resources."""
    address, env = head
    if found_by == "RAY_ADDRESS":
        env = {**env, "RAY_ADDRESS": address}
    # the failure this guards against: ray.init as the embedded default called it before joins the cluster
    bug = subprocess.run([sys.executable, "-c", "import ray; ray.init(num_cpus=4, num_gpus=0, logging_level='ERROR')"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bug.returncode != 0 and "When connecting to an existing cluster, num_cpus and num_gpus must not be " \
                                   "provided" in bug.stderr, bug.stderr[-2000:]
    before = subprocess.run([sys.executable, "-c", JOBS, address], env=env, capture_output=True, text=True, timeout=60)
    assert before.returncode == 0, before.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "harness", *README_RAY, *SHORT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "4 workers (cpu, gloo, fp32) on 1 node" in out and "of the Ray cluster at" not in out, out[-3000:]
    assert list(tmp_path.glob("results/default/*/tiny/seed0/summary.json"))
    after = subprocess.run([sys.executable, "-c", JOBS, address], env=env, capture_output=True, text=True, timeout=60)
    assert after.returncode == 0, after.stderr[-2000:]
    jobs_before, _ = before.stdout.split()[-2:]
    jobs_after, cpus_after = after.stdout.split()[-2:]
    # the only new driver the cluster saw is the probe itself; all its CPUs are free again
    assert int(jobs_after) == int(jobs_before) + 1 and float(cpus_after) == 2, (before.stdout, after.stdout)
