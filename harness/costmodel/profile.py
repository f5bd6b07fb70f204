"""Measured op times that override the analytic roofline (docs/DESIGN.md section 4, "A profile-table
backend").

Owns the CSV format and the lookup rule. A profile is a CSV with a header row naming (at
least) the columns ``op,model,tp,num_tokens,time_s``; extra columns (notes, GPU name, ...)
are ignored. One row is one measured op on one GPU of a tp group:

* ``op``: ``forward``, ``backward``, ``prefill``, ``decode_step`` or ``optimizer_step``;
* ``model``: the ``LlamaConfig.name`` it was measured for;
* ``tp``: the tensor-parallel size;
* ``num_tokens``: tokens processed by the op -- micro-batch tokens for forward/backward,
  prompt tokens for prefill, the batch size (tokens emitted per step) for decode_step,
  and anything (e.g. 0) for optimizer_step, whose lookup ignores it;
* ``time_s``: seconds for the whole model (all layers) on one tp group, pp = 1.

:meth:`ProfileTable.lookup` returns the measured time for an exact ``num_tokens``, else
interpolates linearly between the two nearest measured sizes of the same (op, model, tp),
or extrapolates from the two outermost ones (clamped at zero); with a single measured size
it scales proportionally to ``num_tokens``. Repeated measurements of one size are averaged.
How a looked-up time is adapted to a pipeline stage is the cost model's business.

:meth:`ProfileTable.from_csv` refuses a file that is not UTF-8 CSV text, is empty, lacks a column or
holds a bad value with a ValueError ``<path>:<line>: <what>``; :func:`load_profile_table` (the
run's ``backend.profile_table``) turns it into a one-line :class:`~harness.errors.ConfigError`.
"""
from __future__ import annotations

import bisect
import csv
import io
import os
from typing import Optional

from harness.core.files import file_kind

OPS = ("forward", "backward", "prefill", "decode_step", "optimizer_step")
COLUMNS = ("op", "model", "tp", "num_tokens", "time_s")

_Key = tuple[str, str, int]


class ProfileTable:
    """Measured times keyed by (op, model name, tp), each a sorted curve over num_tokens."""

    def __init__(self, rows: dict[_Key, dict[float, list[float]]], source: str = "<memory>"):
        self.source = source
        self._curves: dict[_Key, tuple[list[float], list[float]]] = {}
        for key, by_tokens in rows.items():
            xs = sorted(by_tokens)
            ys = [sum(by_tokens[x]) / len(by_tokens[x]) for x in xs]
            self._curves[key] = (xs, ys)

    def __len__(self) -> int:
        return sum(len(xs) for xs, _ in self._curves.values())

    def keys(self) -> list[_Key]:
        return sorted(self._curves)

    @classmethod
    def from_csv(cls, path: str | os.PathLike) -> "ProfileTable":
        path = os.fspath(path)
        if not os.path.isfile(path):
            if os.path.exists(path):  # a directory, a device, a pipe
                raise ValueError(f"profile table {path}: is {file_kind(path)}, not a file")
            raise ValueError(f"profile table {path}: no such file")
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ValueError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); a profile table is a "
                             f"CSV file with the header {','.join(COLUMNS)}") from None
        if "\0" in text:
            line = text.count("\n", 0, text.index("\0")) + 1
            raise ValueError(f"{path}:{line}: a NUL byte (a binary file?); a profile table is a CSV file with the "
                             f"header {','.join(COLUMNS)}")
        rows: dict[_Key, dict[float, list[float]]] = {}
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            if reader.fieldnames is None:
                raise ValueError(f"{path}:1: empty file; a profile table is a CSV file with the header "
                                 f"{','.join(COLUMNS)}")
            header = [c.strip() for c in reader.fieldnames]
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise ValueError(
                    f"{path}:1: profile table lacks column(s) {', '.join(missing)}; "
                    f"expected header {','.join(COLUMNS)}, got {','.join(header) or 'nothing'}"
                )
            reader.fieldnames = header
            for row in reader:
                key, num_tokens, time_s = _parse_row(row, path, reader.line_num)
                rows.setdefault(key, {}).setdefault(num_tokens, []).append(time_s)
        except csv.Error as e:
            raise ValueError(f"{path}:{reader.line_num}: not CSV ({e})") from None
        return cls(rows, source=path)

    def lookup(self, op: str, model_name: str, tp: int, num_tokens: float) -> Optional[float]:
        """Measured (or interpolated) seconds, or ``None`` if (op, model, tp) was never
        measured."""
        curve = self._curves.get((op, model_name, int(tp)))
        if curve is None:
            return None
        xs, ys = curve
        if op == "optimizer_step":  # does not depend on tokens: the mean measurement
            return sum(ys) / len(ys)
        i = bisect.bisect_left(xs, num_tokens)
        if i < len(xs) and xs[i] == num_tokens:
            return ys[i]
        if len(xs) == 1:
            return ys[0] * num_tokens / xs[0] if xs[0] > 0 else ys[0]
        i = min(max(i, 1), len(xs) - 1)  # segment [i-1, i]; the outermost one outside
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0))


def load_profile_table(path: str) -> ProfileTable:
    """The table ``backend.profile_table`` names; a file that is missing or malformed raises
    :class:`~harness.errors.ConfigError`, one line naming the file and, where there is one, the line."""
    from harness.errors import ConfigError

    try:
        return ProfileTable.from_csv(path)
    except ValueError as e:
        message = str(e).removeprefix(f"profile table {path}: ")
        raise ConfigError(f"backend.profile_table={path!r}: {message}" if message != str(e)
                          else f"backend.profile_table: {e}") from None


def _parse_row(row: dict, path: str, line: int) -> tuple[_Key, float, float]:
    if None in row:
        raise ValueError(f"{path}:{line}: more fields than header columns")
    values = {c: (row.get(c) or "").strip() for c in COLUMNS}
    if values["op"] not in OPS:
        raise ValueError(f"{path}:{line}: op {values['op']!r} is not one of {', '.join(OPS)}")
    if not values["model"]:
        raise ValueError(f"{path}:{line}: empty model name")
    numbers = {}
    for col in ("tp", "num_tokens", "time_s"):
        try:
            numbers[col] = float(values[col])
        except ValueError:
            raise ValueError(
                f"{path}:{line}: column {col} must be a number, got {values[col]!r}"
            ) from None
        if not numbers[col] >= 0 or numbers[col] == float("inf"):
            raise ValueError(f"{path}:{line}: column {col} must be finite and >= 0")
    if numbers["tp"] < 1 or numbers["tp"] != int(numbers["tp"]):
        raise ValueError(f"{path}:{line}: tp must be a positive integer, got {values['tp']!r}")
    key = (values["op"], values["model"], int(numbers["tp"]))
    return key, numbers["num_tokens"], numbers["time_s"]
