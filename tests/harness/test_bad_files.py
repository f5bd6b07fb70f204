"""Bad files and paths are refused up front with one line naming the file, the line and the cause.

Each input below is a :class:`~harness.errors.ConfigError` (``error: ...`` on stderr, exit code 2,
nothing written) raised before planning or, for ``python -m harness.replay`` and
``python -m harness.report``, before any work, not a traceback, a misleading message or work lost
at the end:

- an ``experiment_name`` folder name over the file system's name limit, or a path over its limit;
- a cluster too large to hold in memory even with ``allow_large=true`` (10**30 nodes);
- an engine YAML file that is not YAML, not a mapping, has unknown keys or values of the wrong type;
- a ``backend.profile_table`` CSV with an unknown op, a non-numeric or negative value, missing
  columns, nothing in it, or binary content; in a sweep, once for the sweep, before any job;
- a replay file that is binary, a replay line without ``+system=...``, an unwritable ``--json``;
- an unwritable ``--output`` / ``--plot`` of the report, or a file given as a results folder;
- a ``results_dir`` that is a file, a device, empty or the current folder;
- a ``workload.path`` that is a device or a directory;
- a ``cluster.calibration`` path without ``.json`` (accepted as it is), or an unknown name (listed).

Also: a run's lock file is removed when the run ends and concurrent holders still exclude each
other, and Ctrl-C ends ``python -m harness.replay`` / ``report`` with ``interrupted`` and exit 130.

Most checks run in-process (:func:`refused`: the run's own entry, :func:`harness.run.pipeline.execute`);
two subprocesses check the command line end to end.
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.checks import consistency as cons
from harness.cli import report, replay as validate
from harness.run import results
from harness.run.pipeline import compose
from harness.costmodel.calibrated import FITTED_DIR, Calibration, calibration_path
from harness.errors import ConfigError
from harness.run.pipeline import execute
from harness.checks.command_line import check_command_line
from harness.core.workload import resolve_workload_path

from tests.conftest import run_refused

FAST = ["logger=none", "logger.progress_bar=false", "backend.num_iterations=1", "backend.num_warmup_iterations=0"]
TINY = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1",
        "cluster.gpus_per_node=4", *FAST]
HEADER = "op,model,tp,num_tokens,time_s\n"
UNWRITABLE = Path("/proc/harness-bad-files")  # no file can be created under /proc, not even by root
needs_proc = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")


def refused(tmp_path: Path, *overrides: str) -> str:
    """The one-line ConfigError ``python -m harness TINY overrides`` ends with (in-process), with
    nothing written under its results_dir."""
    results_dir = tmp_path / "results"
    args = [*TINY, f"results_dir={results_dir}", *overrides]
    with pytest.raises(ConfigError) as info:
        execute(compose(args), args)
    message = str(info.value)
    assert "\n" not in message, message
    assert not results_dir.exists() or not any(results_dir.rglob("*"))
    return message


# ---- experiment_name ------------------------------------------------------------------------------

def test_experiment_name_over_the_name_limit_is_refused_end_to_end(tmp_path, run_harness):
    line = run_refused(run_harness, tmp_path, *TINY, f"experiment_name=sweeps/{'a' * 256}")
    assert "experiment_name" in line and "256 bytes" in line and "limit of 255 bytes" in line, line


@pytest.mark.parametrize("part,size", [("a" * 256, 256), ("é" * 128, 256)])  # bytes, not characters
def test_experiment_name_folder_names_are_limited_in_bytes(tmp_path, part, size):
    with pytest.raises(ConfigError, match=rf"folder name .* is {size} bytes, over .* limit of 255 bytes"):
        cons.check_experiment_name(f"ok/{part}", str(tmp_path))
    cons.check_experiment_name(f"ok/{'a' * 255}", str(tmp_path))  # at the limit: accepted
    cons.check_experiment_name("é" * 127, str(tmp_path))


def test_experiment_name_path_over_the_path_limit_is_refused(tmp_path):
    name = "/".join(["b" * 250] * 16)  # every name fits, the path does not (4,096 bytes)
    with pytest.raises(ConfigError, match="limit of 4096 bytes for a path"):
        cons.check_experiment_name(name, str(tmp_path))
    cons.check_experiment_name("/".join(["b" * 250] * 8), str(tmp_path))


def test_a_long_variant_is_shortened_not_refused(tmp_path):
    path = results.run_path(tmp_path, "exp", "rlhfuse", "13b", 0, "workload.max_gen_len=" + "9" * 400)
    assert len(path.parent.parent.name.encode()) <= results.MAX_FOLDER_CHARS


# ---- sizes ----------------------------------------------------------------------------------------

def test_a_cluster_too_large_to_hold_is_refused_even_with_allow_large(tmp_path):
    message = refused(tmp_path, "cluster.num_nodes=1000000000000000000000000000000", "allow_large=true")
    assert "4000000000000000000000000000000 devices" in message and "hard limit" in message, message
    assert "allow_large=true does not lift" in message


def _sizes(devices: int, samples: int, allow_large: bool) -> SimpleNamespace:
    return SimpleNamespace(allow_large=allow_large, cluster=SimpleNamespace(num_nodes=devices, gpus_per_node=1),
                           workload=SimpleNamespace(global_batch_size=samples, path=None))


def test_hard_limits_are_exact_and_allow_large_lifts_only_the_soft_ones():
    cons.check_sizes(_sizes(cons.HARD_MAX_DEVICES, cons.HARD_MAX_SAMPLES, allow_large=True))
    with pytest.raises(ConfigError, match="hard limit"):
        cons.check_sizes(_sizes(cons.HARD_MAX_DEVICES + 1, 1, allow_large=True))
    with pytest.raises(ConfigError, match="global_batch_size=.*hard limit"):
        cons.check_sizes(_sizes(1, cons.HARD_MAX_SAMPLES + 1, allow_large=True))
    with pytest.raises(ConfigError, match="set allow_large=true"):
        cons.check_sizes(_sizes(cons.MAX_DEVICES + 1, 1, allow_large=False))


# ---- engine YAML files ----------------------------------------------------------------------------

ENGINE_FILES = {  # name -> (content, text the message must contain)
    "not_yaml": (b"batching: [static\nkernels: graph\n", "broken.yaml:2: not valid YAML"),
    "not_a_mapping": (b"- static\n- eager\n", "broken.yaml:1: a generation-engine file is a YAML mapping"),
    "unknown_key": (b"batching: static\ncuda_graphs: 8\n", "broken.yaml:2: unknown generation-engine key(s) ['cuda_graphs']"),
    "wrong_type": (b"batching: static\nkv_cache_passes: fast\n", "broken.yaml:2: kv_cache_passes='fast' must be a number"),
    "binary": (b"batching: static\n\xff\xfe\x00\x01", "broken.yaml:2: not UTF-8 text"),
}


@pytest.mark.parametrize("case", list(ENGINE_FILES))
def test_a_bad_engine_file_is_one_line_naming_file_and_line(tmp_path, case):
    content, expected = ENGINE_FILES[case]
    path = tmp_path / "broken.yaml"
    path.write_bytes(content)
    message = refused(tmp_path, f"engine.generation={path}")
    assert f"{tmp_path}/{expected}" in message, message


def test_an_engine_path_that_is_a_directory_says_so(tmp_path):
    folder = tmp_path / "engine.yaml"
    folder.mkdir()
    assert "is a directory, not a file" in refused(tmp_path, f"engine.training={folder}")


# ---- profile tables -------------------------------------------------------------------------------

PROFILES = {  # name -> (content, line, text the message must contain)
    "unknown_op": (HEADER + "forward,tiny,1,100,0.1\nsideways,tiny,1,100,0.1\n", 3, "op 'sideways' is not one of"),
    "not_a_number": (HEADER + "forward,tiny,1,many,0.1\n", 2, "column num_tokens must be a number, got 'many'"),
    "negative": (HEADER + "forward,tiny,1,100,-0.5\n", 2, "column time_s must be finite and >= 0"),
    "wrong_columns": ("op,model,tokens,time\nforward,tiny,100,0.1\n", 1, "lacks column(s) tp, num_tokens, time_s"),
    "empty": ("", 1, "empty file"),
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00\xff\xfe", 1, "not UTF-8 text"),
    "nul_byte": (HEADER + "forward,tiny,1,100,0.1\x00\n", 2, "a NUL byte"),
}


@pytest.mark.parametrize("case", list(PROFILES))
def test_a_bad_profile_table_is_one_line_naming_file_and_line(tmp_path, case):
    content, line, expected = PROFILES[case]
    path = tmp_path / "profile.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    message = refused(tmp_path, f"backend.profile_table={path}")
    assert message.startswith(f"backend.profile_table: {path}:{line}: ") and expected in message, message


def test_a_profile_table_that_is_a_device_says_so(tmp_path):
    assert refused(tmp_path, "backend.profile_table=/dev/null") == \
        "backend.profile_table='/dev/null': is a character device, not a file"


# ---- the command line's check of input files (single runs and every sweep job) -------------------

def test_the_command_line_check_reads_each_input_file_once_per_sweep(tmp_path, monkeypatch):
    from harness.costmodel.profile import ProfileTable

    path = tmp_path / "profile.csv"
    path.write_text(HEADER + "sideways,tiny,1,100,0.1\n")
    reads = []
    original = ProfileTable.from_csv.__func__
    monkeypatch.setattr(ProfileTable, "from_csv", classmethod(lambda cls, p: reads.append(p) or original(cls, p)))
    with pytest.raises(ConfigError, match=rf"{path}:2: op 'sideways'"):
        check_command_line(["-m", *TINY, f"backend.profile_table={path}", "seed=0,1,2"])
    assert reads == [str(path)]  # three jobs, one read
    reads.clear()
    with pytest.raises(ConfigError, match=rf"{path}:2: op 'sideways'"):
        check_command_line([*TINY, f"backend.profile_table={path}"])
    assert reads == [str(path)]


def test_the_command_line_check_covers_workload_and_engine_files_in_later_sweep_jobs(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("batching: static\nkernels: graph: eager\n")
    with pytest.raises(ConfigError, match=rf"^{broken}:2: not valid YAML"):
        check_command_line(["-m", *TINY, f"engine.generation=vllm,{broken}"])  # the second job's file
    with pytest.raises(ConfigError, match="workload.path='/dev/null': is a character device, not a regular file"):
        check_command_line([*(o for o in TINY if o != "workload=tiny"), "workload=jsonl", "workload.path=/dev/null"])
    good = tmp_path / "good.csv"
    good.write_text(HEADER + "forward,tiny,1,100,0.1\n")
    check_command_line(["-m", *TINY, f"backend.profile_table={good}", "seed=0,1"])  # accepted


def test_a_sweep_with_a_bad_profile_table_is_refused_before_any_job(tmp_path, run_harness):
    path = tmp_path / "profile.csv"
    path.write_text(HEADER + "forward,tiny,1,-100,0.1\n")
    line = run_refused(run_harness, tmp_path, "-m", *TINY, f"backend.profile_table={path}", "seed=0,1,2")
    assert line == f"error: backend.profile_table: {path}:2: column num_tokens must be finite and >= 0", line


# ---- results_dir, workload.path, cluster.calibration ----------------------------------------------

def test_a_results_dir_that_is_not_a_folder_says_what_it_is(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    with pytest.raises(ConfigError, match=rf"^results_dir='{file}' is a file, not a folder"):
        cons.check_results_dir_writable(str(file))
    with pytest.raises(ConfigError, match=r"^results_dir='/dev/null' is a character device, not a folder"):
        cons.check_results_dir_writable("/dev/null")
    with pytest.raises(ConfigError, match=rf"cannot be written: {file} is a file, not a folder"):
        cons.check_results_dir_writable(str(file / "results"))


@needs_proc
def test_an_unwritable_results_dir_names_the_folder_and_the_reason():
    with pytest.raises(ConfigError, match=r"cannot be written: no file can be created in /proc \("):
        cons.check_results_dir_writable(str(UNWRITABLE))


@pytest.mark.parametrize("value", ["", " ", ".", "CWD", "sub/.."])
def test_an_empty_results_dir_or_the_current_folder_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    value = str(tmp_path) if value == "CWD" else value
    with pytest.raises(ConfigError, match="results_dir.*(empty|is the current folder).*name a folder"):
        cons.check_results_dir_writable(value)
    cons.check_results_dir_writable("results")  # a folder below it is fine
    assert list(tmp_path.iterdir()) == [tmp_path / "sub"]


def test_the_current_folder_as_results_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [*TINY, "results_dir=."]
    with pytest.raises(ConfigError, match="is the current folder"):
        execute(compose(args), args)
    assert list(tmp_path.iterdir()) == []


def test_a_workload_path_that_is_not_a_regular_file_says_what_it_is(tmp_path):
    with pytest.raises(ConfigError, match=r"^workload.path='/dev/null': is a character device, not a regular file$"):
        resolve_workload_path("/dev/null")
    with pytest.raises(ConfigError, match=r"is a directory, not a regular file$"):
        resolve_workload_path(str(tmp_path))


def test_a_calibration_file_is_taken_as_it_is_named(tmp_path):
    for name in ("my_h100", "my_h100.cal"):  # no .json appended
        copy = tmp_path / name
        shutil.copy(FITTED_DIR / "h100.json", copy)
        assert calibration_path(str(copy)) == copy.resolve()
        assert Calibration.load(str(copy)).gpu == "h100"
    assert calibration_path("h100") == (FITTED_DIR / "h100.json").resolve()


def test_an_unknown_calibration_lists_the_names_and_says_a_path_must_exist(tmp_path):
    with pytest.raises(ValueError, match=r"cluster.calibration='h200': no calibration of that name "
                                         r"\(names: a100, h100\) and no such file"):
        Calibration.load("h200")
    missing = tmp_path / "cal"
    with pytest.raises(ValueError, match=rf"calibration file {missing}: no such file .*a name \(a100, h100\) "
                                         rf"or the path of an existing calibration file"):
        Calibration.load(str(missing))
    message = refused(tmp_path, "cluster.cost_model=calibrated", f"cluster.calibration={missing}")
    assert f"calibration file {missing}: no such file" in message
    broken = tmp_path / "broken"
    broken.write_text('{"format_version": 1,\n"laws": }\n')
    with pytest.raises(ValueError, match=rf"{broken}:2: not a calibration file \(invalid JSON"):
        Calibration.load(str(broken))


# ---- lock files -----------------------------------------------------------------------------------

def test_a_finished_run_and_a_failure_record_leave_no_lock_file(tmp_path, monkeypatch):
    locks = tmp_path / "locks"
    monkeypatch.setattr(results, "LOCK_DIR", locks)
    args = [*TINY, f"results_dir={tmp_path / 'results'}"]
    outcome = execute(compose(args), args)
    assert results.is_finished(outcome.path)
    assert list(locks.iterdir()) == []
    assert execute(compose(args), args).skipped  # the second finds the result; no lock left either
    results.record_failure(tmp_path / "results", "default", {"system": "x", "seed": 0}, ValueError("boom"))
    results.clear_failure(tmp_path / "results", "default", {"system": "x", "seed": 0})
    assert list(locks.iterdir()) == []


def test_a_lock_file_is_removed_only_by_its_holder_and_holders_never_overlap(tmp_path, monkeypatch):
    """Threads lock through their own open file descriptions, as processes do (flock). Holders that
    waited on a file its last holder removed must not run beside one that locked the new file."""
    monkeypatch.setattr(results, "LOCK_DIR", tmp_path / "locks")
    lock_file = results._lock_file(tmp_path / "run", "run")
    inside, seen, counter = [0], [], threading.Lock()

    def worker() -> None:
        for _ in range(25):
            with results.run_lock(tmp_path / "run"):
                assert lock_file.exists()  # held: never removed under its holder
                with counter:
                    inside[0] += 1
                    seen.append(inside[0])
                time.sleep(0.0005)
                with counter:
                    inside[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 150 and max(seen) == 1
    assert not lock_file.exists()


# ---- python -m harness.replay -------------------------------------------------------------------

def _replay(tmp_path: Path, overrides: list[str]) -> Path:
    import json

    path = tmp_path / "replay.jsonl"
    path.write_text(json.dumps({"id": "X1", "overrides": overrides, "metric": "step_s", "value": 1.0,
                                "source": "test"}) + "\n")
    return path


def test_a_binary_replay_file_is_refused_naming_the_line(tmp_path):
    path = _replay(tmp_path, TINY)
    path.write_bytes(path.read_bytes() + b"\x7fELF\xff\x00\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: not UTF-8 text"):
        validate.read_replay(path)


@needs_proc
def test_an_unwritable_json_output_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(validate, "read_replay", lambda path: calls.append(path) or [])
    assert validate.main([str(tmp_path / "replay.jsonl"), "--json", str(UNWRITABLE / "out.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: --json {UNWRITABLE / 'out.json'}: cannot be written: no file can be created in /proc "
                   f"(No such file or directory)"] and calls == []


def test_a_json_output_that_is_a_directory_is_refused(tmp_path, capsys):
    assert validate.main([str(_replay(tmp_path, TINY)), "--json", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --json {tmp_path}: is a directory; name a file\n"


def test_a_replay_line_without_a_system_says_it_needs_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(validate, "simulate_summary", lambda cfg: pytest.fail("simulated"))
    path = _replay(tmp_path, ["model=tiny", "system.gen_tp=2"])
    assert validate.main([str(path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: point X1 ({path}:1): no system chosen: its overrides need +system=<name> "
                           f"(available: "), line
    assert "rlhfuse" in line


def test_ctrl_c_in_validate_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "read_replay", interrupted)
    assert validate.main([str(tmp_path / "replay.jsonl")]) == 130
    assert capsys.readouterr().err == "interrupted\n"


# ---- python -m harness.report ---------------------------------------------------------------------

@needs_proc
@pytest.mark.parametrize("option,shown", [("-o", "--output"), ("--plot", "--plot")])
def test_an_unwritable_report_output_is_refused_before_reading(tmp_path, monkeypatch, capsys, option, shown):
    calls = []
    monkeypatch.setattr(report, "find_experiments", lambda paths: calls.append(paths) or [])
    assert report.main([str(tmp_path), option, str(UNWRITABLE / "report.md")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {shown} {UNWRITABLE}/report.") and "cannot be written" in line, line
    assert calls == []


def test_a_report_output_under_a_file_is_refused(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    assert report.main([str(tmp_path), "-o", str(file / "report.md")]) == 2
    assert capsys.readouterr().err == (f"error: --output {file / 'report.md'}: cannot be created: {file} is a file, "
                                       f"not a directory\n")


def test_a_file_given_as_results_folder_says_it_is_a_file(tmp_path, capsys):
    file = tmp_path / "summary.json"
    file.write_text("{}")
    assert report.main([str(file)]) == 2
    assert capsys.readouterr().err == (f"error: {file}: is a file, not a results folder (expected "
                                       f"results/<experiment>)\n")


def test_ctrl_c_in_report_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    def interrupted(paths):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "find_experiments", interrupted)
    assert report.main([str(tmp_path)]) == 130
    assert capsys.readouterr().err == "interrupted\n"
