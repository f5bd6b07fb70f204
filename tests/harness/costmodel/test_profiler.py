"""The local op profiler: ``python -m harness.calibrate profile`` writes a
Vidur-format ``mlp.csv`` that ``measured.load_compute`` reads like the public profiles."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import calibrate
from harness.costmodel import measured as ms
from harness.costmodel import profiler
from harness.real.model import load_llama_config

REPO = Path(__file__).resolve().parents[3]
SMALL, LARGE = 1, 512
GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One CPU run of the tiny model through the command's function (1 thread: on a shared
    2-core machine multi-threaded tiny GEMMs can stall for a scheduler quantum)."""
    out = tmp_path_factory.mktemp("profiles")
    path, text = calibrate.profile("tiny", [SMALL, 64, LARGE], out, device="cpu", repeats=15,
                                   warmup=3, threads=1)
    return out, path, text


def test_profile_writes_where_documented(profiled):
    out, path, text = profiled
    name = profiler.device_name("cpu")
    assert path == out / profiler.slug(name) / "tiny" / "mlp.csv"
    assert path.is_file()
    assert f"# wrote {path}" in text
    assert "qkv" in text and "layer" in text


def test_csv_header_is_vidur_format(profiled):
    _, path, _ = profiled
    with path.open() as fh:
        header = next(csv.reader(fh))
    with ms.compute_files()[0][2].open() as fh:
        vidur = next(csv.reader(fh))
    # Vidur's columns first, in Vidur's order; our extras after them.
    assert header[:len(vidur)] == vidur
    assert header[len(vidur):] == list(profiler.EXTRA_COLUMNS)


def test_loader_reads_profile_back(profiled):
    out, _, _ = profiled
    cfg = load_llama_config("tiny")
    df = ms.load_compute(root=out)
    assert set(df["gpu"]) == {profiler.slug(profiler.device_name("cpu"))}
    assert set(df["model"]) == {"tiny"}
    assert set(df["op"]) == set(ms.OPS)
    assert sorted(df["num_tokens"].unique()) == [SMALL, 64, LARGE]
    assert set(df["tp"]) == {1}
    assert len(df) == len(ms.OPS) * 3
    assert (df["time_s"] > 0).all()
    assert (df["time_s"] < 1.0).all()  # seconds, not ms
    row = df.iloc[0]
    assert (row["n_head"], row["n_kv_head"], row["n_embd"], row["n_expanded_embd"],
            row["vocab_size"], bool(row["use_gated_mlp"])) == (
        cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size, cfg.ffn_hidden_size,
        cfg.vocab_size, True)
    # The work and the scaling rule apply to the local rows as to the public ones.
    laws = ms.fit_scaling(df.assign(gpu="local"))
    assert {c for (_, c, _) in laws} == set(ms.OP_CLASSES)


def test_gemm_times_grow_with_num_tokens(profiled):
    out, _, _ = profiled
    df = ms.load_compute(root=out)
    med = df.set_index(["op", "num_tokens"])["time_s"]
    for op in GEMMS:
        assert med[(op, LARGE)] >= med[(op, SMALL)], op


def test_rows_have_stats_and_extras():
    cfg = load_llama_config("tiny")
    rows = profiler.profile_ops(cfg, [4], device="cpu", tp=2, repeats=5, warmup=1,
                                num_threads=1)
    (row,) = rows
    assert list(row) == list(profiler.COLUMNS)
    for op in ms.OPS:
        lo, hi = row[f"time_stats.{op}.min"], row[f"time_stats.{op}.max"]
        assert 0 < lo <= row[f"time_stats.{op}.median"] <= hi
        assert lo <= row[f"time_stats.{op}.mean"] <= hi
        assert row[f"time_stats.{op}.std"] >= 0
    assert (row["num_tokens"], row["num_tensor_parallel_workers"]) == (4, 2)
    assert (row["device"], row["dtype"], row["threads"], row["repeats"]) == ("cpu", "float32", 1, 5)
    # Per-rank shapes at tp=2 of the tiny model (h=64, 4 heads / 2 KV heads, ffn=172).
    assert profiler.local_dims(cfg, 2) == {"heads": 2, "kv_heads": 1, "head_dim": 16, "q": 32,
                                           "kv": 16, "h_tp": 32, "f_tp": 86, "vocab_tp": 128}


