"""Learning curves (not a paper figure; docs/LEARNING.md): mean reward per PPO iteration of real
runs (``backend=ray``) on the programmatic ``token_range`` reward, one panel per system side by
side, seeds as thin lines and their mean in bold, against the reward of the untrained policy
(mean +- 2 sd over ``untrained.csv``'s batches) and the task's optimum; a last panel puts every
system's mean curve against the wall-clock time of its iterations.

The experiment is a runner rather than a Hydra sweep because its systems need different
overrides (DeepSpeed-Chat's mini-batch must be set to the workload's): :func:`run_experiment`
runs ``python -m harness`` once per system and seed as ``conf/experiment/learning_curves.yaml``
says, then measures the untrained actor's reward in-process
(:func:`harness.backends.ray.driver.experience.policy_reward`) and writes ``untrained.csv``.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from harness.figures import style
from harness.run import results

if TYPE_CHECKING:  # drawing needs none of the pipeline's imports
    from harness.run.pipeline import ExperimentTools

EXPERIMENT = "learning_curves"
UNTRAINED_FILE = "untrained.csv"
REWARD = "rl/reward_mean"


def run_experiment(cfg, tools: ExperimentTools) -> Path:
    """``experiment_runner`` of ``conf/experiment/learning_curves.yaml``: every system x seed as
    its own ``python -m harness`` run, then the untrained-policy baseline. Returns the experiment's
    results folder."""
    params = cfg.experiment_params
    root = tools.folder
    logger = [f"logger={cfg.logger.name}"] + ([f"logger.mode={cfg.logger.mode}"] if cfg.logger.wandb else [])
    failed = []
    for seed in params.seeds:
        for system, extra in params.systems.items():
            cmd = [sys.executable, "-m", "harness", f"+system={system}", *params.overrides, *(extra or []),
                   f"backend.num_iterations={params.iterations}", f"seed={seed}", *logger,
                   f"experiment_name={cfg.experiment_name}", f"results_dir={cfg.results_dir}",
                   f"overwrite={str(bool(cfg.overwrite)).lower()}"]
            print("+", " ".join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0:
                failed.append(f"{system} seed {seed}")
    write_untrained(root, int(params.untrained.seeds), int(params.untrained.iterations))
    if failed:
        raise RuntimeError(f"learning_curves: runs failed: {', '.join(failed)}")
    return root


def write_untrained(root: Path, num_seeds: int, num_iterations: int) -> Path:
    """The untrained actor's mean task reward on ``num_seeds`` x ``num_iterations`` batches, with
    the model, workload and reward of the experiment's runs (read from a finished run's config)."""
    import torch
    from omegaconf import OmegaConf

    from harness.backends.ray.driver.experience import policy_reward
    from harness.core.algorithm import AlgorithmConfig

    configs = sorted(root.glob(f"*/*/seed*/{results.CONFIG_FILE}"))
    if not configs:
        raise FileNotFoundError(f"no finished runs under {root}: nothing to measure the untrained policy against")
    cfg = OmegaConf.load(configs[0])
    opts = cfg.backend.options
    spec = OmegaConf.to_container(opts.reward)
    algorithm = AlgorithmConfig(**OmegaConf.to_container(cfg.algo))  # its groups decide the batches
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model generates fastest on one thread
    try:
        rows = [{"seed": s, "iteration": it,
                 "reward": policy_reward(cfg.model.actor, cfg.workload, s, it, spec, temperature=opts.temperature,
                                         algorithm=algorithm)}
                for s in range(num_seeds) for it in range(num_iterations)]
    finally:
        torch.set_num_threads(threads)
    path = root / UNTRAINED_FILE
    results.write_table(path, rows)
    return path


def load_curves(df):
    """One row per (run, iteration): system, seed, iteration, reward, elapsed step time (s)."""
    import pandas as pd

    frames = []
    for _, run in df.iterrows():
        per_it = pd.read_json(Path(run["path"]) / results.METRICS_FILE, lines=True)
        frames.append(pd.DataFrame({"system": run["system"], "seed": run["seed"], "iteration": range(len(per_it)),
                                    "reward": per_it[REWARD], "elapsed_s": per_it["timing_s/step"].cumsum()}))
    return pd.concat(frames, ignore_index=True)


def draw(root: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    df = style.load_experiment(root, EXPERIMENT)
    if REWARD not in df.columns:
        raise style.MissingResults(f"runs under {Path(root) / EXPERIMENT} have no {REWARD} (backend=ray runs only)",
                                   EXPERIMENT, root)
    curves = load_curves(df)
    untrained_path = Path(root) / EXPERIMENT / UNTRAINED_FILE
    untrained = results.load_run_table(untrained_path.parent, UNTRAINED_FILE)["reward"] \
        if untrained_path.is_file() else None
    style.setup()
    labels = style.ordered_systems(curves["system"]) + sorted(
        set(curves["system"]) - set(style.SYSTEM_ORDER))  # out-of-tree systems at the end
    name_of = {style.SYSTEM_LABELS.get(s, s): s for s in curves["system"].unique()}
    colors = {label: style.system_color(label, i) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(labels) + 1, figsize=(3.6 * (len(labels) + 1), 3.4), squeeze=False,
                             sharey=True)
    for ax, label in zip(axes[0], labels):
        sub = curves[curves["system"] == name_of[label]]
        color = colors[label]
        for _, seed in sub.groupby("seed"):
            ax.plot(seed["iteration"], seed["reward"], color=color, lw=0.8, alpha=0.45)
        mean = sub.groupby("iteration")["reward"].mean()
        ax.plot(mean.index, mean.values, color=color, lw=2.2, label=f"mean over seeds (n={sub['seed'].nunique()})")
        ax.set(xlabel="PPO iteration (#)", title=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[0]:
        if untrained is not None:
            mu, sd = float(untrained.mean()), float(untrained.std())
            ax.axhspan(mu - 2 * sd, mu + 2 * sd, color=style.PAPER_COLOR, alpha=0.3,
                       label=f"untrained policy ({mu:.2f} ± 2 sd)")
        ax.axhline(1.0, color=style.PAPER_COLOR, ls="--", lw=1, label="optimum")
        ax.set_ylim(0, 1.05)
    ax = axes[0][-1]
    for label in labels:
        sub = curves[curves["system"] == name_of[label]].groupby("iteration")[["reward", "elapsed_s"]].mean()
        ax.plot(sub["elapsed_s"], sub["reward"], color=colors[label], lw=2, label=label)
    ax.set(xlabel="wall-clock time of the iterations (s)", title="all systems (mean over seeds)")
    axes[0][0].set_ylabel("mean reward (fraction of tokens in range)")
    axes[0][0].legend(loc="lower right")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return style.save(fig, root, EXPERIMENT)
