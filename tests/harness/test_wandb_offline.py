"""The W&B record of a run says what results/ says (docs/DESIGN.md sections 1, 7, 8).

One harness run with ``logger=wandb logger.mode=offline`` (subprocess, no credentials), then the
offline run is read back from ``<run folder>/wandb/``: with ``wandb leet inspect --json`` (the
wandb CLI's own reader of the ``.wandb`` transaction log), or, where that CLI cannot run, by
parsing the log here (W&B's LevelDB-style record log of ``wandb_internal_pb2.Record`` messages).
Checked: every iteration's history equals ``metrics.jsonl``; the run summary equals
``summary.json``'s ``metrics`` under the same keys (the averages, not W&B's default of the last
iteration's values, and nothing else but W&B's own ``_`` keys); the config's ``provenance`` equals
``summary.json``'s; the run's name is ``<system>-<model>-seed<k>[-<variant>]`` and its group the
experiment.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")

EXPERIMENT, SYSTEM, MODEL, SEED = "wandb_readback", "rlhfuse_base", "7b", 1
VARIANT = "cluster.num_nodes=1"
ARGS = [f"+system={SYSTEM}", f"model={MODEL}", f"seed={SEED}", f"experiment_name={EXPERIMENT}", "logger=wandb",
        "logger.mode=offline", "cluster.num_nodes=1", "backend.num_iterations=3", "logger.progress_bar=false"]


# ---- two readers of a .wandb file, one normalised shape ----------------------------------------------
# {"name", "group", "job_type", "project", "config": {...}, "history": [{key: value}], "summary": {...},
#  "exit_code": int}

def _empty() -> dict:
    return {"config": {}, "history": [], "summary": {}, "exit_code": None}


def _wandb_cli() -> str | None:
    exe = Path(sys.executable).with_name("wandb")
    return str(exe) if exe.exists() else shutil.which("wandb")


def read_with_leet(wandb_file: Path) -> dict | None:
    """Records through ``wandb leet inspect --json``; None when the CLI cannot run here."""
    cli = _wandb_cli()
    if cli is None:
        return None
    try:
        proc = subprocess.run([cli, "leet", "inspect", "--json", str(wandb_file)],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    out = _empty()
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        kind = rec.get("type")
        if kind == "run":
            run = rec["run"]
            out.update(name=run.get("display_name"), group=run.get("run_group"),
                       job_type=run.get("job_type"), project=run.get("project"))
            out["config"].update(run.get("config", {}).get("update", {}))
        elif kind == "config":
            out["config"].update(rec["config"].get("update", {}))
        elif kind == "history":
            out["history"].append(rec["history"]["item"])
        elif kind == "summary":
            out["summary"].update(rec["summary"].get("update", {}))
            for item in rec["summary"].get("remove", []):
                out["summary"].pop(item.get("key") or ".".join(item.get("nested_key", [])), None)
        elif kind == "exit":
            out["exit_code"] = rec["exit"].get("exit_code", 0)
    return out


_LOG_HEADER = struct.Struct("<4sHB")   # ":W&B", magic 0xBEE1, version
_RECORD_HEADER = struct.Struct("<IHB")  # checksum, payload length, type (1 full, 2 first, 3 middle, 4 last)
_BLOCK = 32768


def _items(items) -> dict:
    return {(it.key or ".".join(it.nested_key)): json.loads(it.value_json) for it in items}


def read_with_protobuf(wandb_file: Path) -> dict:
    """Parse the transaction log directly: LevelDB log framing around wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = wandb_file.read_bytes()
    ident, magic, _version = _LOG_HEADER.unpack_from(data)
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{wandb_file} is not a W&B transaction log"
    out, pos, chunks = _empty(), _LOG_HEADER.size, []
    while pos + _RECORD_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER.size:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunks.append(data[pos + _RECORD_HEADER.size: pos + _RECORD_HEADER.size + length])
        pos += _RECORD_HEADER.size + length
        if kind not in (1, 4):  # first or middle fragment of a record spanning blocks
            continue
        rec = pb.Record()
        rec.ParseFromString(b"".join(chunks))
        chunks = []
        which = rec.WhichOneof("record_type")
        if which == "run":
            out.update(name=rec.run.display_name, group=rec.run.run_group, job_type=rec.run.job_type,
                       project=rec.run.project)
            out["config"].update(_items(rec.run.config.update))
        elif which == "config":
            out["config"].update(_items(rec.config.update))
        elif which == "history":
            out["history"].append(_items(rec.history.item))
        elif which == "summary":
            out["summary"].update(_items(rec.summary.update))
            for item in rec.summary.remove:
                out["summary"].pop(item.key or ".".join(item.nested_key), None)
        elif which == "exit":
            out["exit_code"] = rec.exit.exit_code
    return out


