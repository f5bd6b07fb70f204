"""The one line a process prints when it has to compile the numba kernels (a cache miss), and the
silence when it finds them cached (harness/compiled.py). In-process, on a one-line kernel written
to a fresh folder, so its first call is a cache miss whatever ran before."""
from __future__ import annotations

import importlib.util
import io
import sys

import pytest

from harness import compiled

pytestmark = pytest.mark.skipif(not compiled.AVAILABLE, reason="numba absent or HARNESS_PURE_PYTHON set")

KERNEL_SOURCE = """
from harness.compiled import njit


@njit(cache=True)
def add_one(x):
    return x + 1
"""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _call_fresh_kernel(path, monkeypatch, stderr: io.StringIO):
    """Import ``path`` as a new module (a new dispatcher, as in a new process), call its kernel
    twice with stderr replaced by ``stderr``; the kernel."""
    monkeypatch.setattr(compiled, "_announced", False)
    monkeypatch.setattr(sys, "stderr", stderr)
    spec = importlib.util.spec_from_file_location(f"kernel_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.add_one(1) == 2 and module.add_one(5) == 6
    return module.add_one


def test_a_cache_miss_says_so_once_and_a_cached_kernel_says_nothing(tmp_path, monkeypatch):
    path = tmp_path / "fresh.py"
    path.write_text(KERNEL_SOURCE)
    first = Terminal()
    kernel = _call_fresh_kernel(path, monkeypatch, first)
    assert sum(kernel.stats.cache_misses.values()) == 1 and not kernel.stats.cache_hits
    assert first.getvalue() == compiled.COMPILING_MESSAGE + "\n"  # once, though called twice

    again = Terminal()
    kernel = _call_fresh_kernel(path, monkeypatch, again)
    assert sum(kernel.stats.cache_hits.values()) == 1 and not kernel.stats.cache_misses
    assert again.getvalue() == ""


def test_nothing_is_printed_when_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    path = tmp_path / "captured.py"
    path.write_text(KERNEL_SOURCE)
    captured = io.StringIO()  # a pipe, a log, a refused command's one error line
    kernel = _call_fresh_kernel(path, monkeypatch, captured)
    assert sum(kernel.stats.cache_misses.values()) == 1  # it did compile
    assert captured.getvalue() == ""
