"""PPO learns: a real run of RLHFuse (both fusions: streamed inference, long-tail migration, the
fused actor-critic pipeline) on CPU Ray workers with tiny LLaMA models raises the programmatic
reward clearly above what the untrained policy gets.

One run of the README's figure command (``python -m harness.figures learning_curves --run``, which
runs ``python -m harness +experiment=learning_curves`` and draws the figure; docs/LEARNING.md) cut
to seed 0, 20 iterations and one system (about 45 s of wall-clock on a 2-core machine, Ray start-up
included). Every system ends PPO iterations with the same weights as the others
(tests/harness/backends/ray/test_ray_backend.py), so one system's curve stands for all. The reward is the fraction of
response tokens whose id lies in [0, 32) of the 256-token vocabulary.

Why it cannot pass by chance: the experiment measures the *untrained* actor's mean reward
in-process on 8 seeds x 4 batches (32 batches of 32 samples): about 0.13 with a standard deviation
of about 0.02 between batches, and no batch above 0.17. The test asks the mean over the last 3
iterations to exceed that mean by 0.3 (some 13 standard deviations, and 0.25 above the best
untrained batch) and the mean over the first 3 iterations by 0.3. Measured when this test was
written: 0.12-0.16 over the first iterations, 0.79-0.83 over the last three (mean 0.81), the same
curve for DeepSpeed-Chat and RLHFuse up to float noise. The first
iteration's reward must also equal, to float precision, the untrained policy measured in-process on
the same batch, so the baseline is the policy the run started from.
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SYSTEMS = ("rlhfuse",)
ITERATIONS = 20
MARGIN = 0.3  # reward above the untrained policy's mean (which is ~0.13, sd ~0.02)
OVERRIDES = ["experiment_params.seeds=[0]", f"experiment_params.iterations={ITERATIONS}",
             "~experiment_params.systems.rlhfuse_base", "~experiment_params.systems.deepspeed_chat", "logger=wandb",
             "logger.mode=offline"]


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    from harness.run import results
    from harness.figures import learning_curves as lc
    from tests.helpers import harness_env

    tmp = tmp_path_factory.mktemp("learning")
    root = tmp / "results"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness.figures", "learning_curves", "--run", "--results", str(root),
                           *(f"--override={o}" for o in OVERRIDES)], cwd=tmp, env=harness_env(tmp),
                          capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    df = results.load_results(root, lc.EXPERIMENT)
    assert sorted(df["system"]) == sorted(SYSTEMS)
    curves = lc.load_curves(df)
    untrained = results.load_run_table(root / lc.EXPERIMENT, lc.UNTRAINED_FILE)
    print(f"learning_curves: {elapsed:.0f} s; untrained {untrained['reward'].mean():.3f} "
          f"+- {untrained['reward'].std():.3f}; " + "; ".join(
              f"{s}: {' '.join(f'{r:.2f}' for r in curves[curves['system'] == s]['reward'])}" for s in SYSTEMS))
    return root, df, curves, untrained


@pytest.mark.parametrize("system", SYSTEMS)
def test_reward_rises_clearly_above_the_untrained_policy(experiment, system):
    _, _, curves, untrained = experiment
    reward = curves[curves["system"] == system]["reward"].to_numpy()
    assert len(reward) == ITERATIONS
    mu, sd, best = untrained["reward"].mean(), untrained["reward"].std(), untrained["reward"].max()
    assert len(untrained) == 32 and sd < 0.05, untrained  # the baseline is what the docstring says
    first, last = reward[:3].mean(), reward[-3:].mean()
    assert last > mu + MARGIN, (system, last, mu, sd, reward)
    assert last > best + MARGIN - 0.05, (system, last, best)
    assert last > first + MARGIN, (system, first, last, reward)


@pytest.mark.parametrize("system", SYSTEMS)
def test_first_iteration_is_the_untrained_policy(experiment, system):
    """Iteration 0 generates with the initial weights: its reward is the in-process measurement of
    the untrained actor on seed 0's first batch."""
    _, _, curves, untrained = experiment
    first = curves[(curves["system"] == system) & (curves["iteration"] == 0)]["reward"].item()
    measured = untrained[(untrained["seed"] == 0) & (untrained["iteration"] == 0)]["reward"].item()
    assert math.isclose(first, measured, abs_tol=1e-6), (first, measured)


def _wandb_reader():
    path = Path(__file__).parents[2] / "test_wandb_offline.py"
    spec = importlib.util.spec_from_file_location("_wandb_readback", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wandb_and_results_record_the_reward_curve(experiment):
    """metrics.jsonl has rl/reward_mean for every iteration, and the offline W&B run logged the same."""
    pytest.importorskip("wandb")
    _, df, _, _ = experiment
    reader = _wandb_reader()
    for _, run in df.iterrows():
        folder = Path(run["path"])
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        curve = [r["rl/reward_mean"] for r in rows]
        assert len(curve) == ITERATIONS
        [wandb_file] = folder.glob("wandb/offline-run-*/run-*.wandb")
        record = reader.read_with_leet(wandb_file) or reader.read_with_protobuf(wandb_file)
        logged = [h["rl/reward_mean"] for h in record["history"]]
        np.testing.assert_allclose(logged, curve, rtol=1e-12)
        assert [h["_step"] for h in record["history"]] == list(range(ITERATIONS))


def test_the_figure_command_draws_the_learning_curves(experiment):
    """The command drew the figure of the runs it made (PNG and PDF beside the results)."""
    root, _, _, _ = experiment
    for suffix in (".png", ".pdf"):
        path = root / "figures" / f"learning_curves{suffix}"
        assert path.is_file() and path.stat().st_size > 1000, path
