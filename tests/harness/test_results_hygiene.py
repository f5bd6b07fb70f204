"""The results tree stays clean (harness/run/results.py, harness/cli/app.py).

- a run killed with SIGKILL leaves its staging folder; the next run in that experiment removes it
  and writes one clean result;
- two identical runs at once: the second waits for the first (one line saying so) and skips its
  result; one result, no staging folder left;
- Ctrl-C (SIGINT) ends a run with one line and exit code 130, and nothing of it is kept;
- ``failures.jsonl`` holds each job once, in its latest state, and loses it when it succeeds.
Subprocesses for the signal cases (a run of ``model=tiny`` with many simulated iterations, so that
it is still writing when the signal comes). The first of two identical runs is paused (SIGSTOP)
while it holds its result, so the second finds it writing however fast either starts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.run import results
from tests.helpers import harness_env

ROOT = Path(__file__).resolve().parents[2]
RUN = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1",
       "logger=none", "logger.progress_bar=false"]
LONG = ["backend.num_iterations=3000"]  # several seconds of simulation: time to signal it mid-run


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    # SIGINT at its default disposition, as in a terminal (a pytest-xdist worker ignores it, and a
    # child inherits an ignored signal: Python then installs no KeyboardInterrupt handler)
    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=cwd, env=harness_env(cwd),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_staging(root: Path, proc: subprocess.Popen, timeout_s: float = 120) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(root.rglob(f".*{results.PARTIAL_MARK}*"))
        if found:
            return found
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the run never started writing")


class LineReader:
    """The lines of a process's text stream, read by a thread as they come (so a test can wait for
    one line while the process runs on)."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.ended = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, text: str, timeout_s: float = 120) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.ended or any(text in line for line in self.lines), timeout_s)
            assert any(text in line for line in self.lines), "".join(self.lines)

    def text(self) -> str:
        self._thread.join(timeout=60)
        return "".join(self.lines)


def finished_runs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob(results.SUMMARY_FILE))


def test_a_killed_run_leaves_staging_that_the_next_run_removes(tmp_path):
    root = tmp_path / "results"
    proc = start([*RUN, *LONG, f"results_dir={root}"], tmp_path / "cwd")
    staged = wait_for_staging(root, proc)
    proc.kill()
    proc.wait()
    assert all(p.is_dir() for p in staged)  # kill -9 runs no cleanup
    done = subprocess.run([sys.executable, "-m", "harness", *RUN, "backend.num_iterations=2",
                           "backend.num_warmup_iterations=0", f"results_dir={root}"], cwd=tmp_path / "cwd",
                          env=harness_env(tmp_path / "cwd"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not list(root.rglob(f".*{results.PARTIAL_MARK}*"))
    assert len(finished_runs(root)) == 1


def test_concurrent_identical_runs_do_the_work_once(tmp_path):
    root = tmp_path / "results"
    args = [*RUN, *LONG, f"results_dir={root}"]
    first = start(args, tmp_path / "a")
    wait_for_staging(root, first)
    first.send_signal(signal.SIGSTOP)  # paused while it holds the result it is writing
    try:
        second = start(args, tmp_path / "b")
        out2, err2 = LineReader(second.stdout), LineReader(second.stderr)
        err2.wait_for("waiting: another run is writing")
    finally:
        first.send_signal(signal.SIGCONT)
    out1, err1 = first.communicate(timeout=300)
    second.wait(timeout=300)
    out2, err2 = out2.text(), err2.text()
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert "already finished" in out2 and "already finished" not in out1
    assert len(finished_runs(root)) == 1 and not list(root.rglob(f".*{results.PARTIAL_MARK}*"))


def test_ctrl_c_is_one_line_and_keeps_nothing(tmp_path):
    root = tmp_path / "results"
    proc = start([*RUN, *LONG, f"results_dir={root}"], tmp_path / "cwd")
    wait_for_staging(root, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["interrupted: nothing of the unfinished run was kept"], err
    assert not finished_runs(root) and not list(root.rglob(f".*{results.PARTIAL_MARK}*"))


def test_stale_staging_of_a_live_process_is_kept(tmp_path):
    live = tmp_path / f".seed0{results.PARTIAL_MARK}{os.uname().nodename}-{os.getpid()}"
    dead_pid = 2 ** 22 + 17  # above the default pid_max: no such process
    dead = tmp_path / f".seed1{results.PARTIAL_MARK}{os.uname().nodename}-{dead_pid}"
    other_host = tmp_path / f".seed2{results.PARTIAL_MARK}elsewhere-{dead_pid}"
    for folder in (live, dead, other_host):
        folder.mkdir()
    assert results.remove_stale_partials(tmp_path) == [dead]
    assert live.is_dir() and other_host.is_dir() and not dead.exists()


def test_failures_hold_each_job_once_in_its_latest_state(tmp_path):
    job = {"system": "rlhfuse", "seed": 0, "overrides": ["model=13b"]}
    other = {"system": "realhf", "seed": 0, "overrides": ["model=13b"]}
    results.record_failure(tmp_path, "exp", job, ValueError("first"))
    results.record_failure(tmp_path, "exp", other, ValueError("other"))
    path = results.record_failure(tmp_path, "exp", job, ValueError("second"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["system"], line["error"]) for line in lines] == [("realhf", "other"), ("rlhfuse", "second")]
    results.clear_failure(tmp_path, "exp", job)
    assert [json.loads(line)["system"] for line in path.read_text().splitlines()] == ["realhf"]


def test_report_shows_a_job_once_from_an_old_append_only_file(tmp_path):
    from harness.cli.report import read_failures

    path = tmp_path / results.FAILURES_FILE
    job = {"system": "rlhfuse", "seed": 0, "overrides": ["a=1"]}
    path.write_text(json.dumps({**job, "error": "old"}) + "\n" + json.dumps({**job, "error": "new"}) + "\n")
    assert [f["error"] for f in read_failures(path, "exp")] == ["new"]


def test_planning_progress_only_on_a_terminal():
    """Progress lines when stderr is a terminal and progress_bar is on; none in a
    pipe or log, none when asked."""
    import io

    from harness.run.progress import planning_progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert planning_progress(True, io.StringIO()) is None
    assert planning_progress(False, Tty()) is None
    stream = Tty()
    report = planning_progress(True, stream)
    report("rlhfuse: gen, 18 layouts")
    assert stream.getvalue().startswith("[plan ") and stream.getvalue().endswith("] rlhfuse: gen, 18 layouts\n")


def test_a_run_on_a_terminal_reports_its_planning_phases(tmp_path):
    """Through a pseudo-terminal: the run prints a line per planning phase, with estimates."""
    import pty

    args = [o for o in RUN if not o.startswith("logger.progress_bar=")]
    cmd = [sys.executable, "-m", "harness", *args, "backend.num_iterations=2", "backend.num_warmup_iterations=0",
           f"results_dir={tmp_path / 'results'}", "logger.progress_bar=true"]
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=harness_env(tmp_path), stdout=subprocess.PIPE, stderr=secondary)
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    os.close(primary)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text
    lines = [line for line in text.splitlines() if line.startswith("[plan ")]
    assert lines[0].endswith("planning rlhfuse_base on tiny, 8 devices"), lines
    assert any("gen:" in line and "estimate" in line for line in lines), lines
