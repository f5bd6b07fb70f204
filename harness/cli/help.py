"""``python -m harness --help``: what a new user needs on one screen.

A usage line, every system with the first line of its ``conf/system/<name>.yaml``, the main config
groups with their options (a group of groups, ``engine``, by its subgroups: ``engine.generation=<option>``),
and four examples. Hydra's own page (``--hydra-help``) still lists
Hydra's flags; the internal ``schema`` group (typed configs behind every YAML file) is not offered.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

CONF = Path(__file__).resolve().parents[2] / "conf"
# Groups a user picks from, in the order a command line names them (``engine`` holds the groups
# engine/generation and engine/training).
GROUPS = ("model", "algo", "cluster", "workload", "backend", "logger", "engine", "experiment")
# What a group of groups' options also take, beside their names.
ALSO_TAKES = {"engine": "(each also takes the path of a .yaml file; unset: the system's own)"}
EXAMPLES = (
    ("RLHFuse on the paper's 13B setting, simulated", "python -m harness +system=rlhfuse model=13b"),
    ("a sweep of two systems and two generation lengths",
     "python -m harness -m +system=rlhfuse,realhf model=65b_33b workload.max_gen_len=1024,2048"),
    ("RLHFuse and its base without a critic (GRPO: 8 responses per prompt, rule-based reward)",
     "python -m harness -m +system=rlhfuse,rlhfuse_base algo=grpo model=13b"),
    ("real PPO on Ray with tiny models on 2 CPU processes",
     "python -m harness +system=rlhfuse_base model=tiny workload=tiny backend=ray cluster=h100_8x "
     "cluster.num_nodes=1 cluster.gpus_per_node=2"),
)


def _summary(path: Path, width: int = 88) -> str:
    """The first sentence of a YAML file's opening comment, cut to ``width`` characters."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        words += line.lstrip("# ").split()
    text = " ".join(words)
    end = text.find(". ")
    text = text if end < 0 else text[:end + 1]
    return text if len(text) <= width else text[:width - 3].rsplit(" ", 1)[0] + " ..."


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _subgroups(group: str) -> list[str]:
    """The groups inside ``group`` (``engine``: generation, training), chosen as ``group.sub=<option>``."""
    return sorted(p.name for p in (CONF / group).iterdir() if p.is_dir() and any(p.glob("*.yaml")))


def help_text(systems: list[str]) -> str:
    width = max(len(s) for s in systems) + 2 if systems else 0
    lines = ["usage: python -m harness +system=<system> [group=option ...] [key=value ...]",
             "       python -m harness -m <sweep>     (a value list per key: one run per combination)",
             "", "systems (+system=...):"]
    for name in systems:
        path = CONF / "system" / f"{name}.yaml"
        lines.append(f"  {name:<{width}}{_summary(path) if path.is_file() else ''}")
    lines += ["", "config groups (group=option):"]
    for group in GROUPS:
        subgroups = _subgroups(group)
        if not subgroups:
            lines += textwrap.wrap(", ".join(_options(group)), 100, initial_indent=f"  {group:<12}",
                                   subsequent_indent=" " * 14)
        for i, sub in enumerate(subgroups):
            text = f"{group}.{sub}=<option>: {', '.join(_options(f'{group}/{sub}'))}"
            lines += textwrap.wrap(text, 100, initial_indent=f"  {group if i == 0 else '':<12}",
                                   subsequent_indent=" " * 16)
        if subgroups and group in ALSO_TAKES:
            lines.append(" " * 14 + ALSO_TAKES[group])
    lines += ["", "any key of the composed config can be set (key=value); `--cfg job` prints the config.",
              "results: results/<experiment_name>/<system>[,<variant>]/<model>/seed<k>/ (harness.cli.report reads them)",
              "", "examples:"]
    for what, cmd in EXAMPLES:
        lines += [f"  # {what}", f"  {cmd}"]
    lines += ["", "Hydra's own flags: python -m harness --hydra-help"]
    return "\n".join(lines)
