"""Command lines refused or interrupted before any work, with one line each:

- a value with a character Hydra's override grammar reads only inside quotes (``café``, ``a&b``,
  a newline) or a path starting with ``~``: one line naming the override and the rewrite that
  parses (checked here by composing it);
- Ctrl-C at any point of ``python -m harness``, the sweep's pre-check included: one line, exit 130;
- a sweep's pre-check shows its progress on a terminal and erases it, so a refused sweep still
  leaves exactly one line, on a terminal and in a pipe;
- ``backend=ray`` with the embedded local Ray refuses more CPU workers than its cap before any
  worker starts, naming the cap and how to run more (a Ray cluster's address).

In-process (``harness.cli.app.run`` with ``sys.argv`` and ``sys.stderr`` replaced), one subprocess for
the exit code and stderr of a real command.
"""
from __future__ import annotations

import codecs
import io
import re
import shlex
import sys

import pytest

from harness.cli import app
from harness.checks import command_line as validation
from harness.errors import ConfigError, OverrideError
from harness.checks.command_line import check_command_line

from tests.conftest import run_refused

TINY = ["+system=rlhfuse_base", "model=tiny", "workload=tiny"]


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def shown(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: ``\\r`` returns to the line's start, ``ESC[K`` erases
    to its end."""
    lines, line, col = [], "", 0
    for part in re.split(r"(\r|\n|\x1b\[K)", text):
        if part == "\r":
            col = 0
        elif part == "\n":
            lines.append(line)
            line, col = "", 0
        elif part == "\x1b[K":
            line = line[:col]
        else:
            line = line[:col] + part + line[col + len(part):]
            col += len(part)
    return lines + ([line] if line else [])


def shell_word(word: str) -> str:
    """What the shell passes for one word of the message: POSIX quoting or bash's ``$'...'``."""
    if word.startswith("$'"):
        return codecs.decode(word[2:-1], "unicode_escape")
    (parsed,) = shlex.split(word)
    return parsed


# ---- values Hydra's grammar cannot read unquoted --------------------------------------------------

UNREADABLE = {  # id: (override, the rewrite the message shows, as typed in a shell)
    "non_ascii": ("experiment_name=café", """'experiment_name="café"'"""),
    "ampersand": ("experiment_name=a&b", """'experiment_name="a&b"'"""),
    "newline": ("experiment_name=a\nb", """$'experiment_name="a\\nb"'"""),
    "sweep_element": ("experiment_name=a,café", """'experiment_name=a,"café"'"""),
    "home": ("results_dir=~/x", "results_dir=/home/tester/x"),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_value_names_the_rewrite_that_parses(case, monkeypatch):
    monkeypatch.setenv("HOME", "/home/tester")
    override, rewrite = UNREADABLE[case]
    argv = (["-m"] if "," in override else []) + [*TINY, override]
    with pytest.raises(OverrideError) as refused:
        check_command_line(argv)
    message = str(refused.value)
    assert "\n" not in message and "LexerNoViableAltException" not in message
    assert message.startswith(f"cannot parse override {override!r}: Hydra's override grammar ")
    assert message.endswith(f": {rewrite}"), message
    fixed = [shell_word(rewrite) if a == override else a for a in argv]
    check_command_line(fixed)  # what the message says to type is accepted


def test_the_character_is_named():
    with pytest.raises(OverrideError, match=r"reads the character 'é' only inside quotes; quote the value"):
        check_command_line([*TINY, "experiment_name=café"])
    with pytest.raises(OverrideError, match=r"cannot read the character '~' here; write the home folder out"):
        check_command_line([*TINY, "results_dir=~/x"])


def test_other_parse_errors_keep_hydras_description():
    with pytest.raises(OverrideError) as refused:
        check_command_line([*TINY, "experiment_name=a=b"])
    assert "quote" not in str(refused.value) and "mismatched input '='" in str(refused.value)


def test_unreadable_value_is_one_line_and_exit_2(tmp_path, run_harness):
    line = run_refused(run_harness, tmp_path, *TINY, "experiment_name=café")
    assert line == ("""error: cannot parse override 'experiment_name=café': Hydra's override grammar reads the """
                    """character 'é' only inside quotes; quote the value: 'experiment_name="café"'""")


# ---- Ctrl-C and the sweep's pre-check, through harness.cli.app.run ------------------------------------

def _run_app(monkeypatch, argv: list[str], stderr: io.StringIO) -> int:
    monkeypatch.setattr(sys, "argv", ["harness", *argv])
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(SystemExit) as ended:
        app.run()
    return ended.value.code


def test_ctrl_c_during_the_pre_check_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(app, "check_command_line", interrupted)
    stderr = io.StringIO()
    assert _run_app(monkeypatch, ["-m", *TINY, "seed=0,1,2"], stderr) == 130
    assert stderr.getvalue() == "interrupted: nothing of the unfinished run was kept\n"
    assert capsys.readouterr().out == ""


@pytest.fixture
def progress_at_once(monkeypatch):
    """Progress shown from 3 jobs on, updated at every job."""
    monkeypatch.setattr(validation, "PROGRESS_MIN_JOBS", 2)
    monkeypatch.setattr(validation, "PROGRESS_INTERVAL_S", 0.0)


REFUSED_SWEEP = ["-m", *TINY, "seed=0,1,2,x"]  # the fourth job's seed is not an integer


def test_refused_sweep_on_a_terminal_leaves_one_line(monkeypatch, progress_at_once):
    terminal = Terminal()
    assert _run_app(monkeypatch, REFUSED_SWEEP, terminal) == 2
    assert "[harness] checking the sweep's 4 jobs: 3 done" in terminal.getvalue()  # progress was shown
    assert shown(terminal.getvalue()) == ["error: seed=x: Value 'x' of type 'str' could not be converted to Integer "
                                          "in sweep job +system=rlhfuse_base model=tiny workload=tiny seed=x"]


def test_refused_sweep_in_a_pipe_is_one_line_without_progress(monkeypatch, progress_at_once):
    pipe = io.StringIO()
    assert _run_app(monkeypatch, REFUSED_SWEEP, pipe) == 2
    assert pipe.getvalue().count("\n") == 1 and pipe.getvalue().startswith("error: seed=x: ")
    assert "\r" not in pipe.getvalue() and "\x1b" not in pipe.getvalue()


def test_few_jobs_show_no_progress(monkeypatch):
    monkeypatch.setattr(validation, "PROGRESS_INTERVAL_S", 0.0)
    terminal = Terminal()
    assert _run_app(monkeypatch, REFUSED_SWEEP, terminal) == 2  # 4 jobs: fewer than PROGRESS_MIN_JOBS
    assert "checking" not in terminal.getvalue()


def test_progress_is_erased_when_the_check_passes_or_is_interrupted(progress_at_once):
    jobs = [[f"seed={i}"] for i in range(5)]
    terminal = Terminal()
    with validation.SweepCheckProgress(terminal) as progress:
        assert list(progress.over(jobs)) == jobs
    assert "checking the sweep's 5 jobs: 4 done" in terminal.getvalue() and shown(terminal.getvalue()) == []

    terminal = Terminal()
    with pytest.raises(KeyboardInterrupt):
        with validation.SweepCheckProgress(terminal) as progress:
            for index, _ in enumerate(progress.over(jobs)):
                if index == 3:
                    raise KeyboardInterrupt
    assert "2 done" in terminal.getvalue() and shown(terminal.getvalue()) == []


# ---- backend=ray: the embedded local Ray's cap on CPU workers -------------------------------------

def test_embedded_ray_worker_cap(monkeypatch):
    from harness.backends.ray.driver import cluster

    monkeypatch.setattr(cluster, "usable_cpus", lambda: 2)
    assert cluster.embedded_worker_cap() == 2 * cluster.EMBEDDED_WORKERS_PER_CPU
    assert cluster.embedded_workers_problem(cluster.embedded_worker_cap()) is None
    problem = cluster.embedded_workers_problem(4000)
    assert "would start 4000 CPU worker processes" in problem
    cap, per_cpu = cluster.embedded_worker_cap(), cluster.EMBEDDED_WORKERS_PER_CPU
    assert f"at most {cap} ({per_cpu} per CPU core, 2 cores)" in problem
    assert "backend.address=auto" in problem


@pytest.mark.parametrize("address", [None, "auto"])
def test_ray_backend_refuses_more_cpu_workers_than_the_cap_before_any_starts(monkeypatch, address):
    ray = pytest.importorskip("ray")
    from harness.backends.ray.driver import cluster
    from harness.backends.ray.driver.backend import RayBackend
    from harness.testing import plan_for

    overrides = [*TINY, "backend=ray", "backend.options.device=cpu", "cluster=h100_8x", "cluster.num_nodes=1",
                 "cluster.gpus_per_node=4"] + ([f"backend.address={address}"] if address else [])
    plan, ctx, run = plan_for(overrides)
    monkeypatch.setattr(cluster, "usable_cpus", lambda: 1)
    monkeypatch.setattr(cluster, "EMBEDDED_WORKERS_PER_CPU", 2)  # a cap of 2 below the 4 devices
    backend = RayBackend(run.backend, ctx)
    if address is None:
        with pytest.raises(ConfigError, match=r"the embedded local Ray \(backend\.address null\) would start 4 CPU "
                                              r"worker processes .* at most 2 \(2 per CPU core, 1 cores\)"):
            backend.check(plan)
    else:  # a cluster's workers are placed on its own CPUs, checked against its resources
        backend.check(plan)
    assert not ray.is_initialized()
