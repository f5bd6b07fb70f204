"""``python -m harness.validate``: replaying published measurements in the simulator.

Oracles: malformed replay files are refused with the line named and before any simulation; the
predicted value is exactly what ``python -m harness`` reports for the same overrides; the summary
statistics match numpy on known ratios; the same file gives the same numbers twice.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import validate
from harness.errors import ConfigError

REPLAY = Path(__file__).resolve().parents[2] / "data" / "published" / "replay.jsonl"
TINY = ["+system=rlhfuse_base", "model=tiny", "workload=tiny", "cluster=h100_8x", "cluster.num_nodes=1",
        "cluster.gpus_per_node=4"]


def _write(tmp_path: Path, records: list) -> Path:
    path = tmp_path / "replay.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def _point(**kw):
    return {"id": "X1", "overrides": TINY, "metric": "step_s", "value": 1.0, "source": "test", **kw}


@pytest.mark.parametrize("record,message", [
    ("{not json", "not JSON"),
    ({"id": "X1", "metric": "step_s", "value": 1.0, "source": "s"}, "missing field"),
    (_point(metric="tokens"), "not one of"),
    (_point(value=-3), "positive number"),
    (_point(colour="red"), "unknown field"),
])
def test_malformed_lines_are_refused_naming_the_line(tmp_path, record, message):
    path = _write(tmp_path, [_point(id="X0"), record])
    with pytest.raises(ConfigError, match=message) as err:
        validate.read_replay(path)
    assert f"{path}:2" in str(err.value)


def test_duplicate_ids_and_missing_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="appears twice"):
        validate.read_replay(_write(tmp_path, [_point(), _point()]))
    with pytest.raises(ConfigError, match="does not exist"):
        validate.read_replay(tmp_path / "nope.jsonl")


def test_a_bad_override_stops_the_command_before_any_simulation(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(validate, "simulate_summary", lambda cfg: calls.append(cfg) or {})
    path = _write(tmp_path, [_point(id="ok"), _point(id="bad", overrides=TINY + ["system.no_such_key=1"])])
    assert validate.main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: point bad") and calls == []


def test_prediction_is_what_the_harness_reports(tmp_path, run_harness):
    path = _write(tmp_path, [_point(id="a", metric="step_s"), _point(id="b", metric="samples_per_s")])
    out = tmp_path / "out.json"
    assert validate.main([str(path), "--json", str(out)]) == 0
    records = {r["id"]: r for r in json.loads(out.read_text())}
    proc = run_harness([*TINY, "logger=none", "logger.progress_bar=false"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    [summary] = (tmp_path / "run").glob("results/default/*/tiny/seed*/summary.json")
    metrics = json.loads(summary.read_text())["metrics"]
    assert records["a"]["predicted"] == pytest.approx(metrics["timing_s/step"], rel=1e-12)
    assert records["b"]["predicted"] == pytest.approx(metrics["perf/samples_per_s"], rel=1e-12)
    assert records["a"]["ratio"] == records["a"]["predicted"] / 1.0


def test_statistics_of_known_ratios():
    ratios = [0.25, 0.5, 1.0, 2.0, 3.0]
    s = validate._stats(ratios)
    assert s["median"] == 1.0 and s["within_0.5_2x_frac"] == pytest.approx(0.6)
    assert s["p90"] == pytest.approx(2.6)


def test_committed_replay_file_reads_and_a_point_replays_deterministically():
    points = validate.read_replay(REPLAY)
    assert {p.metric for p in points} <= set(validate.METRICS)
    one = [p for p in points if p.id == "P038"]
    first, second = validate.replay(one), validate.replay(one)
    assert first == second and first[0]["predicted"] > 0 and first[0]["measured"] == 1184.31
