"""Optional compilation of numeric inner loops with numba.

This module owns the one switch between compiled and interpreted kernels: :func:`njit` is
numba's decorator when numba is importable, and the identity otherwise (or when
``HARNESS_PURE_PYTHON=1`` is set; ``RLHFUSE_PURE_PYTHON`` is an older name of the same switch).
Importing this module imports numba (about 0.3 s), so modules of kernels are imported where they
are first needed, not at package import. Kernels compiled with ``cache=True`` are cached next to
their module, so only the first process on a machine pays the compilation (about 20-30 s for all
kernels); that process says so once, on stderr when it is a terminal
(:data:`COMPILING_MESSAGE`), at the first kernel whose cache holds no machine code for its
arguments (numba's ``numba:compile`` event, signalled only on a cache miss), and a process that
finds them cached says nothing.
:func:`interpreted` gives the plain Python function behind a compiled one; the tests run both on
the same inputs and compare the results exactly.
"""
from __future__ import annotations

import os
import sys

_KERNELS: list = []  # every kernel made by :func:`njit` in this process
COMPILING_MESSAGE = "[harness] compiling the search kernels once (about 20-30 s; cached afterwards)"
_announced = False  # COMPILING_MESSAGE printed (or not to be printed) in this process

try:  # optional: every kernel also runs interpreted, only slower
    if os.environ.get("HARNESS_PURE_PYTHON") or os.environ.get("RLHFUSE_PURE_PYTHON"):
        raise ImportError("HARNESS_PURE_PYTHON is set")
    from numba import njit as _numba_njit
    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised where numba is absent
    AVAILABLE = False
    _numba_njit = None


def _announce_compilation() -> None:
    """Print :data:`COMPILING_MESSAGE` the first time a kernel compiles in this process, if stderr
    is a terminal (captured output, as a refused command's one ``error:`` line, gets nothing) and
    this is not a worker process of a search (its parent has said it)."""
    global _announced
    if _announced:
        return
    _announced = True
    import multiprocessing

    try:
        visible = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by something without isatty, or closed
        visible = False
    if visible and multiprocessing.parent_process() is None:
        print(COMPILING_MESSAGE, file=sys.stderr, flush=True)


if AVAILABLE:
    from numba.core import event as _numba_event

    class _CompileListener(_numba_event.Listener):
        """numba signals ``numba:compile`` when a dispatcher compiles a signature it could not load
        from its cache, before compiling it."""

        def on_start(self, event) -> None:
            if any(event.data["dispatcher"] is k for k in _KERNELS):
                _announce_compilation()

        def on_end(self, event) -> None:
            pass

    _numba_event.register("numba:compile", _CompileListener())


def njit(*args, **kwargs):
    """``numba.njit(*args, **kwargs)`` (the function itself without numba), remembered for
    :func:`warm`."""
    def wrap(fn):
        if _numba_njit is None:
            return fn
        kernel = _numba_njit(*args, **kwargs)(fn)
        _KERNELS.append(kernel)
        return kernel
    return wrap


_warm = False


def warm() -> bool:
    """Has this process already run a compiled kernel (so numba's start-up, about 0.3 s, is paid
    and another kernel's first call costs milliseconds)?"""
    global _warm
    if not _warm:
        _warm = any(k.signatures for k in _KERNELS)
    return _warm


def interpreted(fn):
    """The plain Python function behind a compiled one (itself when numba is absent)."""
    return getattr(fn, "py_func", fn)