# ---- the run -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, run_harness):
    tmp = tmp_path_factory.mktemp("wandb_offline")
    results_dir = tmp / "results"
    proc = run_harness([*ARGS, f"results_dir={results_dir}"], cwd=tmp / "cwd")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = results_dir / EXPERIMENT / f"{SYSTEM},{VARIANT}" / MODEL / f"seed{SEED}"
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline .wandb log under {run_dir / 'wandb'}, found {files}"
    return run_dir, files[0]


@pytest.fixture(scope="module")
def wandb_record(offline_run):
    _, wandb_file = offline_run
    return read_with_leet(wandb_file) or read_with_protobuf(wandb_file)


def _assert_close(logged: dict, expected: dict, what: str) -> None:
    assert set(logged) == set(expected), f"{what}: keys differ: {set(logged) ^ set(expected)}"
    for key, value in expected.items():
        assert math.isclose(logged[key], value, rel_tol=1e-9, abs_tol=0.0), f"{what} {key}: {logged[key]} != {value}"


def test_offline_run_lives_in_the_run_folder(offline_run):
    run_dir, wandb_file = offline_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["run"]["wandb_mode"] == "offline"
    assert wandb_file.stat().st_size > 0
    latest = run_dir / "wandb" / "latest-run"
    if latest.is_symlink():  # W&B's relative link must survive the atomic rename of the run folder
        assert latest.resolve() == wandb_file.parent.resolve()


def test_history_equals_metrics_jsonl(offline_run, wandb_record):
    run_dir, _ = offline_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    history = wandb_record["history"]
    assert [h["_step"] for h in history] == list(range(len(rows)))
    for step, (logged, row) in enumerate(zip(history, rows)):
        _assert_close({k: v for k, v in logged.items() if not k.startswith("_")}, row, f"iteration {step}")


def test_summary_equals_summary_json(offline_run, wandb_record):
    run_dir, wandb_file = offline_run
    metrics = json.loads((run_dir / "summary.json").read_text())["metrics"]
    logged = {k: v for k, v in wandb_record["summary"].items() if not k.startswith("_")}
    _assert_close(logged, metrics, "summary")
    assert wandb_record["exit_code"] == 0
    # W&B writes files/wandb-summary.json when it syncs (online); offline runs may not have it
    summary_file = wandb_file.parent / "files" / "wandb-summary.json"
    if summary_file.is_file():
        on_disk = json.loads(summary_file.read_text())
        _assert_close({k: v for k, v in on_disk.items() if not k.startswith("_")}, metrics, "wandb-summary.json")


def test_summary_holds_averages_not_the_last_iteration(offline_run, wandb_record):
    """3 iterations, 1 warm-up: the summary averages the last two, so it differs from the last
    iteration (W&B's default run summary) and the W&B summary must hold the average."""
    run_dir, _ = offline_run
    metrics = json.loads((run_dir / "summary.json").read_text())["metrics"]
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    differ = [k for k in ("perf/samples_per_s", "timing_s/step") if not math.isclose(metrics[k], last[k])]
    assert differ, "the averages equal the last iteration: the check below would prove nothing"
    for key in differ:
        assert math.isclose(wandb_record["summary"][key], metrics[key], rel_tol=1e-9)
    assert not any(k.startswith("summary/") for k in wandb_record["summary"])


def test_config_provenance_equals_summary_json(offline_run, wandb_record):
    run_dir, _ = offline_run
    provenance = json.loads((run_dir / "summary.json").read_text())["provenance"]
    assert wandb_record["config"]["provenance"] == provenance


def test_run_name_group_and_config(wandb_record):
    assert wandb_record["name"] == f"{SYSTEM}-{MODEL}-seed{SEED}-{VARIANT}"
    assert wandb_record["group"] == EXPERIMENT
    assert wandb_record["job_type"] == "benchmark"
    assert wandb_record["project"] == "rlhf-fusion-harness"
    config = wandb_record["config"]
    assert config["system"]["name"] == SYSTEM
    assert config["model"]["actor"]["name"] == MODEL
    assert config["seed"] == SEED
    assert config["experiment_name"] == EXPERIMENT
    assert config["backend"]["num_iterations"] == 3


def test_leet_and_protobuf_readers_agree(offline_run):
    """Keeps the fallback reader honest wherever the wandb CLI runs."""
    _, wandb_file = offline_run
    via_cli = read_with_leet(wandb_file)
    if via_cli is None:
        pytest.skip("`wandb leet inspect` is not usable here")
    via_pb = read_with_protobuf(wandb_file)
    for key in ("name", "group", "job_type", "project", "exit_code"):
        assert via_cli[key] == via_pb[key], key
    assert len(via_cli["history"]) == len(via_pb["history"])
    for a, b in zip(via_cli["history"], via_pb["history"]):
        _assert_close(a, b, "history")
    assert via_cli["config"]["system"] == via_pb["config"]["system"]
