"""Optional compilation of numeric inner loops with numba.

This module owns the one switch between compiled and interpreted kernels: :func:`njit` is
numba's decorator when numba is importable, and the identity otherwise (or when
``HARNESS_PURE_PYTHON=1`` is set; ``RLHFUSE_PURE_PYTHON`` is an older name of the same switch).
Importing this module imports numba (about 0.3 s), so modules of kernels are imported where they
are first needed, not at package import. Kernels compiled with ``cache=True`` are cached next to
their module, so only the first process on a machine pays the compilation (a few seconds).
:func:`interpreted` gives the plain Python function behind a compiled one; the tests run both on
the same inputs and compare the results exactly.
"""
from __future__ import annotations

import os

_KERNELS: list = []  # every kernel made by :func:`njit` in this process

try:  # optional: every kernel also runs interpreted, only slower
    if os.environ.get("HARNESS_PURE_PYTHON") or os.environ.get("RLHFUSE_PURE_PYTHON"):
        raise ImportError("HARNESS_PURE_PYTHON is set")
    from numba import njit as _numba_njit
    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised where numba is absent
    AVAILABLE = False
    _numba_njit = None


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