def test_compute_files_reads_both_layouts(tmp_path):
    # Vidur layout (<root>/compute/<gpu>/<model>) is unchanged.
    assert {g for g, _, _ in ms.compute_files()} == set(ms.GPUS)
    # The local layout (<root>/<device>/<model>); stray files are ignored.
    (tmp_path / "dev" / "m").mkdir(parents=True)
    (tmp_path / "dev" / "m" / "mlp.csv").write_text("x\n")
    (tmp_path / "README.md").write_text("notes\n")
    assert ms.compute_files(tmp_path) == [("dev", "m", tmp_path / "dev" / "m" / "mlp.csv")]
    assert ms.compute_files(tmp_path / "missing") == []


def test_cli_subprocess(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "harness.calibrate", "profile", "--model", "tiny",
         "--num-tokens", "1", "8", "--repeats", "3", "--warmup", "1", "--threads", "1",
         "--device", "cpu", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "# wrote" in proc.stdout
    (path,) = tmp_path.glob("*/tiny/mlp.csv")
    df = ms.load_compute(root=tmp_path)
    assert sorted(df["num_tokens"].unique()) == [1, 8]
    assert path.parent.parent.name == df["gpu"].iloc[0]


def _vidur_copy(tmp_path: Path, scale_op: str | None = None, factor: float = 1.0) -> Path:
    """The public H100 Llama-2-7B file as if our profiler had written it, optionally with one op's
    times scaled."""
    src = ms.PROFILE_DIR / "compute" / "h100" / "Llama-2-7b-hf" / "mlp.csv"
    dst = tmp_path / "local" / "some-device" / "llama2_7b" / "mlp.csv"
    dst.parent.mkdir(parents=True)
    import pandas as pd

    raw = pd.read_csv(src)
    if scale_op is not None:
        cols = [c for c in raw.columns if c.startswith(f"time_stats.{scale_op}.")]
        raw[cols] = raw[cols] * factor
    raw.to_csv(dst, index=False)
    return tmp_path / "local"


def test_compare_with_vidur_itself_is_exactly_one(tmp_path):
    df, header = calibrate.compare(_vidur_copy(tmp_path), "h100")
    assert "llama2_7b = Llama-2-7b-hf" in header
    assert set(df["op_class"]) == {"act", "add", "embedding", "gemm", "norm", "rope", "layer"}
    assert (df["ratio"] == 1.0).all() and (df["max"] == 0.0).all()


def test_compare_sees_one_slow_op(tmp_path):
    df, _ = calibrate.compare(_vidur_copy(tmp_path, "attn_rope", 3.0), "h100")
    rope = df[df["op_class"] == "rope"]
    assert len(rope) == 3 and (rope["ratio"] - 3.0).abs().max() < 1e-12
    assert (df[df["op_class"] == "gemm"]["ratio"] == 1.0).all()
    layer = df[(df["op_class"] == "layer") & (df["group"] == "all")]
    assert 1.0 < float(layer["ratio"].iloc[0]) < 3.0


def test_compare_refuses_unmatched_shapes(tmp_path, profiled):
    out, _, _ = profiled  # the tiny model: no Vidur file has its shape
    with pytest.raises(ValueError, match="no profile row"):
        calibrate.compare(out, "h100")
    proc = subprocess.run([sys.executable, "-m", "harness.calibrate", "compare", "--local", str(tmp_path / "none")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such folder" in proc.stderr


def test_compare_keeps_each_device_apart(tmp_path):
    # two profiled devices, one with rope 3x slower: each gets its own rows, never a pooled median
    root = _vidur_copy(tmp_path / "a", "attn_rope", 3.0)
    other = root / "other-device" / "llama2_7b"
    other.mkdir(parents=True)
    (other / "mlp.csv").write_text((_vidur_copy(tmp_path / "b") / "some-device" / "llama2_7b" / "mlp.csv").read_text())
    df, header = calibrate.compare(root, "h100")
    assert set(df["gpu"]) == {"some-device", "other-device"}
    rope = df[df["op_class"] == "rope"].set_index("gpu")["ratio"]
    assert (rope["some-device"] - 3.0).abs().max() < 1e-12 and (rope["other-device"] == 1.0).all()
    assert header.count("# ours (") == 2
    table = calibrate.format_table(df)
    assert table.splitlines()[0].startswith("device") and "other-device" in table
