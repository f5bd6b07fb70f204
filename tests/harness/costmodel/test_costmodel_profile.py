"""Profile CSV parsing, lookup rule and error messages."""
from __future__ import annotations

import pytest

from harness.costmodel import ProfileTable

CSV = """op,model,tp,num_tokens,time_s,note
forward,13b,1,1000,0.10,
forward,13b,1,3000,0.30,
forward,13b,1,3000,0.32,repeat
decode_step,13b,8,16,0.004,
optimizer_step,13b,8,0,0.02,
"""


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "profile.csv"
    path.write_text(CSV)
    return ProfileTable.from_csv(path)


def test_exact_interpolated_and_extrapolated(table):
    assert table.lookup("forward", "13b", 1, 1000) == pytest.approx(0.10)
    assert table.lookup("forward", "13b", 1, 3000) == pytest.approx(0.31)  # repeats averaged
    assert table.lookup("forward", "13b", 1, 2000) == pytest.approx(0.205)
    assert table.lookup("forward", "13b", 1, 5000) == pytest.approx(0.31 + 2000 * 0.21 / 2000)
    assert table.lookup("forward", "13b", 1, 0) == pytest.approx(0.0)  # clamped at zero


def test_single_point_scales_proportionally(table):
    assert table.lookup("decode_step", "13b", 8, 32) == pytest.approx(0.008)
    assert table.lookup("optimizer_step", "13b", 8, 12345) == pytest.approx(0.02)


def test_unknown_keys_give_none(table):
    assert table.lookup("forward", "13b", 2, 1000) is None
    assert table.lookup("forward", "7b", 1, 1000) is None
    assert table.lookup("backward", "13b", 1, 1000) is None


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="nope.csv"):
        ProfileTable.from_csv(tmp_path / "nope.csv")


def test_missing_column_names_file_and_header_line(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("op,model,tp,time_s\nforward,13b,1,0.1\n")
    with pytest.raises(ValueError, match=r"p\.csv:1: .*num_tokens"):
        ProfileTable.from_csv(path)


@pytest.mark.parametrize(
    "row, message",
    [
        ("forward,13b,1,many,0.1", r"p\.csv:3: column num_tokens must be a number"),
        ("forward,13b,1,100,fast", r"p\.csv:3: column time_s must be a number"),
        ("forward,13b,0.5,100,0.1", r"p\.csv:3: tp must be a positive integer"),
        ("sideways,13b,1,100,0.1", r"p\.csv:3: op 'sideways'"),
        ("forward,13b,1,100,-1", r"p\.csv:3: column time_s must be finite"),
    ],
)
def test_bad_values_name_file_and_line(tmp_path, row, message):
    path = tmp_path / "p.csv"
    path.write_text(f"op,model,tp,num_tokens,time_s\nforward,13b,1,1,0.1\n{row}\n")
    with pytest.raises(ValueError, match=message):
        ProfileTable.from_csv(path)
