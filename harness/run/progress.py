"""Progress lines while a run plans: one line per planning phase on stderr, with
the elapsed time and, where the phase has one, the best estimate so far.

Systems report through :meth:`harness.system.PlanContext.report`; :func:`planning_progress` gives
the runner the reporter, or None (no lines) when stderr is not a terminal (a sweep's log, CI) or
``logger.progress_bar=false``. What a system decides never depends on it.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


class PlanningProgress:
    """Prints ``[plan 12.3s] <message>`` lines to ``stream``."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[plan {time.perf_counter() - self.start:5.1f}s] {message}", file=self.stream, flush=True)


def planning_progress(enabled: bool, stream: Optional[TextIO] = None) -> Optional[Callable[[str], None]]:
    """The reporter for a run: None unless ``enabled`` and ``stream`` (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    if not enabled or not getattr(stream, "isatty", lambda: False)():
        return None
    return PlanningProgress(stream)
