"""Same weights across systems at the README's own setting, and the final
weights in ``summary.json``.

The README's three CPU commands (``model=tiny workload=tiny backend=ray`` on 4 devices:
deepspeed_chat, rlhfuse_base, rlhfuse) run as written (3 iterations; plus ``logger=none``, no
progress bar and ``backend.options.dump_weights_dir=w``, which saves the final weights). They solve
the same optimisation problem: DeepSpeed-Chat's derived mini-batch is the workload's 4 here (one
sample per GPU per micro-step; before the fix it was 8, one gradient step per iteration instead of
two, and it ended 58-62% of an update away from the others). So they end with the same actor and
critic weights: relative L2 distance below 1e-6 and below 1% of the run's update (measured:
~1e-8 relative, float summation order only).

``summary.json``'s ``final_weights`` is the last iteration's digest of each trained model's full
weights (:func:`harness.real.digest.weights_digest`), equal to the digest of the dumped weights;
its SHA-256 is recomputed here from the definition in :func:`harness.real.digest.weights_sha256`'s
docstring.
"""
from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.ray

README = Path(__file__).resolve().parents[4] / "README.md"
SYSTEMS = ("deepspeed_chat", "rlhfuse_base", "rlhfuse")
BOOKKEEPING = ["logger=none", "logger.progress_bar=false", "backend.options.dump_weights_dir=w"]


def readme_command(system: str) -> list[str]:
    """The README's CPU command for ``system`` on 4 devices, as ``python -m harness`` arguments."""
    pattern = re.compile(rf"^python -m harness \+system={system} model=tiny workload=tiny backend=ray "
                         rf"cluster=h100_8x cluster\.num_nodes=1 cluster\.gpus_per_node=4( [^#\n]*)?$", re.M)
    found = [m.group(0).strip() for m in pattern.finditer(README.read_text())]
    assert len(found) == 1, (system, found)
    return shlex.split(found[0])[3:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_harness, machine_lock):
    root = tmp_path_factory.mktemp("same_weights")
    out = {}
    for system in SYSTEMS:
        proc = run_harness(readme_command(system) + BOOKKEEPING, root / system, timeout=600)
        assert proc.returncode == 0, (system, proc.stderr[-3000:])
        [summary] = (root / system).glob("results/default/*/tiny/seed0/summary.json")
        out[system] = (root / system, summary.parent)
    return out


def _summary(runs, system) -> dict:
    return json.loads((runs[system][1] / "summary.json").read_text())


def _state(runs, system, role) -> dict[str, torch.Tensor]:
    return torch.load(runs[system][0] / "w" / f"{role}.pt")


def _flat(state) -> torch.Tensor:
    return torch.cat([state[n].reshape(-1).double() for n in sorted(state)])


def test_readme_commands_use_the_same_mini_batches(runs):
    plans = {s: json.loads((runs[s][1] / "plan.json").read_text()) for s in SYSTEMS}
    assert {s: p["mini_batch_size"] for s, p in plans.items()} == dict.fromkeys(SYSTEMS, 4)
    # DeepSpeed-Chat: one sample per GPU per micro-step (the workload's micro-batch is 2)
    assert {stage["micro_batch_size"] for stage in plans["deepspeed_chat"]["training"]} == {1}


def test_readme_commands_end_with_the_same_weights(runs):
    for role in ("actor", "critic"):
        ref = _flat(_state(runs, "deepspeed_chat", role))
        update = _summary(runs, "deepspeed_chat")["final_weights"]["models"][role]["update_l2"]
        assert update > 1e-3  # three iterations did move the weights
        for other in ("rlhfuse_base", "rlhfuse"):
            diff = float((_flat(_state(runs, other, role)) - ref).norm())
            assert diff < 1e-6 * float(ref.norm()), (role, other, diff)
            assert diff < 1e-2 * update, (role, other, diff, update)
            # what a user compares without dumping weights: the summaries' final digests
            a = _summary(runs, "deepspeed_chat")["final_weights"]["models"][role]
            b = _summary(runs, other)["final_weights"]["models"][role]
            assert a["num_params"] == b["num_params"]
            assert abs(a["l2"] - b["l2"]) < 1e-6 * a["l2"], (role, other)
            assert abs(a["update_l2"] - b["update_l2"]) < 1e-2 * a["update_l2"], (role, other)


def sha256_by_definition(state: dict[str, torch.Tensor]) -> str:
    """weights_sha256's docstring, written out independently: per entry in sorted-name order, the
    UTF-8 name, a zero byte, then the values as little-endian float32 in row-major order."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode("utf-8"))
        h.update(b"\x00")
        h.update(np.ascontiguousarray(state[name].float().numpy(), dtype="<f4").tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("system", SYSTEMS)
def test_summary_records_the_final_weights(runs, system):
    from harness.real.digest import weights_sha256

    summary = _summary(runs, system)
    final = summary["final_weights"]
    metrics = [json.loads(line) for line in (runs[system][1] / "metrics.jsonl").read_text().splitlines()]
    assert final["iteration"] == len(metrics) - 1 == 2  # the last of the README's 3 iterations
    assert set(final["models"]) == {"actor", "critic"}
    for role, digest in final["models"].items():
        state = _state(runs, system, role)  # dumped after the last iteration
        flat = _flat(state)
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
